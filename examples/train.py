"""A tiny data-parallel trainer fed by splitfeed: what a user's script looks like.

Trains a linear classifier with torch DistributedDataParallel (gloo, CPU) on
the batches `StreamClient` yields, checkpoints data + model when asked (or at
--stop-at-step, to show an elastic resume), and records the ids of every batch
it receives so the demo can compare global batches across world sizes.

The loop is the README's: `client.checkpoint_requested` is true on the same
step on every rank (the sidecars agree on it), so no barrier is needed around
it; rank 0 saves the model (DDP keeps the replicas identical), and
`client.commit(step)` makes the step resumable only once that model exists.

    splitfeed local -f examples/demo-job.yaml -- python examples/train.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from splitfeed.trainer_client.script.client import StreamClient


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path, help="where ids and models go")
    parser.add_argument("--stop-at-step", type=int, help="checkpoint and stop after this many global steps")
    parser.add_argument("--features", type=int, default=16)
    args = parser.parse_args()

    client = StreamClient()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    models = args.out / "models"
    models.mkdir(exist_ok=True)
    module = torch.nn.Linear(args.features, 4)
    if client.resume_step:
        module.load_state_dict(torch.load(models / f"step-{client.resume_step}.pt"))
    model = torch.nn.parallel.DistributedDataParallel(module)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids_log = open(args.out / f"ids-rank{client.rank}-of{client.world_size}.jsonl", "a")

    for batch in client:
        x = batch["features"].float()
        y = batch["label"].long() % 4
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ids_log.write(json.dumps({"step": batch.global_step, "ids": batch["id"].tolist()}) + "\n")
        want_to_save = batch.global_step + 1 == args.stop_at_step
        if client.checkpoint_requested or want_to_save:
            step = client.checkpoint()  # this rank's data position
            if client.rank == 0:
                tmp = models / f".step-{step}.pt.tmp"
                torch.save(module.state_dict(), tmp)
                os.replace(tmp, models / f"step-{step}.pt")
            client.commit(step)  # the step may now be resumed
            if client.drained or want_to_save:
                break
    ids_log.close()
    client.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
