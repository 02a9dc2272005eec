"""A Hugging Face Trainer on splitfeed, as the README's section writes it, with the logs
tests/support/exactness.py reads (see tests/e2e/trainer.py for the format).

    python hf_trainer.py LOG_DIR [--max-steps N] [--sleep-s S]

Each rank logs the batches the Trainer trained (its `training_step`), in exactness's format.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainingArguments

from splitfeed.trainer_client import StreamClient
from splitfeed.trainer_client.integrations import hf

CLASSES = 10


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, CLASSES))

    def forward(self, vec: torch.Tensor, label: torch.Tensor, **columns: Any) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.cross_entropy(self.net(vec.float()), label.long())}


class SplitfeedTrainer(hf.SplitfeedTrainer):
    """The integration's Trainer, logging each batch as it trains it and each checkpoint's model."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        world, rank = os.environ["SPLITFEED_WORLD_EPOCH"], os.environ["RANK"]
        self.log_file = open(f"w{world}-r{rank}.jsonl", "a")  # in LOG_DIR, the working directory
        self.sleep_s = float(os.environ.get("TEST_SLEEP_S", "0"))
        self.add_callback(Recorder(self))

    def record(self, **fields: Any) -> None:
        self.log_file.write(json.dumps({**fields, "t": time.time()}) + "\n")
        self.log_file.flush()

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        step = inputs.global_step
        self.record(event="batch", step=step, ids=inputs["id"].tolist(),
                    requested=self.client.checkpoint_step == step + 1)
        time.sleep(self.sleep_s)
        return super().training_step(model, inputs, num_items_in_batch)


class Recorder(TrainerCallback):
    def __init__(self, trainer: SplitfeedTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        client = self.trainer.client
        self.trainer.record(event="start", pid=os.getpid(), world=int(os.environ["SPLITFEED_WORLD_EPOCH"]),
                            worldSize=client.world_size, rank=client.rank, resumeStep=client.resume_step,
                            model=digest(self.trainer.model) if client.resume_step else None,
                            globalStep=state.global_step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        client = self.trainer.client
        self.trainer.record(event="checkpoint", step=client.checkpoint_position, drained=client.drained,
                            model=digest(self.trainer.model))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("log_dir", type=lambda p: Path(p).resolve())
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--sleep-s", type=float, default=0.0)
    args = parser.parse_args()
    os.environ["TEST_SLEEP_S"] = str(args.sleep_s)
    torch.set_num_threads(1)
    os.chdir(args.log_dir)
    options = {"max_steps": args.max_steps, "use_cpu": True, "ddp_backend": "gloo", "learning_rate": 0.05,
               "report_to": [], "save_strategy": "no", "logging_strategy": "no", "disable_tqdm": True}
    model = Net()
    # README, "Lightning, the Hugging Face Trainer, a DataLoader", as written there:
    client = StreamClient()
    args = TrainingArguments("models", **options)  # max_steps defaults to the job's steps
    trainer = SplitfeedTrainer(client, model=model, args=args)  # no train_dataset: the client is it
    trainer.train(resume_from_checkpoint=trainer.resume_path)
    client.close()
    # (README ends.)
    reason = "drained" if client.drained else ("stopped" if client.steps_left else "end")
    trainer.record(event="exit", reason=reason, globalStep=trainer.state.global_step)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
