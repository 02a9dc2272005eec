"""A real DDP trainer with a `max_steps`: it returns before the job's last step (issue 21).

    python stopping_trainer.py LOG_DIR --stop-after N [--stop-rank R [--peers-wait]] [--no-close]
                               [--sleep-s S] [--checkpoint-every K] [--timeout-s T]

Most training scripts end this way: the README's loop (tests/e2e/trainer.py is the
full one) with a step limit, and often no `client.close()`:

    for batch in client:
        forward, backward (gloo all-reduce), optimizer step
        if client.checkpoint_requested or every K steps: checkpoint, rank 0 saves, commit
        if batch.global_step + 1 >= N: break            # max_steps (only rank R: --stop-rank R)
    [client.close()]                                    # left out with --no-close
    dist.destroy_process_group()                        # exit 0

With `--stop-rank R` the other ranks go on into the next all-reduce, which rank R never
joins: gloo raises there at once (its peer's connection closed). `--peers-wait` makes them
wait instead, as NCCL's all-reduce does (a sleep standing in for the collective that never
completes). Each rank appends tests/e2e/trainer.py's JSON lines (start, batch, checkpoint,
exit with reason "stopped", "drained" or "end") to LOG_DIR/w<worldEpoch>-r<rank>.jsonl.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from splitfeed.trainer_client.client import StreamClient


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("log_dir", type=Path)
    parser.add_argument("--stop-after", type=int, required=True, help="return after global step N - 1")
    parser.add_argument("--stop-rank", type=int, default=None, help="only this rank returns")
    parser.add_argument("--no-close", action="store_true", help="return without client.close()")
    parser.add_argument("--peers-wait", action="store_true",
                        help="with --stop-rank: the other ranks wait for ever after step N - 1 (NCCL)")
    parser.add_argument("--sleep-s", type=float, default=0.0)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args()
    world, rank = int(os.environ["SPLITFEED_WORLD_EPOCH"]), int(os.environ["RANK"])
    models = args.log_dir / "models"
    models.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    log = open(args.log_dir / f"w{world}-r{rank}.jsonl", "a")

    def record(**fields: Any) -> None:
        log.write(json.dumps({**fields, "t": time.time()}) + "\n")
        log.flush()

    client = StreamClient(timeout_s=args.timeout_s)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    record(event="start", pid=os.getpid(), world=world, worldSize=int(os.environ["WORLD_SIZE"]), rank=rank,
           resumeStep=client.resume_step, model=None, startup={})
    model = DistributedDataParallel(module)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    reason = "end"
    for batch in client:
        step = batch.global_step
        ids = batch["id"].tolist()
        loss = torch.nn.functional.cross_entropy(model(batch["vec"].float()), batch["label"].long())
        optimizer.zero_grad()
        loss.backward()  # DDP all-reduces the gradients: every rank waits for every other
        optimizer.step()
        del batch, loss
        requested = client.checkpoint_requested
        record(event="batch", step=step, ids=ids, requested=requested)
        time.sleep(args.sleep_s)
        if requested or (args.checkpoint_every and (step + 1) % args.checkpoint_every == 0):
            done = client.checkpoint()
            if rank == 0:
                torch.save(module.state_dict(), models / f"step-{done:06d}.pt")
            client.commit(done)
            record(event="checkpoint", step=done, drained=client.drained)
            if client.drained:
                reason = "drained"
                break
        if step + 1 >= args.stop_after and args.stop_rank in (None, rank):
            reason = "stopped"
            break
        if step + 1 >= args.stop_after and args.peers_wait:
            record(event="waiting", step=step)
            while True:  # the next all-reduce, which the returned rank never joins
                time.sleep(1)
    record(event="exit", reason=reason)
    log.close()
    if not args.no_close:
        client.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
