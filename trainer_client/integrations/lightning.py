"""PyTorch Lightning on a StreamClient: a DataModule, a checkpoint callback and the Trainer's
arguments from the job (README, "Lightning").

    client = StreamClient()
    checkpoints = SplitfeedCheckpoint(client, "ckpt")
    trainer = L.Trainer(callbacks=[checkpoints], **trainer_arguments(client))
    trainer.fit(model, datamodule=SplitfeedDataModule(client), ckpt_path=checkpoints.resume_path)

Lightning's fetcher takes batch k + 1 before it trains batch k, so what was handed out is one
ahead of what was trained: the callback tells the client each trained step
(`StreamClient.trained`), checkpoints the world's agreed step once it is *trained*, saves
Lightning's own checkpoint for it (model, optimizer, `global_step`) before the commit, and
stops the Trainer when the world drains. A Lightning epoch is this world's stream: the
sidecar's epochs follow from the global step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from ..script.client import StreamClient
from ..script.loading import iterable_dataset


def trainer_arguments(client: StreamClient) -> dict[str, Any]:
    """`num_nodes`, `devices` and `strategy` for this world: a replica is a Lightning node, its
    GPUs (ranks) the node's devices. Sets NODE_RANK, which Lightning reads for the node's place."""
    world = client.world
    per_replica = max(1, world.world_size // world.replicas)
    os.environ["NODE_RANK"] = str(world.rank // per_replica)
    return {"num_nodes": world.replicas, "devices": per_replica, "strategy": "ddp",
            "use_distributed_sampler": False}


class SplitfeedDataModule(pl.LightningDataModule):
    """The client's batches as the training data (one Lightning epoch: this world's stream)."""

    def __init__(self, client: StreamClient) -> None:
        super().__init__()
        self.client = client
        self.dataset = iterable_dataset(client)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=None)


class SplitfeedCheckpoint(pl.Callback):
    """Two-phase checkpoints at the world's agreed steps, of the steps Lightning trained.

    At a checkpoint step: `client.checkpoint(after_step)` (the data position), then
    `trainer.save_checkpoint` (every rank calls it, rank 0 writes, a barrier follows), then
    `client.commit`: a step is resumable only once its model exists. When the world drains
    there the Trainer stops; the training's end (`max_steps`) checkpoints the last trained step.
    """

    def __init__(self, client: StreamClient, dirpath: str | os.PathLike[str]) -> None:
        self.client = client
        self.dirpath = Path(dirpath)
        self.saved: int | None = None
        """The last step checkpointed and committed."""

    def path(self, step: int) -> Path:
        return self.dirpath / f"step-{step}.ckpt"

    @property
    def resume_path(self) -> str | None:
        """Lightning's checkpoint of the step this world resumes at (None at step 0): `fit`'s `ckpt_path`."""
        step = self.client.resume_step
        if not step:
            return None
        path = self.path(step)
        if not path.exists():
            raise FileNotFoundError(f"the world resumes at global step {step}, but its model {path} was "
                                    "never saved: the data position and the model would disagree")
        return str(path)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning installed its SIGTERM handler over the client's just before this hook; its
        # handler broadcasts inside the signal handler, which deadlocks DDP ranks. The client's
        # asks the world to drain at one step instead.
        self.client.reclaim_sigterm()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        steps = _dataset(trainer).handed.trained_one()
        self.client.trained(steps)
        if self.client.checkpoint_requested:
            self._save(trainer, steps)
            if self.client.drained:
                trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A `max_steps` (or early) stop: the last trained step becomes resumable."""
        steps = self.client.checkpoint_position
        if not self.client.drained and steps > (self.saved or self.client.resume_step):
            self._save(trainer, steps)

    def _save(self, trainer: pl.Trainer, steps: int) -> None:
        step = self.client.checkpoint(after_step=steps)
        self.dirpath.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(self.path(step))
        self.client.commit(step)
        self.saved = step


def _dataset(trainer: pl.Trainer) -> Any:
    loader = trainer.train_dataloader
    dataset = getattr(loader, "dataset", None)
    if not hasattr(dataset, "handed"):
        raise TypeError("SplitfeedCheckpoint needs the training data from SplitfeedDataModule (or a "
                        "DataLoader over client.as_iterable_dataset()): it counts the steps trained there")
    return dataset
