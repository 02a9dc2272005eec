"""One local rank's ring writer: the publishing thread that alone fills its slots, and the gate the world's agreement holds it at."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from splitfeed.trainer_client.contract import messages
from splitfeed.trainer_client.transport import ring, slots

from .lookahead import (
    LOOKAHEAD_MIN,
    AgreedSteps,
    Assembled,
    OpenSignal,
    WorldView,
    no_step_left,
    telling,
)
from .ringfiles import RingFiles

log = logging.getLogger(__name__)

SourceFactory = Callable[[int, int], Iterator[tuple[int, pa.RecordBatch]]]
"""(global rank, first global step) -> (global_step, batch) in delivery order."""


class Gate:
    """Between a publisher and the world's agreement: frozen while the coordinator fixes the
    drain step, then no step at or past it (docs/agreement.md)."""

    def __init__(self, published: int) -> None:
        self._mutex = threading.Lock()  # `with` on it directly: a Condition's own __enter__ is a Python call
        self._lock = threading.Condition(self._mutex)
        self._frozen = False
        self._limit: int | None = None
        self.published = published
        """The highest step the publisher has let through the gate (counted before it is written)."""

    def freeze(self) -> int:
        with self._lock:
            self._frozen = True
            return self.published

    def open(self, limit: int | None) -> None:
        """Unfreeze; with `limit` (a drain step), nothing at or past it goes through."""
        with self._lock:
            if limit is not None:
                self._limit = limit
            self._frozen = False
            self._lock.notify_all()

    def wake(self) -> None:
        """A stopped publisher waiting at the gate looks at its stop event."""
        with self._lock:
            self._lock.notify_all()

    def through(self, step: int, stop: threading.Event) -> bool:
        """Wait while frozen or at/past a drain step; False if stopped first."""
        with self._mutex:  # the condition's lock, held as `with self._lock` holds it
            while not stop.is_set() and (self._frozen or (self._limit is not None and step >= self._limit)):
                self._lock.wait()
            if stop.is_set():
                return False
            if step > self.published:
                self.published = step
            return True


class Publisher:
    """One local rank's control block, its slots, and the thread that alone fills them.

    The publishing thread reads the rank's batches (the `factory`) and writes
    each straight into a free slot: the batch never crosses a thread on its
    way to the trainer, which halved the sidecar's CPU per batch against
    handing it to the serving loop first (make bench, transport). The loop
    thread only talks on the socket; what the publisher needs said (`end`,
    a failure) goes through `outbox` plus a one-byte signal that wakes the
    loop. A waiting trainer is woken by the publisher itself, through the
    control block's futex (`slots.ready`), never through the loop.
    """

    def __init__(self, *, directory: Path, instance: str, local_rank: int, rank: int,
                 factory: SourceFactory, prefetch: int, start_step: int, total_steps: int,
                 signal: OpenSignal | None = None, local_ranks: int = 1,
                 world: WorldView | None = None,
                 on_published: Callable[[int, int], None] | None = None) -> None:
        self.local_rank = local_rank
        self.local_ranks = local_ranks
        self.rank = rank
        self.prefetch = prefetch
        self.start_step = start_step
        self.total_steps = total_steps
        self._factory = factory
        self._signal = signal  # opens what says "the outbox has news"
        self._files = RingFiles(directory, instance, local_rank, prefetch=prefetch,
                                local_ranks=local_ranks, total_steps=total_steps)
        self.control = self._files.control
        self.slots = self._files.slots
        self._writes = 0  # the sequence number each slot's write carries (ring's module doc)
        self._readied = 0  # the trainer's wait (its trainer_waiting) it was woken for
        self.world = world
        self._on_published = on_published
        self.control.skipping = int(world is not None)
        """Skip jobs: publish a step only once the world agreed it exists (WorldView)."""
        self.outbox: queue.SimpleQueue[messages.End | Assembled | BaseException] = queue.SimpleQueue()
        """What the loop should say: the `end`, what the look-ahead holds, or the exception that
        stopped the publisher."""
        self._gate = Gate(start_step - 1)
        self.bytes_published = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the publishing thread ---------------------------------------------------

    def start(self, first_step: int) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._publish_all, args=(first_step, self._stop),
                                        name=f"publish-r{self.rank}", daemon=True)
        self._thread.start()

    def halt(self) -> None:
        """Ask the publisher to publish nothing more (its rank drained or failed); returns at once."""
        self._stop.set()
        self.wake()
        if self.world is not None:
            self.world.wake()
        self._gate.wake()

    def stop(self) -> None:
        """Stop the publisher; on return nothing but the loop touches the slots."""
        self.halt()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def wake(self) -> None:
        """Wake the publishing thread if it sleeps for room (it looks at the ring, and at `stop`)."""
        self.control.bump(ring.ROOM)
        self.control.wake(ring.ROOM)

    # -- the world's agreement (loop thread) -------------------------------------------

    @property
    def published(self) -> int:
        """The highest step the publisher has let through the gate (counted before it is written)."""
        return self._gate.published

    def freeze(self) -> int:
        """Publish nothing new; the highest step already let through (docs/agreement.md)."""
        return self._gate.freeze()

    def commit_at(self, step: int, *, drain: bool) -> None:
        """The agreed step: say so in the control block first, then let the publisher go on.

        The publisher takes the gate's lock before it publishes batch `step - 1`,
        so the trainer sees `checkpoint_at` no later than that batch.
        """
        self.control.checkpoint_at = step
        if drain:
            self.control.drain_at = step
        self._gate.open(step if drain else None)

    def _through_gate(self, step: int, stop: threading.Event) -> bool:
        """Wait while frozen or at/past a drain step; False if stopped first."""
        return self._gate.through(step, stop)

    def _publish_all(self, first_step: int, stop: threading.Event) -> None:
        with telling(self.outbox, self._signal) as tell:
            iterator: Any = None
            try:
                iterator = self._factory(self.rank, first_step)
                if self.world is not None:
                    iterator = self._agreed_steps(iterator, first_step, stop)
                next_step = self._publish_each(iterator, first_step, stop)
                if next_step is not None and not stop.is_set():
                    if self.world is not None:  # the world's last epoch may end early
                        self.control.end_step = min(self.total_steps, next_step)
                        if next_step == first_step and first_step < self.total_steps:
                            log.warning(no_step_left(self.rank, first_step, self.total_steps))
                    tell(messages.End(next_step))
            except BaseException as exc:  # the loop reports it to the trainer
                if not stop.is_set():
                    tell(exc)
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()

    def _publish_each(self, iterator: Iterator[tuple[int, pa.RecordBatch]], first_step: int,
                      stop: threading.Event) -> int | None:
        """Publish every batch of `iterator`; the step after the last, or None if stopped first."""
        next_step = first_step
        control, on_published = self.control, self._on_published
        for global_step, batch in iterator:
            if not self._publish(global_step, batch, stop):
                return None
            if on_published is not None:
                on_published(self.rank, global_step)
            next_step = global_step + 1
            waiting = control.trainer_waiting  # an RMW after the slot's: no wake-up is lost
            if waiting and slots.ready_due(waiting, self._readied):  # `waiting`: the common no at once
                self._readied = waiting
                slots.ready(self.control)
        return next_step

    def _agreed_steps(self, iterator: Iterator[tuple[int, pa.RecordBatch]], first_step: int,
                      stop: threading.Event) -> AgreedSteps:
        assert self.world is not None
        return AgreedSteps(iterator, first_step=first_step, rank=self.rank, world=self.world,
                           lookahead=max(LOOKAHEAD_MIN, self.prefetch), total_steps=self.total_steps,
                           stop=stop, outbox=self.outbox, signal=self._signal)

    def _publish(self, global_step: int, batch: pa.RecordBatch, stop: threading.Event) -> bool:
        """Write one batch into a slot once there is room; False if stopped first."""
        batch = slots.without_dictionaries(batch)
        index = self._room(slots.ipc_size(batch), stop)
        # The gate after the room: a step counts as published once only its write is left.
        if index is None or not self._through_gate(global_step, stop):
            return False
        self._writes += 1
        seq = self._writes
        nbytes = slots.write(self.slots[index], batch, global_step, seq)
        self.bytes_published += nbytes  # read by sidecar/serving/metrics.py
        slots.post(self.control, index, global_step, nbytes, seq)
        return True

    def _room(self, size: int, stop: threading.Event) -> int | None:
        """A free slot for `size` bytes once fewer than `prefetch` batches wait, or None if stopped."""
        return self._files.room(size, stop)

    def reset(self, next_step: int, *, trainer_gone: bool, restart: bool = True) -> None:
        """Discard what was published and continue at `next_step` (unless not `restart`).

        Called by the loop thread: the publisher is stopped first, so the loop
        touches the slots only while no publishing thread runs.
        """
        self.stop()
        self._files.discard(trainer_gone=trainer_gone)
        kept = []
        while not self.outbox.empty():
            news = self.outbox.get_nowait()  # news of the stopped publisher
            if isinstance(news, Assembled):
                kept.append(news)  # what the rank holds stays true (and the world may need its ends)
        for news in kept:
            self.outbox.put(news)
        self.control.sidecar_waiting = ring.Waiting.NO
        self._readied = 0
        if trainer_gone:
            self.control.trainer_waiting = 0  # its writer is gone: nobody else may clear it
        if restart:
            self.start(next_step)

    def close(self) -> None:
        self.stop()
        self._files.close()
