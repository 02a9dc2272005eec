"""The bench's trainer: when its first batch came, then steady rows/s, then it returns.

    python -m tests.bench.first_batch OUT STEPS

Writes {"first_batch_at": time.time(), "rows_per_s": ..., "rank": ..., and the p99 of its
waits for a batch at an epoch's first step and at the others} to OUT.RANK.json.
It returns after STEPS batches without waiting for the epoch's end, as a max_steps loop
does (`splitfeed local` ends such a run cleanly).
"""

from __future__ import annotations

import json
import sys
import time

from splitfeed.trainer_client.client import StreamClient


def p99(values: list[float]) -> float | None:
    """The 99th percentile of how long the trainer waited for a batch (None: no batch)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main() -> int:
    out, steps = sys.argv[1], int(sys.argv[2])
    with StreamClient(timeout_s=900, as_tensors=False) as client:
        batches = iter(client)
        next(batches)
        first = time.time()
        rows, started, taken = 0, time.perf_counter(), 0
        waits: dict[str, list[float]] = {"epoch_start": [], "steady": []}
        asked = time.perf_counter()
        for batch in batches:
            waits["epoch_start" if batch.step == 0 else "steady"].append(time.perf_counter() - asked)
            rows += len(batch["id"])
            taken += 1
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
