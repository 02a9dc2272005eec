"""A tiny data-parallel trainer fed by splitfeed: what a user's script looks like.

Trains a linear classifier with torch DistributedDataParallel (gloo, CPU) on
the batches `StreamClient` yields, checkpoints data + model when asked (or at
--stop-at-step, to show an elastic resume), and records the ids of every batch
it receives so the demo can compare global batches across world sizes.

    splitfeed local -f examples/demo-job.yaml -- python examples/train.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from splitfeed.trainer_client.client import StreamClient


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path, help="where ids and models go")
    parser.add_argument("--stop-at-step", type=int, help="checkpoint and stop after this many global steps")
    parser.add_argument("--features", type=int, default=16)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    client = StreamClient()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(args.features, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    args.out.mkdir(parents=True, exist_ok=True)
    models = args.out / "models"
    models.mkdir(exist_ok=True)
    if client.resume_step:
        state = torch.load(models / f"step-{client.resume_step}.pt")
        model.module.load_state_dict(state)
    ids_log = open(args.out / f"ids-rank{client.rank}-of{client.world_size}.jsonl", "a")

    for batch in client:
        x = batch["features"].float()
        y = batch["label"].long() % 4
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ids_log.write(json.dumps({"step": batch.global_step, "ids": batch["id"].tolist()}) + "\n")
        done = batch.global_step + 1
        if client.checkpoint_requested or done == args.stop_at_step:
            step = client.checkpoint()
            if client.rank == 0:
                torch.save(model.module.state_dict(), models / f"step-{step}.pt")
            dist.barrier()
            if done == args.stop_at_step or client.drained:
                break
    ids_log.close()
    client.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
