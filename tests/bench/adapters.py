"""What the framework adapters cost per batch: rows/s of each way a trainer reads, against the
bare StreamClient loop over the same sidecar and table in the same run (issue goal: >= 0.95).

    python -m tests.bench.adapters [RUNS]

Ways: `dataloader` (torch's DataLoader(client.as_iterable_dataset(), batch_size=None): its
fetcher and default_convert's copy of each Batch); `trained` (the bare loop telling the client
each step it trained); `lightning` (what the Lightning callback adds per batch: the dataset's
count of steps handed out, `trained`, `checkpoint_requested`). The loops do no training, so
the figures are the adapters' cost alone, at its largest. Runs interleave the ways, each way's
worst and best ratio to the bare loop of the same round are reported.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from splitfeed.trainer_client.script.client import StreamClient
from tests.bench import run

GOAL = 0.95
EPOCHS = 4
"""Passes over the bench table per measurement: one took under half a second at this machine's
rates, short enough that a moment of the machine's other work decided the ratio."""


def dataloader(client: StreamClient) -> Iterator[int]:
    from torch.utils.data import DataLoader

    for batch in DataLoader(client.as_iterable_dataset(), batch_size=None):
        yield len(batch["id"])


def trained(client: StreamClient) -> Iterator[int]:
    for batch in client:
        rows = len(batch["id"])
        client.trained(batch)
        yield rows


def lightning(client: StreamClient) -> Iterator[int]:
    dataset = client.as_iterable_dataset()
    for batch in dataset:
        rows = len(batch["id"])
        client.trained(dataset.handed.trained_one())  # SplitfeedCheckpoint.on_train_batch_end
        if client.checkpoint_requested:
            raise AssertionError("no checkpoint is asked in this bench")
        yield rows


WAYS: dict[str, Callable[[StreamClient], Iterator[int]]] = {
    "dataloader": dataloader, "trained": trained, "lightning": lightning}


def bench(runs: int = 3) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="sf-bench-adapters-"))
    try:
        uri = str(workdir / "db")
        run.write_table(uri)
        ratios: dict[str, list[float]] = {way: [] for way in WAYS}
        bare: list[float] = []
        for _ in range(runs):
            base = run.sidecar_rows_per_s(uri, workdir, epochs=EPOCHS)
            bare.append(base)
            for way, loop in WAYS.items():
                ratios[way].append(run.sidecar_rows_per_s(uri, workdir, loop, epochs=EPOCHS) / base)
        out = {"bare_rows_per_s": [round(b) for b in bare], "load_average": round(os.getloadavg()[0], 2)}
        for way, r in ratios.items():
            out[way] = {"worst": round(min(r), 3), "median": round(statistics.median(r), 3), "best": round(max(r), 3)}
            print(f"  {way:<11} rows/s {min(r):.3f}-{max(r):.3f} (median {statistics.median(r):.3f}) x the "
                  f"bare loop's ({min(bare):,.0f}-{max(bare):,.0f} rows/s)", flush=True)
        return out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def verdicts(result: dict) -> list[str]:
    return [f"adapter {way} rows/s worst {result[way]['worst']:.3f} x the bare loop >= {GOAL}: "
            f"{'met' if result[way]['worst'] >= GOAL else 'MISSED'}" for way in WAYS]


if __name__ == "__main__":
    result = bench(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
    print(json.dumps(result, indent=2))
    print("\n".join(verdicts(result)))
