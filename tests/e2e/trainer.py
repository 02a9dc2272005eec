"""The trainer container of the end-to-end tests: a stand-in for synchronous data-parallel training.

    python trainer.py LOG_DIR [--sleep-s S] [--checkpoint-every K] [--timeout-s T]

The pods' `trainer` container runs this (the test kubelet runs it as a local
process). Like tests/dataplane/trainer_script.py it logs the ids of every batch
it receives, flushed before it asks for the next one; it adds what a multi-pod
run needs. Each rank appends JSON lines to LOG_DIR/w<worldEpoch>-r<rank>.jsonl:

    {"event": "start", "pid", "world", "worldSize", "rank", "resumeStep"}
    {"event": "batch", "step": <global step>, "ids": [...]}
    {"event": "checkpoint", "step": <steps completed>, "drained": bool}
    {"event": "checkpoint-failed", "step": <steps completed>, "error": "..."}
    {"event": "exit", "reason": "drained" | "end"}

Lockstep. Real DDP ranks are held in step by their collectives, and they decide
to checkpoint together (one rank's wish is all-reduced), so a drain leaves a
complete checkpoint. Here a file barrier plays the collective: after each step a
rank writes LOG_DIR/w<epoch>/s<step>-r<rank> holding its wish to checkpoint
(the sidecar asked, or every K steps) and waits until every rank of its world
has written that step or exited; if any rank wished, all checkpoint there. A
rank whose own sidecar has not seen the drain yet checkpoints without being
drained and goes on until it sees it (its extra batches are past the complete
checkpoint: the next world receives them again).

`--sleep-s` paces the steps so that a test can scale mid-epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from splitfeed.trainer_client.client import StreamClient
from splitfeed.trainer_client.errors import CheckpointError


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Barrier:
    """All-reduce of one flag per step over files: every live rank of the world, or wait."""

    def __init__(self, directory: Path, rank: int, world_size: int) -> None:
        self.dir, self.rank, self.world_size = directory, rank, world_size
        self.dir.mkdir(parents=True, exist_ok=True)

    def any(self, step: int, wish: bool) -> bool:
        _write(self.dir / f"s{step}-r{self.rank}", "1" if wish else "0")
        while True:
            wishes = []
            for r in range(self.world_size):
                mark = self.dir / f"s{step}-r{r}"
                if mark.exists():
                    wishes.append(mark.read_text() == "1")
                elif not (self.dir / f"exit-r{r}").exists():
                    break
            else:
                return any(wishes)
            time.sleep(0.02)

    def leave(self) -> None:
        _write(self.dir / f"exit-r{self.rank}", "")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("log_dir", type=Path)
    parser.add_argument("--sleep-s", type=float, default=0.0, help="pause after each step")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="also checkpoint every K steps")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="StreamClient timeout")
    args = parser.parse_args()
    world, rank = int(os.environ["SPLITFEED_WORLD_EPOCH"]), int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    args.log_dir.mkdir(parents=True, exist_ok=True)
    barrier = Barrier(args.log_dir / f"w{world}", rank, world_size)
    client = StreamClient(timeout_s=args.timeout_s, as_tensors=False)
    with open(args.log_dir / f"w{world}-r{rank}.jsonl", "a") as log:
        def record(**fields: object) -> None:
            log.write(json.dumps(fields) + "\n")
            log.flush()

        record(event="start", pid=os.getpid(), world=world, worldSize=world_size, rank=rank,
               resumeStep=client.resume_step)
        reason = "end"
        for batch in client:
            step = batch.global_step
            record(event="batch", step=step, ids=batch["id"].tolist())
            del batch
            time.sleep(args.sleep_s)
            periodic = args.checkpoint_every > 0 and (step + 1) % args.checkpoint_every == 0
            if barrier.any(step, client.checkpoint_requested or periodic):
                try:
                    done = client.checkpoint()
                except CheckpointError as exc:
                    record(event="checkpoint-failed", step=step + 1, error=str(exc))
                else:
                    record(event="checkpoint", step=done, drained=client.drained)
                if client.drained:
                    reason = "drained"
                    break
        record(event="exit", reason=reason)
    barrier.leave()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
