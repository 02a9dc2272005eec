"""The sidecar's world: the agreement on a drain step (pure, and its thread), data checkpoints,
the commitments and identity a restarted sidecar reads back."""
