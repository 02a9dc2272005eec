"""A Lightning trainer on splitfeed, as the README's "Lightning" section writes it, with the
logs tests/support/exactness.py reads (see tests/e2e/trainer.py for the format).

    python lightning_trainer.py LOG_DIR [--max-steps N] [--sleep-s S] [--sigterm-at STEP]

Each rank logs the batches Lightning *trained* (in `training_step`), so a batch fetched ahead
and never trained shows as a gap that the exactness check fails on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from splitfeed.trainer_client import StreamClient
from splitfeed.trainer_client.integrations.lightning import (
    SplitfeedCheckpoint,
    SplitfeedDataModule,
    trainer_arguments,
)

CLASSES = 10


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class UnsizedDataModule(SplitfeedDataModule):
    def __init__(self, client: StreamClient) -> None:
        super().__init__(client)
        self.dataset = Unsized(self.dataset)


class Unsized(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """The client's dataset without `__len__`: Lightning's fetcher takes a batch ahead of the one it trains."""

    def __init__(self, dataset: Any) -> None:
        self.dataset, self.handed = dataset, dataset.handed

    def __iter__(self) -> Any:
        return iter(self.dataset)


class Model(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, CLASSES))
        self.args = args
        world, rank = os.environ["SPLITFEED_WORLD_EPOCH"], os.environ["RANK"]
        self.log_file = open(args.log_dir / f"w{world}-r{rank}.jsonl", "a")

    @property
    def client(self) -> StreamClient:
        return self.trainer.datamodule.client

    def record(self, **fields: Any) -> None:
        self.log_file.write(json.dumps({**fields, "t": time.time()}) + "\n")
        self.log_file.flush()

    def on_train_start(self) -> None:
        self.record(event="start", pid=os.getpid(), world=int(os.environ["SPLITFEED_WORLD_EPOCH"]),
                    worldSize=self.client.world_size, rank=self.client.rank, resumeStep=self.client.resume_step,
                    model=digest(self.net) if self.client.resume_step else None,
                    globalStep=self.trainer.global_step)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step = batch.global_step
        loss = torch.nn.functional.cross_entropy(self.net(batch["vec"].float()), batch["label"].long())
        self.record(event="batch", step=step, ids=batch["id"].tolist(),
                    requested=self.client.checkpoint_step == step + 1, loss=round(loss.item(), 6))
        if self.args.sigterm_at == step and self.client.rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # preemption, as the kubelet sends it
        time.sleep(self.args.sleep_s)
        return loss

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.record(event="checkpoint", step=self.client.checkpoint_position, drained=self.client.drained,
                    model=digest(self.net))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("log_dir", type=lambda p: Path(p).resolve())
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--sleep-s", type=float, default=0.0)
    parser.add_argument("--unsized", action="store_true",
                        help="hide the data's len(), as a user's own wrapper would: Lightning then reads one ahead")
    parser.add_argument("--sigterm-at", type=int, default=None, help="rank 0 sends itself SIGTERM at this step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.chdir(args.log_dir)
    options = {"max_steps": args.max_steps, "accelerator": "cpu", "logger": False, "enable_checkpointing": False,
               "enable_progress_bar": False, "enable_model_summary": False}
    model = Model(args)
    global SplitfeedDataModule
    if args.unsized:
        SplitfeedDataModule = UnsizedDataModule
    # README, "Lightning, the Hugging Face Trainer, a DataLoader", as written there:
    client = StreamClient()
    checkpoints = SplitfeedCheckpoint(client, "models")  # Lightning checkpoints, one per agreed step
    trainer = pl.Trainer(callbacks=[checkpoints], **trainer_arguments(client), **options)
    trainer.fit(model, datamodule=SplitfeedDataModule(client), ckpt_path=checkpoints.resume_path)
    client.close()
    # (README ends.)
    reason = "drained" if client.drained else ("stopped" if client.steps_left else "end")
    model.record(event="exit", reason=reason, globalStep=trainer.global_step)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
