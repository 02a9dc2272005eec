"""Data-ready latency: how long a trainer waited for each batch, as a fixed-bucket histogram.

The trainer measures (it is the only side that knows when it asked for a
batch); the sidecar, the world's coordinator and the operator only read the
cumulative counts, so the numbers are the same wherever they are shown
(`client.stats`, `splitfeed local`'s summary, `/metrics`, `status.progress`).
Fixed buckets, the same everywhere, because histograms of several ranks are
merged by adding their counts, and Prometheus' own histograms work that way.

Pure code: no clock, no I/O. The trainer's first batch is not counted as a
stall (its wait is the world starting up), and wall time runs from it.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
"""Upper bounds (seconds) of the data-ready buckets; one more bucket holds everything above."""
NUM_BUCKETS = len(BUCKETS_S) + 1


def bucket_of(wait_s: float) -> int:
    """The index of the bucket `wait_s` falls in (upper bound inclusive, as Prometheus' `le`)."""
    return bisect.bisect_left(BUCKETS_S, wait_s)


def quantile(counts: Sequence[int], q: float) -> float | None:
    """The q-quantile (0 < q < 1) of a histogram of per-bucket counts; None when empty.

    Linear interpolation inside the bucket, as Prometheus' histogram_quantile
    does; the open top bucket answers with the highest finite bound.
    """
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(counts):
        if count and seen + count >= rank:
            if index >= len(BUCKETS_S):
                return BUCKETS_S[-1]
            lower = BUCKETS_S[index - 1] if index else 0.0
            return lower + (BUCKETS_S[index] - lower) * (rank - seen) / count
        seen += count
    return BUCKETS_S[-1]


def merge(histograms: Sequence[Sequence[int]]) -> list[int]:
    """Bucket-wise sum of several ranks' counts (each of NUM_BUCKETS)."""
    out = [0] * NUM_BUCKETS
    for counts in histograms:
        for index, count in enumerate(counts[:NUM_BUCKETS]):
            out[index] += int(count)
    return out


@dataclasses.dataclass(frozen=True)
class Summary:
    """What a trainer (or the status) shows: percentiles of data-ready latency and the stall share."""

    batches: int
    """Batches counted (the first one, start-up, is not)."""
    wait_s: float
    wall_s: float
    p50_s: float | None
    p95_s: float | None
    p99_s: float | None

    @property
    def stall_share(self) -> float:
        """Time spent waiting for data / wall time, 0..1 (0 before any wall time)."""
        return min(1.0, self.wait_s / self.wall_s) if self.wall_s > 0 else 0.0


def summarize(counts: Sequence[int], wait_s: float, wall_s: float) -> Summary:
    return Summary(batches=int(sum(counts)), wait_s=wait_s, wall_s=wall_s,
                   p50_s=quantile(counts, 0.50), p95_s=quantile(counts, 0.95), p99_s=quantile(counts, 0.99))


class Stalls:
    """One trainer's running histogram (a few list writes per batch)."""

    def __init__(self) -> None:
        self.counts = [0] * NUM_BUCKETS
        self.wait_s = 0.0
        self.first_at: float | None = None
        self.last_at: float | None = None

    def record(self, wait_s: float, now: float) -> int | None:
        """A batch arrived at `now` (a monotonic clock) after waiting `wait_s`; the bucket it counted in."""
        if self.first_at is None:
            self.first_at = self.last_at = now  # start-up, not a stall
            return None
        if not math.isfinite(wait_s) or wait_s < 0:
            wait_s = 0.0
        bucket = bucket_of(wait_s)
        self.counts[bucket] += 1
        self.wait_s += wait_s
        self.last_at = now
        return bucket

    def wall_s(self, now: float | None = None) -> float:
        if self.first_at is None:
            return 0.0
        return max(0.0, (now if now is not None else (self.last_at or self.first_at)) - self.first_at)

    def summary(self, now: float | None = None) -> Summary:
        return summarize(self.counts, self.wait_s, self.wall_s(now))


class Published:
    """Mirrors a trainer's counts into its control block's `progress` words (ring.py).

    Cumulative over trainer processes: a trainer that restarts in place adds to
    what its predecessor left (`base`), so the sidecar's counters never go back.
    Five scalar stores per batch: this runs on the trainer's hot path.
    """

    def __init__(self, progress: Any) -> None:
        self.progress = progress  # ring.Control.progress: int64 words
        self.base = [int(v) for v in progress.tolist()]
        n = NUM_BUCKETS
        self.wait_i, self.wall_i, self.rows_i, self.batches_i = n, n + 1, n + 2, n + 3

    def write(self, own: Stalls, bucket: int | None, rows: int, batches: int) -> None:
        p, b = self.progress, self.base
        if bucket is not None:
            p[bucket] = b[bucket] + own.counts[bucket]
        p[self.wait_i] = b[self.wait_i] + int(own.wait_s * 1e9)
        p[self.wall_i] = b[self.wall_i] + int(own.wall_s() * 1e9)
        p[self.rows_i] = b[self.rows_i] + rows
        p[self.batches_i] = b[self.batches_i] + batches
