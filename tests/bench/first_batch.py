"""The bench's trainer: when its first batch came, then steady rows/s, then it returns.

    python -m tests.bench.first_batch OUT STEPS [lockstep]

Writes {"first_batch_at": time.time(), "rows_per_s": ..., "rank": ..., and the p99 of its
waits for a batch at an epoch's first step and at the others} to OUT.RANK.json.
It returns after STEPS batches without waiting for the epoch's end, as a max_steps loop
does (`splitfeed local` ends such a run cleanly). With `lockstep` the ranks all-reduce a
scalar after each batch over gloo, as DDP's gradient all-reduce holds a real world's ranks
within the prefetch of one another (the wait for it is not a wait for data).
"""

from __future__ import annotations

import atexit
import json
import sys
import time
from collections.abc import Callable

from splitfeed.trainer_client.script.client import StreamClient


def p99(values: list[float]) -> float | None:
    """The 99th percentile of how long the trainer waited for a batch (None: no batch)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _all_reduce(client: StreamClient) -> Callable[[], None]:
    """The world's gloo group, and a step's all-reduce of one scalar over it."""
    import torch
    import torch.distributed as dist

    from splitfeed.trainer_client import init_process_group

    init_process_group(client.world, "gloo")
    atexit.register(dist.destroy_process_group)  # a live gloo group aborts the interpreter's exit
    one = torch.zeros(1)
    return lambda: dist.all_reduce(one)


def main() -> int:
    out, steps = sys.argv[1], int(sys.argv[2])
    lockstep = sys.argv[3:] == ["lockstep"]
    with StreamClient(timeout_s=900, as_tensors=False) as client:
        step_done = _all_reduce(client) if lockstep else (lambda: None)
        batches = iter(client)
        next(batches)
        first = time.time()
        rows, started, taken = 0, time.perf_counter(), 0
        waits: dict[str, list[float]] = {"epoch_start": [], "steady": [], "mid_epoch": []}
        mid = client.steps_per_epoch // 2
        asked = time.perf_counter()
        for batch in batches:
            waited = time.perf_counter() - asked
            waits["epoch_start" if batch.step == 0 else "steady"].append(waited)
            if batch.step == mid:  # the control: a step as rare as an epoch's first, and nothing special
                waits["mid_epoch"].append(waited)
            rows += len(batch["id"])
            taken += 1
            step_done()
            if taken == steps:
                break
            asked = time.perf_counter()
        elapsed = time.perf_counter() - started
        result = {"first_batch_at": first, "rows_per_s": rows / elapsed if elapsed else 0.0,
                  "rank": client.rank, "steps": taken,
                  **{f"{kind}_p99_s": p99(values) for kind, values in waits.items()}}
    with open(f"{out}.{result['rank']}.json", "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
