"""Skip jobs' look-ahead: which steps a rank holds ahead, and which the world agreed exist and lets through."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import pyarrow as pa

from splitfeed.trainer_client.contract import messages

from ..world import agreement


class Signal(Protocol):
    """What a publishing or reading thread wakes the serving loop with (service.py's ZeroMQ
    PUSH socket): opened in, and used by, that thread alone."""

    def send(self) -> None: ...

    def close(self) -> None: ...


OpenSignal = Callable[[], Signal]
"""Opens a Signal in the calling thread (sockets are per thread)."""

@contextlib.contextmanager
def telling(outbox: queue.SimpleQueue[Any], open_signal: OpenSignal | None) -> Iterator[Callable[[Any], None]]:
    """`tell(news)`: put `news` in the loop's outbox and wake the loop; the signal is this thread's."""
    signal = open_signal() if open_signal is not None else None

    def tell(news: Any) -> None:
        outbox.put(news)
        if signal is not None:
            signal.send()

    try:
        yield tell
    finally:
        if signal is not None:
            signal.close()


LOOKAHEAD_MIN = 2
"""Steps a skip job's publisher holds ready beyond what it published (at least; prefetch
if larger): its reports run that far ahead of its trainer, so the world's agreement that
a step exists rarely makes a trainer wait."""


@dataclasses.dataclass
class Assembled:
    """Publisher -> loop (skip jobs): the rank holds steps up to `reach` ready; `ends`:
    epochs its splits ended early (steps within the epoch)."""

    rank: int
    reach: int
    ends: dict[int, int]


class WorldView:
    """What the world agreed exists (skip jobs; agreement.Watermark), as this sidecar's
    publishers see it: the loop writes it, publishing threads wait on it."""

    def __init__(self, steps_per_epoch: int) -> None:
        self.steps_per_epoch = steps_per_epoch
        self.through = -1
        self.ends: dict[int, int] = {}
        self.need = -1
        self.generation = 0
        self._changed = threading.Condition()

    def update(self, through: int, ends: dict[int, int], need: int) -> None:
        with self._changed:
            self.through = max(self.through, through)
            agreement.merge_ends(self.ends, ends)
            self.need = need
            self.generation += 1
            self._changed.notify_all()

    def verdict(self, step: int) -> tuple[str | None, int]:
        """IN, OUT or None for `step`, and the generation it was read at (for `wait`)."""
        with self._changed:
            return (agreement.verdict(step, self.through, self.ends, self.steps_per_epoch),
                    self.generation)

    def wait(self, stop: threading.Event, generation: int) -> None:
        """Until the agreement changes after `generation`, or `stop`."""
        with self._changed:
            while not stop.is_set() and self.generation == generation:
                self._changed.wait(1.0)

    def wake(self) -> None:
        with self._changed:
            self.generation += 1
            self._changed.notify_all()


def no_step_left(rank: int, first_step: int, total_steps: int) -> str:
    """Why a skip job's rank ends without a batch: not a hang and not a failure, but
    almost surely not what its owner wants."""
    return (f"rank {rank}: no step of global steps {first_step}..{total_steps - 1} exists: under "
            "spec.data.onTransformError=skip/warn every epoch left has a split that kept fewer "
            "than globalBatchSize/numSplits rows the transform accepts, so the trainer gets no "
            "batch and ends. Check spec.data.transform against the rows it fails on "
            "(onTransformError=warn logs each).")


def epoch_ends(previous: int, step: int, steps_per_epoch: int) -> dict[int, int]:
    """The epoch ends a reader's jump from `previous` (the step before the first: start - 1)
    to `step` reveals: the epoch of previous + 1 ends there, skipped epochs hold nothing."""
    spe = steps_per_epoch
    nxt = previous + 1
    if step == nxt:
        return {}
    first = nxt // spe
    ends = {first: nxt - first * spe} if nxt % spe or step // spe > first else {}
    for epoch in range(first + 1, step // spe):
        ends[epoch] = 0
    return {e: v for e, v in ends.items() if v < spe}


class AgreedSteps:
    """The steps the world agreed exist, from one rank's own (skip jobs).

    A reading thread of its own reads ahead (`lookahead` steps; further while a
    drain waits to know whether step `need` exists, even while the publisher is
    frozen), reporting what it holds and the epoch ends it finds. The publishing
    thread iterating this lets a step through once IN and drops it once OUT
    (another rank's epoch ended before it), so every rank ends each epoch at the
    same step; otherwise it waits for the agreement to move.
    """

    def __init__(self, iterator: Iterator[tuple[int, pa.RecordBatch]], *, first_step: int, rank: int,
                 world: WorldView, lookahead: int, total_steps: int, stop: threading.Event,
                 outbox: queue.SimpleQueue[Any], signal: OpenSignal | None) -> None:
        self._iterator = iterator
        self._world = world
        self._lookahead = lookahead
        self._total = total_steps
        self._rank = rank
        self._stop = stop
        self._closed = threading.Event()
        self._outbox = outbox
        self._signal = signal
        self._held: collections.deque[tuple[int, pa.RecordBatch]] = collections.deque()
        self._last = first_step - 1
        self._done = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, name=f"read-ahead-r{rank}", daemon=True)
        self._thread.start()

    def _stopped(self) -> bool:
        return self._stop.is_set() or self._closed.is_set()

    def _read(self) -> None:
        with telling(self._outbox, self._signal) as tell:
            try:
                self._read_ahead(tell)
            except BaseException as exc:  # the publishing thread raises it
                self._error = exc
            finally:
                self._done = True
                self._world.wake()
                close = getattr(self._iterator, "close", None)
                if close is not None:
                    close()

    def _read_ahead(self, tell: Callable[[Assembled], None]) -> None:
        world = self._world
        while not self._stopped():
            _, generation = world.verdict(0)
            if len(self._held) >= self._lookahead and world.need <= self._last:
                world.wait(self._stop, generation)  # close() and halt() wake it
                continue
            item = next(self._iterator, None)
            step = self._total if item is None else item[0]
            ends = epoch_ends(self._last, step, world.steps_per_epoch)
            if item is not None:
                # A step the world already dropped is never published: holding it would
                # grow with the epoch while a frozen publisher waits for a drain's cut.
                if world.verdict(step)[0] != agreement.OUT:
                    self._held.append(item)
                self._last = step
            tell(Assembled(self._rank, step, ends))
            if item is None:
                self._done = True
                return
            world.wake()

    def __iter__(self) -> AgreedSteps:
        return self

    def __next__(self) -> tuple[int, pa.RecordBatch]:
        world = self._world
        while not self._stop.is_set():
            generation = world.generation  # first: a change after it ends the wait below
            seen = world.verdict(self._held[0][0])[0] if self._held else None
            if self._held and seen == agreement.OUT:
                self._held.popleft()
                world.wake()
                continue
            if self._held and seen == agreement.IN:
                item = self._held.popleft()
                world.wake()
                return item
            if not self._held and self._done:
                if self._error is not None:
                    raise self._error
                raise StopIteration
            world.wait(self._stop, generation)
        raise StopIteration

    def close(self) -> None:
        """Stop the reading thread, which closes the rank's iterator (its own)."""
        self._closed.set()
        self._world.wake()
        self._thread.join(timeout=30)
