"""A trainer's counts: batches, rows, time waiting for data, and the file `splitfeed local`
reads them from (SPLITFEED_STATS_FILE); the data-ready histogram goes to the control block
too, where the sidecar's metrics read it (stalls.Published)."""

from __future__ import annotations

import json
import os
import time
from typing import Protocol

from ..contract import wellknown, stalls
from ..transport import ring


class Counted(Protocol):
    """What a batch tells the counters (taking.Batch)."""

    rows: int
    global_step: int


STATS_EVERY_S = 0.2
"""How often the stats file is rewritten: `splitfeed local` triggers rescales from it."""


class Stats:
    """Rows, steps and time spent waiting for data; `splitfeed local` reads the file."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.batches = 0
        self.rows = 0
        self.wait_s = 0.0
        self.first: float | None = None
        self.last_step = -1
        self.trained: int | None = None
        """Global steps trained, where the loop says so (StreamClient.trained)."""
        self.total_steps = 0
        self.steps_per_epoch = 0
        self._written = 0.0
        self.stalls = stalls.Stalls()
        self._published: stalls.Published | None = None

    def record(self, batch: Counted, wait_s: float) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now  # the first wait is start-up, not a stall
        else:
            self.wait_s += wait_s
        self.batches += 1
        self.rows += batch.rows
        self.last_step = batch.global_step
        bucket = self.stalls.record(wait_s, now)
        if self._published is not None:
            self._published.write(self.stalls, bucket, self.rows, self.batches)
        if now - self._written > STATS_EVERY_S:
            self.write()

    def attach(self, control: ring.Control) -> None:
        """Mirror the counts into this control block, where the sidecar reads them (stalls.Published)."""
        self._published = stalls.Published(control.progress)

    @property
    def stall(self) -> stalls.Summary:
        """Data-ready latency percentiles (p50_s, p95_s, p99_s) and `stall_share`, for the trainer to log."""
        return self.stalls.summary()

    def write(self, final: bool = False) -> None:
        if not self.path:
            return
        now = time.perf_counter()
        self._written = now
        elapsed = now - self.first if self.first is not None else 0.0
        record: wellknown.StatsRecord = {
            "batches": self.batches, "rows": self.rows, "wait_s": self.wait_s, "elapsed_s": elapsed,
            "last_step": self.last_step, "trained": self.trained, "total_steps": self.total_steps,
            "steps_per_epoch": self.steps_per_epoch, "final": final,
            "data_ready_buckets": self.stalls.counts}
        blob = json.dumps(record)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.write(blob)
        os.replace(tmp, self.path)


def stats_path(world_epoch: int) -> str | None:
    """SPLITFEED_STATS_FILE, its `{world}` (if any) the world epoch: one file per world."""
    path = os.environ.get(wellknown.STATS_FILE_ENV)
    return path.replace("{world}", str(world_epoch)) if path else None
