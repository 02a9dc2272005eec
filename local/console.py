"""What `splitfeed local` prints: its progress while a world runs (a tqdm bar on a terminal,
a plain line every few seconds otherwise, as in CI logs), a note at each rescale event, and
the run's last lines: the steps, rows, rate and data stall of every world together, and what
each live rescale cost (`Rescale`, one line each). It reads the trainers' stats files; it
starts and changes nothing.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from splitfeed.trainer_client.contract import stalls

from .processes import World, read_json, total_steps

PREFIX = "splitfeed local: "
"""What every line `splitfeed local` prints starts with."""


@dataclasses.dataclass
class Rescale:
    """What one live rescale cost: where the world cut, and how long each part took."""

    old: int
    new: int
    step: int
    requested_at: float
    """time.monotonic() of the drain request."""
    agreed_s: float
    first_batch_s: float | None = None
    redone: int = 0
    lost: int = 0
    """Steps before the cut that some rank said it never trained (StreamClient.trained)."""
    in_place: bool = False

    def __str__(self) -> str:
        first = "-"
        if self.first_batch_s is not None:
            # From the drain on: what the change itself cost (a --scale-at request is made ahead).
            first = f"{self.first_batch_s:.1f} s ({self.first_batch_s - self.agreed_s:.1f} s after the drain)"
        how = " in place" if self.in_place else ""
        return (f"rescale {self.old} -> {self.new} replicas{how} at global step {self.step}: old world "
                f"checkpointed {self.agreed_s:.1f} s after the request, new world's first batch after "
                f"{first}; {self.redone} steps redone"
                + (f"; {self.lost} steps before the cut never trained by some rank" if self.lost else ""))


class Progress:
    """A tqdm bar on a terminal; a plain line every PLAIN_EVERY_S otherwise (CI logs)."""

    PLAIN_EVERY_S = 5.0

    def __init__(self, out: IO[str], *, enabled: bool) -> None:
        self.out = out
        self.enabled = enabled
        self.tty = enabled and out.isatty()
        self._bar: Any = None
        self._next_line = time.monotonic() + self.PLAIN_EVERY_S
        self._last: tuple[int, float] | None = None

    def note(self, text: str) -> None:
        """A line above the bar (a rescale event)."""
        if self._bar is not None:
            self._bar.write(f"{PREFIX}{text}", file=self.out)
        else:
            print(f"{PREFIX}{text}", file=self.out, flush=True)

    def update(self, world: World, rescales: Sequence[Rescale]) -> None:
        if not self.enabled:
            return
        stats = [read_json(f) for f in world.stats]
        total = total_steps(stats)
        rows, streaming, stall = _flow(stats)
        rate = rows / streaming if streaming >= 1.0 else 0.0  # a rate over a blink says nothing
        # Steps every rank has taken; before a rank's first batch, where the world resumed.
        start = world.resume_step or 0
        done = min((int(s.get("last_step", start - 1)) + 1 for s in stats), default=start)
        label = f"world {world.epoch} ({world.job.world_size} ranks)"
        if self.tty:
            from tqdm import tqdm

            if self._bar is None and total:
                self._bar = tqdm(total=total, file=self.out, unit="step", dynamic_ncols=True)
            if self._bar is not None:
                self._bar.n = done
                self._bar.set_description(label, refresh=False)
                self._bar.set_postfix_str(f"{rate:,.0f} rows/s, stall {stall:.0%}", refresh=False)
                self._bar.refresh()
            return
        now = time.monotonic()
        # A line when the step moved (or, while it waits, every few plain periods): no repeats.
        if now >= self._next_line and (self._last is None or done != self._last[0]
                                       or now - self._last[1] >= 6 * self.PLAIN_EVERY_S):
            self._next_line = now + self.PLAIN_EVERY_S
            of = f"/{total}" if total else ""
            spe = max((int(s.get("steps_per_epoch", 0)) for s in stats), default=0)
            epoch = f" (epoch {done // spe}, step {done % spe}/{spe})" if spe else ""
            print(f"{PREFIX}{label}: global step {done}{of}{epoch}, {rate:,.0f} rows/s, "
                  f"data stall {stall:.0%}{self._eta(done, total, now)}", file=self.out, flush=True)

    def _eta(self, done: int, total: int, now: float) -> str:
        """Time left at the pace since the last line (steps, not rows: rescales change the rows per rank)."""
        last, self._last = self._last, (done, now)
        if last is None or not total or done <= last[0]:
            return ""
        left = (total - done) * (now - last[1]) / (done - last[0])
        return f", ETA {int(left) // 60}:{int(left) % 60:02d}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _flow(stats: Sequence[Mapping[str, Any]]) -> tuple[int, float, float]:
    """(Rows received, seconds the longest rank streamed, data stall: the share of the ranks'
    streaming time spent waiting for data), from the trainers' stats files."""
    rows = sum(s.get("rows", 0) for s in stats)
    busy = sum(s.get("elapsed_s", 0.0) for s in stats)
    streaming = max((s.get("elapsed_s", 0.0) for s in stats), default=0.0)
    stall = sum(s.get("wait_s", 0.0) for s in stats) / busy if busy else 0.0
    return rows, streaming, stall


def summary(history: Sequence[World], elapsed: float, out: IO[str]) -> None:
    """The run's last lines: the steps, rows, rate and data stall of every world together."""
    by_world = [[read_json(f) for f in w.stats] for w in history]
    stats = [s for world in by_world for s in world]
    rows, streaming, stall = _flow(stats)
    # Every rank of a world takes one batch per global step it serves.
    steps = sum(max((int(s.get("batches", 0)) for s in world), default=0) for world in by_world)
    # rows/s over the time data flowed (first batch to last), not process start-up.
    rate = rows / streaming if streaming else 0.0
    ready = stalls.summarize(stalls.merge([s.get("data_ready_buckets") or [] for s in stats]), 0.0, 0.0)
    percentiles = ", ".join(f"{name} {value * 1000:.2f} ms" for name, value in
                            (("p50", ready.p50_s), ("p95", ready.p95_s), ("p99", ready.p99_s)) if value is not None)
    print(f"{PREFIX}{steps} global steps, {rows} rows in {elapsed:.1f} s; "
          f"{rate:.0f} rows/s while streaming, data stall {stall:.1%}"
          + (f"; data-ready latency {percentiles}" if percentiles else ""),
          file=out, flush=True)
    grid = total_steps(stats)
    last = max((int(s.get("last_step", -1)) + 1 for s in stats), default=0)
    if history and history[-1].job.data.drops_rows and 0 < last < grid:
        # The progress line counted toward the grid; say why the run stopped short of it.
        print(f"{PREFIX}ended at global step {last}/{grid}: onTransformError="
              f"{history[-1].job.data.on_transform_error} dropped rows, and an epoch ends early at the "
              f"last step every rank can fill", file=out, flush=True)
