"""The Hugging Face Trainer on a StreamClient (README, "Hugging Face Trainer").

    client = StreamClient()
    trainer = SplitfeedTrainer(client, model=model, args=TrainingArguments("out", ...))
    trainer.train(resume_from_checkpoint=trainer.resume_path)

What the plain Trainer does wrong with an iterable stream, and what this changes:
- Accelerate's `prepare` would either read on rank 0 alone and dispatch (the default for an
  iterable: the other ranks' splits are never read) or shard the stream again: the loader
  here is the client's own, not prepared, so each rank trains exactly its splits.
- A resume would skip `resume_step` batches the sidecar already skipped: `ignore_data_skip`.
- `max_steps` is the job's steps (the stream's length is not the epoch's).
- Checkpoints are two-phase at the world's agreed steps: the data position of the steps
  trained (`client.checkpoint(after_step)`) when the step ends, the Trainer's own save
  (model, optimizer, scheduler, `global_step`), then `client.commit` in `on_save`; a drain
  stops training there. Each checkpoint folder records its splitfeed step (`splitfeed.json`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..script.client import StreamClient
from ..script.loading import iterable_dataset

STEP_FILE = "splitfeed.json"
"""In each Trainer checkpoint folder: {"step": the global splitfeed step it holds}."""


class SplitfeedCallback(TrainerCallback):
    """Marks the steps trained, checkpoints the agreed ones, commits once the Trainer saved."""

    def __init__(self, client: StreamClient, dataset: Any) -> None:
        self.client = client
        self.dataset = dataset
        self.prepared: int | None = None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        # The Trainer takes an optimizer step's batches (gradient_accumulation_steps of them, fewer
        # where the stream ends) before it trains them: at its end all it took is trained.
        steps = self.dataset.handed.trained_all()
        self.client.trained(steps)
        last = state.global_step >= state.max_steps
        if self.client.checkpoint_requested or (last and steps > self.client.resume_step):
            self.prepared = self.client.checkpoint(after_step=steps)
            control.should_save = True
            if self.client.drained:
                control.should_training_stop = True

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        if self.prepared is None:
            return  # a save of the Trainer's own schedule (save_steps): no data position was taken
        folder = Path(str(args.output_dir)) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero:
            (folder / STEP_FILE).write_text(json.dumps({"step": self.prepared}))
        self.client.commit(self.prepared)
        self.prepared = None


class SplitfeedTrainer(Trainer):
    """A Trainer whose training data is `client`'s stream (pass no train_dataset)."""

    def __init__(self, client: StreamClient, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("train_dataset") is not None:
            raise ValueError("SplitfeedTrainer reads its training data from the StreamClient: "
                             "pass no train_dataset")
        self.client = client
        self.splitfeed_data = iterable_dataset(client)
        super().__init__(*args, **kwargs)
        steps = self.args.gradient_accumulation_steps
        if client.total_steps % steps:
            raise ValueError(f"gradient_accumulation_steps={steps} does not divide the job's "
                             f"{client.total_steps} global steps")
        self.args.ignore_data_skip = True  # the sidecar resumes at the step itself
        if self.args.max_steps <= 0:
            self.args.max_steps = client.total_steps // steps
        self.add_callback(SplitfeedCallback(client, self.splitfeed_data))

    def get_train_dataloader(self) -> DataLoader[Any]:
        """The client's loader, not `accelerator.prepare`d: neither dispatched nor sharded again."""
        return DataLoader(self.splitfeed_data, batch_size=None, pin_memory=self.args.dataloader_pin_memory
                          and self.args.device.type != "cpu")

    @property
    def resume_path(self) -> str | None:
        """The Trainer checkpoint of the step this world resumes at (None at step 0): `train`'s
        `resume_from_checkpoint`."""
        step = self.client.resume_step
        if not step:
            return None
        for folder in Path(str(self.args.output_dir)).glob("checkpoint-*"):
            marker = folder / STEP_FILE
            if marker.exists() and json.loads(marker.read_text()).get("step") == step:
                return str(folder)
        raise FileNotFoundError(f"the world resumes at global step {step}, but no checkpoint under "
                                f"{self.args.output_dir} holds it: the data position and the model would disagree")
