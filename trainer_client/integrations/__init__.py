"""Adapters for the training stacks people use (Lightning, the Hugging Face Trainer): each keeps
splitfeed's promise there, counting what the framework trained, not what it read ahead."""
