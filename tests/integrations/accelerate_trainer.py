"""A loop of its own on Hugging Face Accelerate (no Trainer), as the README's section writes it,
with the logs tests/support/exactness.py reads (see tests/e2e/trainer.py for the format).

    python accelerate_trainer.py LOG_DIR [--sleep-s S]

Accelerate prepares the model and the optimizer, never the data: a prepared loader over an
iterable would be read on rank 0 alone and dispatched, or sharded again, and read one ahead.
The client is not a DataLoader, so `accelerator.prepare` leaves it alone even if passed.
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
from accelerate import Accelerator

from splitfeed.trainer_client import StreamClient

CLASSES = 10
LOG: dict[str, Any] = {}


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.removeprefix("module.").encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def record(**fields: Any) -> None:
    LOG["file"].write(json.dumps({**fields, "t": time.time()}) + "\n")
    LOG["file"].flush()


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, CLASSES))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any, accelerator: Accelerator,
               client: StreamClient) -> None:
    if "started" not in LOG:  # the model as this world starts: the one loaded at a resume
        LOG["started"], LOG["client"] = True, client
        record(event="start", pid=os.getpid(), world=client.world_epoch, worldSize=client.world_size,
               rank=client.rank, resumeStep=client.resume_step,
               model=digest(accelerator.unwrap_model(model)) if client.resume_step else None)
    record(event="batch", step=batch.global_step, ids=batch["id"].tolist(),
           requested=client.checkpoint_step == batch.global_step + 1)
    loss = torch.nn.functional.cross_entropy(model(batch["vec"].float()), batch["label"].long())
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    time.sleep(LOG["sleep_s"])


def logging_saves(accelerator_class: type[Accelerator]) -> None:
    """Log each checkpoint as exactness reads it, after Accelerate's own save (which is unchanged)."""
    save = accelerator_class.save_state

    def save_state(self: Accelerator, output_dir: str, **kwargs: Any) -> Any:
        out = save(self, output_dir, **kwargs)
        record(event="checkpoint", step=int(Path(output_dir).name), drained=LOG["client"].drained,
               model=digest(self.unwrap_model(self._models[0])))
        return out

    accelerator_class.save_state = save_state  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("log_dir", type=lambda p: Path(p).resolve())
    parser.add_argument("--sleep-s", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.chdir(args.log_dir)
    world, rank = os.environ["SPLITFEED_WORLD_EPOCH"], os.environ["RANK"]
    LOG.update(file=open(f"w{world}-r{rank}.jsonl", "a"), sleep_s=args.sleep_s)
    logging_saves(Accelerator)
    model, optimizer = build()
    # README, "Accelerate", as written there:
    client = StreamClient()  # before Accelerator(): a process may be moved to the world it joins
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)  # not the data: the client is the loader
    if client.resume_step:
        accelerator.load_state(f"models/{client.resume_step}")  # model, optimizer, RNG of that step
    for batch in client:
        train_step(model, optimizer, batch.to(accelerator.device), accelerator, client)
        if client.checkpoint_requested:
            step = client.checkpoint()
            accelerator.save_state(f"models/{step}")  # every rank calls it; the main one writes
            client.commit(step)
            if client.drained:
                break
    client.close()
    # (README ends.)
    reason = "drained" if client.drained else ("stopped" if client.steps_left else "end")
    record(event="exit", reason=reason)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
