"""The sidecar's serving loop: fill each local rank's ring, answer its trainer.

One owner per thread. The loop thread owns the ZeroMQ ROUTER socket, answers
the trainers and alone writes each rank's `Session` (who its trainer is, what
it committed, whether it is done). One publishing thread per rank (its
`Publisher`) reads that rank's batches and alone writes its slots (through
`slots`, which holds the format). They share the control block, an outbox and
a wake-up event; the loop stops a publisher (`halt`, `stop`) rather than set a
flag it reads. A malformed message gets an error reply and a log line;
nothing a trainer sends can stop the loop: ZeroMQ drops a frame over
MAX_MESSAGE_BYTES before buffering it, and replies never block (a peer that
does not read loses them).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import logging
import os
import sys
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import zmq

from splitfeed.trainer_client import contract, errors, messages, ring, slots
from splitfeed.trainer_client.messages import (
    Bye, Checkpoint, Commit, CommitAt, Complete, Drain, Error, Freeze, Hello, Wake,
)

from . import agreement

log = logging.getLogger(__name__)

FAILURE_LINGER_S = 2.0
"""How long a failed sidecar keeps answering (with the error) before it exits."""

SourceFactory = Callable[[int, int], Iterator[tuple[int, pa.RecordBatch]]]
"""(global rank, first global step) -> (global_step, batch) in delivery order."""

SEND_HWM = 64
"""Replies queued per trainer before more are dropped: a trainer has a few outstanding
at most (a welcome, a checkpoint's answer, an `end`); one that does not read is not waited for."""

CLOSE_LINGER_S = 2.0
"""How long the last replies (a drained rank's `committed`) may take to leave when the sidecar exits."""


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
                 outbox: queue.SimpleQueue[Any], signal: tuple[zmq.Context[Any], str] | None) -> None:
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
        world = self._world
        signal = None
        if self._signal is not None:
            signal = self._signal[0].socket(zmq.PUSH)  # this thread's own
            signal.setsockopt(zmq.LINGER, 0)
            signal.connect(self._signal[1])

        def tell(news: Assembled) -> None:
            self._outbox.put(news)
            if signal is not None:
                signal.send(b"", zmq.NOBLOCK)

        try:
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
        except BaseException as exc:  # the publishing thread raises it
            self._error = exc
        finally:
            self._done = True
            world.wake()
            close = getattr(self._iterator, "close", None)
            if close is not None:
                close()
            if signal is not None:
                signal.close()

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
                 signal: tuple[zmq.Context[Any], str] | None = None, local_ranks: int = 1,
                 world: WorldView | None = None,
                 on_published: Callable[[int, int], None] | None = None) -> None:
        self.local_rank = local_rank
        self.local_ranks = local_ranks
        self.rank = rank
        self.prefetch = prefetch
        self.start_step = start_step
        self.total_steps = total_steps
        self._factory = factory
        self._signal = signal  # where to say "the outbox has news"
        self._dir = directory
        self._instance = instance
        try:
            self.control = ring.Control(ring.control_path(directory, instance, local_rank), create=True)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            free, total = ring.free_bytes(directory)
            raise errors.UserError(
                f"no space left in {directory} for the control block of local rank {local_rank} "
                f"({_size(free)} free of {_size(total)}): raise spec.sidecar.shmSize") from None
        self.control.end_step = total_steps
        self.control.prefetch = prefetch
        self.slots: list[slots.SlotFile] = []
        self._writes = 0  # the sequence number each slot's write carries (ring's module doc)
        self._waits = 0  # numbers this publisher's waits in sidecar_waiting
        self._readied = 0  # the trainer's wait (its trainer_waiting) it was woken for
        self.world = world
        self._on_published = on_published
        self.control.skipping = int(world is not None)
        """Skip jobs: publish a step only once the world agreed it exists (WorldView)."""
        self.outbox: queue.SimpleQueue[messages.End | Assembled | BaseException] = queue.SimpleQueue()
        """What the loop should say: the `end`, what the look-ahead holds, or the exception that
        stopped the publisher."""
        # The gate between the publisher and the world's agreement: frozen while the
        # coordinator fixes the drain step, then no step at or past `_limit`.
        self._gate = threading.Condition()
        self._frozen = False
        self._limit: int | None = None
        self.bytes_published = 0
        self.published = start_step - 1
        """The highest step the publisher has let through the gate (counted before it is written)."""
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
        with self._gate:
            self._gate.notify_all()

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

    def freeze(self) -> int:
        """Publish nothing new; the highest step already let through (docs/agreement.md)."""
        with self._gate:
            self._frozen = True
            return self.published

    def commit_at(self, step: int, *, drain: bool) -> None:
        """The agreed step: say so in the control block first, then let the publisher go on.

        The publisher takes the gate's lock before it publishes batch `step - 1`,
        so the trainer sees `checkpoint_at` no later than that batch.
        """
        self.control.checkpoint_at = step
        if drain:
            self.control.drain_at = step
        with self._gate:
            if drain:
                self._limit = step
            self._frozen = False
            self._gate.notify_all()

    def _through_gate(self, step: int, stop: threading.Event) -> bool:
        """Wait while frozen or at/past a drain step; False if stopped first."""
        with self._gate:
            while not stop.is_set() and (self._frozen or (self._limit is not None and step >= self._limit)):
                self._gate.wait()
            if stop.is_set():
                return False
            self.published = max(self.published, step)
            return True

    def _publish_all(self, first_step: int, stop: threading.Event) -> None:
        signal = None
        if self._signal is not None:
            signal = self._signal[0].socket(zmq.PUSH)  # sockets are per thread
            signal.setsockopt(zmq.LINGER, 0)
            signal.connect(self._signal[1])

        def tell(news: messages.End | Assembled | BaseException) -> None:
            self.outbox.put(news)
            if signal is not None:
                signal.send(b"", zmq.NOBLOCK)

        iterator: Any = None
        try:
            iterator = self._factory(self.rank, first_step)
            next_step = first_step
            if self.world is not None:
                iterator = self._agreed_steps(iterator, first_step, stop)
            for global_step, batch in iterator:
                if not self._publish(global_step, batch, stop):
                    return
                if self._on_published is not None:
                    self._on_published(self.rank, global_step)
                next_step = global_step + 1
                waiting = self.control.trainer_waiting  # an RMW after the slot's: no wake-up is lost
                if slots.ready_due(waiting, self._readied):
                    self._readied = waiting
                    slots.ready(self.control)
            if not stop.is_set():
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
            if signal is not None:
                signal.close()

    def _agreed_steps(self, iterator: Iterator[tuple[int, pa.RecordBatch]], first_step: int,
                      stop: threading.Event) -> AgreedSteps:
        assert self.world is not None
        return AgreedSteps(iterator, first_step=first_step, rank=self.rank, world=self.world,
                           lookahead=max(LOOKAHEAD_MIN, self.prefetch), total_steps=self.total_steps,
                           stop=stop, outbox=self.outbox, signal=self._signal)

    def _publish(self, global_step: int, batch: pa.RecordBatch, stop: threading.Event) -> bool:
        """Write one batch into a slot once there is room; False if stopped first."""
        index = self._room(slots.ipc_size(batch), stop)
        # The gate after the room: a step counts as published once only its write is left.
        if index is None or not self._through_gate(global_step, stop):
            return False
        self._writes += 1
        seq = self._writes
        nbytes = slots.write(self.slots[index], batch, global_step, seq)
        self.bytes_published += nbytes  # read by sidecar/metrics.py
        slots.post(self.control, index, global_step, nbytes, seq)
        return True

    def _room(self, size: int, stop: threading.Event) -> int | None:
        """A free slot for `size` bytes once fewer than `prefetch` batches wait, or None if stopped.

        Says what it waits for before sleeping, then looks again (slots, rule 1).
        """
        control = self.control
        waiting = ring.Waiting.NO
        try:
            while not stop.is_set():
                seen = control.room  # before a look at the ring: a wake-up after it changes the word
                index, waiting_for = self._try_slot(size)
                if index is None and waiting != waiting_for:
                    self._waits += 1
                    control.sidecar_waiting = ring.Waiting.episode(self._waits, waiting_for)
                    waiting = waiting_for
                    seen = control.room
                    index, _ = self._try_slot(size)
                if index is not None:
                    return index
                if stop.is_set():  # after the last read of `room`: `halt` sets stop before it bumps it
                    return None
                control.sleep(ring.ROOM, seen, slots.ROOM_RECHECK_S)  # the trainer's futex wake, or the re-check
            return None
        finally:
            if waiting != ring.Waiting.NO:
                control.sidecar_waiting = ring.Waiting.NO

    def _try_slot(self, size: int) -> tuple[int | None, int]:
        states = self.control.states()
        waits_for = slots.sidecar_waits_for(states, self.prefetch)
        if waits_for == ring.Waiting.ROOM:
            return None, waits_for
        return self.free_slot(size, states), waits_for

    # -- slots ---------------------------------------------------------------

    def free_slot(self, size: int, states: list[int]) -> int | None:
        """A FREE slot that fits a `size`-byte batch (grown if needed), or None; `states` as just read."""
        if ring.SlotState.FREE not in states:
            if len(self.slots) >= ring.MAX_SLOTS:
                return None
            self.slots.append(self._slot_file(len(self.slots), 0, size))
            index = len(self.slots) - 1
            self.control.gen[index] = 0
            self.control.transition(index, ring.SlotState.INVALID, ring.SlotState.FREE)
            self.control.num_slots = len(self.slots)
            return index
        index = states.index(ring.SlotState.FREE)
        # Acquire order: the trainer's reads of this slot are done before we overwrite it.
        if self.control.acquire(index) != ring.SlotState.FREE:
            return None
        if self.slots[index].size < slots.slot_bytes(size):
            # Too small: a new file (a trainer may still map the old one, which
            # stays valid until it unmaps it).
            gen = int(self.control.gen[index]) + 1
            old = self.slots[index]
            self.slots[index] = self._slot_file(index, gen, size)
            os.unlink(old.path)
            old.close()
            self.control.gen[index] = gen
        return index

    def _slot_file(self, index: int, gen: int, size: int) -> slots.SlotFile:
        # Headroom so that slightly larger later batches reuse the file.
        capacity = ring.round_up(slots.slot_bytes(size) + size // 8)
        if not self.slots:
            free, _ = ring.free_bytes(self._dir)
            if (self.prefetch + 2) * capacity > free:
                raise errors.UserError(self._too_small(capacity, "the memory volume is too small for the ring"))
        path = slots.slot_path(self._dir, self._instance, self.local_rank, index, gen)
        try:
            return slots.SlotFile(path, capacity, create=True)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise errors.UserError(self._too_small(
                capacity, f"no space left for slot {index} ({_size(capacity)})")) from None

    def _too_small(self, capacity: int, what: str) -> str:
        """What the ring needs and where, and which setting to change."""
        slots = self.prefetch + 2  # prefetch filled, one in the trainer's hand, one being released
        need = slots * capacity
        free, total = ring.free_bytes(self._dir)
        pod = (f" (the pod's {self.local_ranks} local ranks: {_size(self.local_ranks * need)})"
               if self.local_ranks > 1 else "")
        return (f"{what}: the ring of local rank {self.local_rank} needs {slots} slots "
                f"(spec.sidecar.prefetchBatches + 2) x {_size(capacity)} = {_size(need)}{pod}, and "
                f"{self._dir} has {_size(free)} free of {_size(total)}. Raise spec.sidecar.shmSize "
                "(the pod's memory emptyDir, counted against its memory limit), or lower "
                "spec.sidecar.prefetchBatches or the batch size")

    def reset(self, next_step: int, *, trainer_gone: bool, restart: bool = True) -> None:
        """Discard what was published and continue at `next_step` (unless not `restart`).

        Called by the loop thread: the publisher is stopped first, so the loop
        touches the slots only while no publishing thread runs.
        """
        self.stop()
        control = self.control
        for i in range(len(self.slots)):
            state = control.acquire(i)
            if state == ring.SlotState.FILLED or (trainer_gone and state == ring.SlotState.TAKEN):
                control.transition(i, state, ring.SlotState.FREE)
        kept = []
        while not self.outbox.empty():
            news = self.outbox.get_nowait()  # news of the stopped publisher
            if isinstance(news, Assembled):
                kept.append(news)  # what the rank holds stays true (and the world may need its ends)
        for news in kept:
            self.outbox.put(news)
        control.sidecar_waiting = ring.Waiting.NO
        self._readied = 0
        if trainer_gone:
            control.trainer_waiting = 0  # its writer is gone: nobody else may clear it
        if restart:
            self.start(next_step)

    def close(self) -> None:
        self.stop()
        for slot in self.slots:
            try:
                os.unlink(slot.path)
            except FileNotFoundError:
                pass
            slot.close()
        os.unlink(self.control.path)
        self.control.close()


END_LINGER_S = 30.0
"""After a trainer took its last batch, how long to keep answering it (a final
checkpoint) when it exits without saying bye."""


class Session:
    """One local rank's trainer session, as the loop thread sees it; only the loop thread writes it."""

    def __init__(self, *, rank: int, start_step: int, total_steps: int) -> None:
        self.rank = rank
        self.start_step = start_step
        self.total_steps = total_steps
        self.peer: bytes | None = None
        self.trainer_pid: int | None = None
        self.end_sent = False
        self.drained = False
        self.said_bye = False
        self.all_taken_at: float | None = None
        """When the loop first saw that the trainer took the last batch."""
        self.failure: str | None = None
        self.permanent = False
        """The failure is a DataError (a transform that fails on a row, say): permanent."""
        self.resume_step = start_step
        """Where this rank's current trainer process started (its model's step)."""
        self.prepared: int | None = None
        """The step of the trainer's last `checkpoint` (phase one, docs/agreement.md)."""
        self.committed: int | None = None
        """The step of its last `commit` (phase two: its model for that step is saved)."""

    def all_taken(self, acked: int, end_step: int | None = None) -> bool:
        """The trainer was told `end` and took every batch (up to `end_step`, default the
        job's last step: a skip job's last epoch may end earlier)."""
        end = self.total_steps if end_step is None else end_step
        return self.end_sent and acked + 1 >= end

    def finished(self, now: float, linger_s: float) -> bool:
        """Drained, said bye, or took its last batch `linger_s` ago (a pure check)."""
        if self.drained or self.said_bye:
            return True
        return self.all_taken_at is not None and now - self.all_taken_at >= linger_s


@dataclasses.dataclass(frozen=True)
class Feed:
    """A local rank: its publisher (the publishing thread's) and its session (the loop's)."""

    publisher: Publisher
    session: Session

    @property
    def rank(self) -> int:
        return self.session.rank

    @property
    def control(self) -> ring.Control:
        return self.publisher.control


class Server:
    """Serves the local ranks of one pod (or one local process group)."""

    def __init__(self, *, directory: Path, ranks: list[int], world_size: int,
                 factory: SourceFactory, steps_per_epoch: int, total_steps: int,
                 start_step: int, resume_step: int, prefetch: int,
                 checkpoint: Callable[[int, int], str] | None = None,
                 commit: Callable[[int, int], None] | None = None,
                 member: agreement.Member | None = None,
                 instance: str | None = None,
                 context: zmq.Context[Any] | None = None,
                 skipping: bool = False,
                 on_published: Callable[[int, int], None] | None = None,
                 on_drain: Callable[[int, int], None] | None = None) -> None:
        self.directory = Path(directory)
        self._on_drain = on_drain
        self.instance = instance or uuid.uuid4().hex[:12]
        self.world_size = world_size
        self.steps_per_epoch = steps_per_epoch
        self.total_steps = total_steps
        self.resume_step = resume_step
        self._checkpoint = checkpoint
        self._commit = commit
        self.member = member
        self._ctx = context or zmq.Context.instance()
        self.context = self._ctx
        """The ZeroMQ context of the sidecar's sockets: `flush` it before the process exits."""
        served = served_out(self.directory)
        sweep(self.directory)
        self.sock = self._ctx.socket(zmq.ROUTER)
        # MANDATORY: a full or unknown peer is an error (EAGAIN, EHOSTUNREACH) on a
        # NOBLOCK send, never a silent drop or a wait; MAXMSGSIZE: a larger frame
        # disconnects its sender before it is buffered.
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.sock.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"ipc://{self.directory / messages.SOCKET_NAME}")
        signal_address = f"inproc://sources-{self.instance}"
        self._signals = self._ctx.socket(zmq.PULL)
        self._signals.setsockopt(zmq.LINGER, 0)
        self._signals.bind(signal_address)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._signals, zmq.POLLIN)
        if member is not None:
            self._poller.register(member.socket, zmq.POLLIN)
        self.world = WorldView(steps_per_epoch) if skipping else None
        """Skip jobs: which steps the world agreed exist (from the coordinator, or without
        one from `_watermark` over this sidecar's own ranks, then the whole world)."""
        self._watermark = (agreement.Watermark(ranks=world_size, steps_per_epoch=steps_per_epoch)
                           if skipping and member is None else None)
        self._reports: dict[int, tuple[int, dict[int, int]]] = {}
        self.feeds = [
            Feed(Publisher(directory=self.directory, instance=self.instance, local_rank=i, rank=rank,
                           factory=factory, signal=(self._ctx, signal_address), prefetch=prefetch,
                           start_step=start_step, total_steps=total_steps, local_ranks=len(ranks),
                           world=self.world, on_published=on_published),
                 Session(rank=rank, start_step=start_step, total_steps=total_steps))
            for i, rank in enumerate(ranks)
        ]
        for i, feed in enumerate(self.feeds):
            if i in served:  # nobody will say hello: finish once the linger for a checkpoint ends
                log.info("rank %d: its trainer took every batch from this sidecar's predecessor; "
                         "nothing is left to serve", feed.rank)
                feed.session.all_taken_at = time.monotonic()
        self.stopping = threading.Event()
        self.end_linger_s = END_LINGER_S
        self._failed_at: float | None = None
        self.last_checkpoint: contract.LastCheckpoint | None = None
        self.drain_step: int | None = None
        """The step the world agreed to drain at (docs/agreement.md), once committed."""
        self.drain_reason: str | None = None
        self.next_replicas = 0
        """The replicas of the world that follows this one in place (0: none follows)."""
        self.world_complete: int | None = None
        """The newest step every rank of the world has committed."""
        self.preempt_requested = False
        """Set by a SIGTERM handler; the loop asks the world to drain (sockets belong to the loop)."""
        self._complained_at = -1.0
        self._complaints = 0

    # -- the world's agreement ------------------------------------------------------

    def request_drain(self, token: str, reason: str) -> None:
        """Ask the world's coordinator for a drain (an annotation, SIGTERM, a trainer's SIGTERM)."""
        if self.member is None:
            log.warning("drain requested (%s) but this sidecar has no coordinator", reason)
            return
        log.info("asking the world to drain (%s, token %s)", reason, token)
        self.member.request_drain(token, reason)

    def _coordinate(self) -> None:
        assert self.member is not None
        for message in self.member.receive():
            match message:
                case Freeze():
                    published = max(feed.publisher.freeze() for feed in self.feeds)
                    self.member.published = published
                    self.member.send(messages.Frozen(round=message.round, replica=self.member.replica,
                                                     published=published))
                case CommitAt():
                    step = message.step
                    if self.drain_step != step:
                        log.info("the world drains at global step %d (%s)", step, message.reason)
                    self.drain_step, self.drain_reason = step, message.reason
                    if message.drain:
                        self.next_replicas = message.next_replicas
                        self.member.commitment = (step, message.reason, message.next_replicas)
                        if self._on_drain is not None:  # before any rank can see the request
                            self._on_drain(step, message.next_replicas)
                    for feed in self.feeds:
                        feed.publisher.commit_at(step, drain=message.drain)
                case Complete():
                    self.world_complete = max(self.world_complete or -1, message.step)
                case messages.Agreed():
                    if self.world is not None:
                        self.world.update(message.through, agreement.parse_ends(message.ends), message.need)
                case messages.Joined():
                    self.member.joined()  # perhaps a restarted coordinator: tell it what it forgot
                case Error():
                    log.warning("coordinator: %s", message.message)
                case _:
                    pass

    def fail_all(self, message: str, *, grace_s: float) -> None:
        """Tell every trainer that says hello why this sidecar cannot serve, then stop."""
        for feed in self.feeds:
            feed.session.failure = message
            feed.publisher.halt()
        deadline = time.monotonic() + grace_s
        while not self.stopping.is_set() and time.monotonic() < deadline:
            if self.sock.poll(100):
                self._receive()
            if all(feed.session.peer is not None for feed in self.feeds):
                break  # every trainer has been told

    # -- the loop -----------------------------------------------------------------

    def finished(self, now: float | None = None) -> bool:
        """Every rank drained, said bye, or took its last batch END_LINGER_S ago; changes nothing.

        A trainer that took its last batch may still checkpoint (saving at the
        end is common), so the sidecar answers until the trainer says bye
        (StreamClient.close) or the linger runs out. The loop notes when each
        trainer took its last batch (`_note_all_taken`) before it asks.
        """
        now = time.monotonic() if now is None else now
        if self._failed_at is not None:
            return now - self._failed_at > FAILURE_LINGER_S
        return all(f.session.finished(now, self.end_linger_s) for f in self.feeds)

    def _note_all_taken(self, now: float) -> None:
        for f in self.feeds:
            if f.session.all_taken_at is None and f.session.all_taken(f.control.acked, f.control.end_step):
                f.session.all_taken_at = now

    def run(self, tick: Callable[[], None] | None = None) -> None:
        """Serve until every rank is finished or `stopping` is set."""
        if self.member is not None:
            # What came with `joined` (a world already draining: a restarted member is told the
            # committed step at once) reaches the publishers before any of them starts.
            self._coordinate()
        while not self.stopping.is_set():
            now = time.monotonic()
            self._note_all_taken(now)
            if self.finished(now):
                break
            # Publishers and trainers wake the loop with a message; the timeout
            # only paces `tick` and the `finished` linger.
            events = dict(self._poller.poll(100))
            if self._signals in events:
                while True:
                    try:
                        self._signals.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                for feed in self.feeds:
                    self._deliver(feed)
                self._report_reach()
            if self.sock in events:
                self._receive()
            if self.preempt_requested:
                self.preempt_requested = False
                self.request_drain(f"preempt-{self.instance}", "preempt")
            if self.member is not None:
                if self.member.socket in events:
                    self._coordinate()
                self.member.heartbeat(time.monotonic())
            if tick is not None:
                tick()

    def close(self) -> None:
        for feed in self.feeds:
            feed.publisher.close()
        if self.member is not None:
            self.member.close()
        # A reply sent just before (the `committed` that drained the last rank) may
        # still be queued in ZeroMQ's I/O thread: it goes out when `flush` waits for it.
        self.sock.close(linger=int(CLOSE_LINGER_S * 1000))
        self._signals.close(linger=0)
        try:
            os.unlink(self.directory / messages.SOCKET_NAME)
        except FileNotFoundError:
            pass

    def _send(self, peer: bytes, message: messages.Message) -> None:
        """Never blocks: a peer that does not read (SEND_HWM answers queued) loses the answer."""
        try:
            self.sock.send_multipart([peer, message.encode()], zmq.NOBLOCK)
        except zmq.Again:
            self._complain(peer, f"does not read its socket; its {message.kind} message is dropped")
            return
        except zmq.ZMQError as exc:  # EHOSTUNREACH: that trainer is gone
            log.debug("cannot reach trainer %r: %s", peer, exc)
            return
        for feed in self.feeds:  # a trainer asleep on its ring reads the message now (slots, rule 4)
            if feed.session.peer == peer:
                with contextlib.suppress(ValueError):  # its control block is closed: nobody sleeps on it
                    feed.control.bump(ring.POSTS)
                    feed.control.wake(ring.POSTS)

    def _complain(self, peer: bytes, what: str) -> None:
        """A warning about a peer, at most one a second: a hostile peer must not flood the log."""
        now = time.monotonic()
        if now - self._complained_at < 1.0 and self._complained_at >= 0:
            self._complaints += 1
            return
        more = f" ({self._complaints} more such warnings in the last second)" if self._complaints else ""
        log.warning("trainer %r %s%s", peer[:32], what, more)
        self._complained_at, self._complaints = now, 0

    def _deliver(self, feed: Feed) -> None:
        """Say what the rank's publisher has news of."""
        session = feed.session
        while True:
            try:
                news = feed.publisher.outbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(news, Assembled):
                reach, ends = self._reports.get(news.rank, (-1, {}))
                self._reports[news.rank] = (max(reach, news.reach), {**ends, **news.ends})
            elif isinstance(news, BaseException):
                self._fail(session, news)
            elif session.peer is not None and not session.failure:
                self._send(session.peer, news)
                if isinstance(news, messages.End):
                    session.end_sent = True

    def _report_reach(self) -> None:
        """What this sidecar's ranks hold ready, in one message per loop turn (skip jobs)."""
        if not self._reports:
            return
        reports, self._reports = self._reports, {}
        if self.member is not None:
            self.member.report_reach(reports)
        elif self._watermark is not None and self.world is not None:
            for rank, (reach, ends) in reports.items():
                self._watermark.report(rank, reach, ends)
            self.world.update(self._watermark.through, self._watermark.ends, -1)

    def _fail(self, session: Session, exc: BaseException) -> None:
        user = isinstance(exc, (errors.UserError, errors.SidecarFailed))
        session.failure = str(exc) if user else f"{type(exc).__name__}: {exc}"
        session.permanent = isinstance(exc, errors.DataError)  # the same data fails in any world
        log.error("rank %d cannot continue: %s", session.rank, session.failure, exc_info=not user)
        if session.peer is not None:
            self._send(session.peer, Error(code="source", message=session.failure, fatal=True))
        # Linger a moment rather than stop: a trainer mid-handshake still maps
        # this sidecar's files and must hear why, not find them gone.
        if self._failed_at is None:
            self._failed_at = time.monotonic()

    def _receive(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            peer, body = frames[0], frames[1:]
            try:
                if len(body) != 1:
                    raise errors.ProtocolError(f"expected 1 frame, got {len(body)}")
                message = messages.decode(body[0])
                self._handle(peer, message)
            except errors.ProtocolError as exc:
                self._complain(peer, f"sent a bad message: {exc}")
                self._send(peer, Error(code="protocol", message=str(exc), fatal=False))

    def _feed_for(self, peer: bytes) -> Feed:
        for feed in self.feeds:
            if feed.session.peer == peer:
                return feed
        raise errors.ProtocolError("say hello first")

    def _handle(self, peer: bytes, message: messages.Message) -> None:
        match message:
            case Hello():
                self._hello(peer, message)
            case Checkpoint():
                self._checkpoint_rank(self._feed_for(peer), message.step)
            case Commit():
                self._commit_rank(self._feed_for(peer), message.step)
            case Drain():
                feed = self._feed_for(peer)
                self.request_drain(f"{message.reason}-{self.instance}-r{feed.rank}", message.reason)
            case Bye():
                self._feed_for(peer).session.said_bye = True
            case Wake():
                self._feed_for(peer).publisher.wake()
            case _:
                raise errors.ProtocolError(f"a trainer does not send {message.kind!r}")

    def _hello(self, peer: bytes, message: Hello) -> None:
        local_rank = message.local_rank
        if not 0 <= local_rank < len(self.feeds):
            raise errors.ProtocolError(
                f"local_rank {local_rank} is not served here (0..{len(self.feeds) - 1})")
        feed = self.feeds[local_rank]
        session, control = feed.session, feed.control
        if session.failure:
            session.peer = peer
            self._send(peer, Error(code="source", message=session.failure, fatal=True))
            return
        new_trainer = message.pid != session.trainer_pid
        acked = control.acked
        wanted = message.next_step
        if wanted is None:
            # A new trainer process starts from a model it saved: the world's newest
            # complete step (docs/agreement.md), never after its predecessor's last batch.
            wanted = max(session.start_step, self.world_complete if self.world_complete is not None else -1)
            session.resume_step = wanted
        if not 0 <= wanted <= session.total_steps:
            raise errors.ProtocolError(f"next_step {wanted} is outside 0..{session.total_steps}")
        same_trainer = session.peer == peer and not new_trainer
        if same_trainer and wanted < acked + 1:
            # A hello that waited in the queue while batches flowed: stale, the
            # trainer has moved on. Answer it without rewinding anything.
            wanted = acked + 1
        in_step = same_trainer and acked + 1 == wanted
        session.peer, session.trainer_pid, session.said_bye = peer, message.pid, False
        if not in_step:
            log.info("rank %d: trainer pid %d continues at global step %d",
                     session.rank, message.pid, wanted)
            control.acked = wanted - 1
            session.end_sent = False
            # A drained rank publishes nothing more (its trainer stops after saving).
            feed.publisher.reset(wanted, trainer_gone=new_trainer, restart=not session.drained)
        self._send(peer, messages.Welcome(
            instance=self.instance, rank=session.rank, world_size=self.world_size, ctl=str(control.path),
            resume_step=session.resume_step, next_step=wanted, total_steps=session.total_steps,
            steps_per_epoch=self.steps_per_epoch))

    def _checkpoint_rank(self, feed: Feed, step: int) -> None:
        """Phase one: write the rank's data position for `step` (not yet resumable)."""
        session = feed.session
        acked = feed.control.acked
        if step != acked + 1:
            raise errors.ProtocolError(
                f"checkpoint of step {step}, but the trainer has received {acked + 1} steps")
        if self._checkpoint is None:
            self._send(session.peer or b"", Error(code="checkpoint", fatal=False,
                                                  message="checkpoints are disabled: set spec.checkpoint.uri"))
            return
        try:
            uri = self._checkpoint(session.rank, step)
        except Exception as exc:  # storage errors: the trainer decides what to do
            log.error("checkpoint of step %d failed: %s", step, exc)
            self._send(session.peer or b"", Error(code="checkpoint", fatal=False,
                                                  message=f"checkpoint of step {step} failed: {exc}"))
            return
        session.prepared = step
        self._send(session.peer or b"", messages.Checkpointed(
            step=step, drained=feed.control.drain_at == step, uri=uri))

    def _commit_rank(self, feed: Feed, step: int) -> None:
        """Phase two: the trainer saved its model for `step`; the step may now be resumed."""
        session = feed.session
        if session.prepared != step:
            raise errors.ProtocolError(
                f"commit of step {step}, but this rank's last checkpoint is of step {session.prepared}")
        assert self._commit is not None  # a prepared step implies a store
        try:
            self._commit(session.rank, step)
        except Exception as exc:
            log.error("commit of step %d failed: %s", step, exc)
            self._send(session.peer or b"", Error(code="checkpoint", fatal=False,
                                                  message=f"commit of step {step} failed: {exc}"))
            return
        session.committed = step
        if not session.drained and feed.control.drain_at == step:
            session.drained = True
            feed.publisher.halt()  # the world drained here: nothing more to publish
        epoch = step // max(1, self.steps_per_epoch)
        self.last_checkpoint = {"step": step, "epoch": epoch, "worldSize": self.world_size,
                                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self._send(session.peer or b"", messages.Committed(step))
        if self.member is not None and all(f.session.committed == step for f in self.feeds):
            self.member.send(messages.CommittedWorld(replica=self.member.replica, step=step))


def flush(context: zmq.Context[Any], timeout_s: float = CLOSE_LINGER_S + 1.0) -> bool:
    """Before the process exits: let the replies closed sockets still queue go out.

    `_send` only hands a reply to ZeroMQ's I/O thread; the process exiting right
    after (a drained sidecar stops once its last rank committed, and a forked
    sidecar ends with os._exit) kills that thread with the reply still queued,
    and the trainer waits in vain for its `committed`. Terminating the context
    waits for each closed socket's queue up to its linger; a socket left open (a
    publishing thread that did not stop) would block it forever, hence the
    deadline. Call it last: the context is unusable afterwards. True once done.
    """
    done = threading.Thread(target=context.term, name="zmq-flush", daemon=True)
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        log.debug("ZeroMQ's last messages were not all sent in %.1f s", timeout_s)
        return False
    return True


def tune_interpreter() -> None:
    """Hand the GIL over faster in a sidecar process.

    The serving loop answers trainers while publishing threads run Python code;
    with CPython's default 5 ms switch interval an answer (a checkpoint's, a
    welcome) can wait that long for the GIL.
    """
    sys.setswitchinterval(0.0002)


def served_out(directory: Path) -> set[int]:
    """Local ranks whose trainer took the last batch from a sidecar that was here before
    (restarted in place: its control blocks are still in the emptyDir). Such a trainer
    may be gone: the restarted sidecar must not wait for its hello for ever."""
    done: set[int] = set()
    for path in directory.glob("ctl-*-r*") if directory.is_dir() else []:
        try:
            local_rank = int(path.name.rsplit("-r", 1)[1])
            control = ring.Control(path, create=False)
        except (ValueError, OSError):
            continue  # torn, foreign or of another layout: nothing to learn from it
        try:
            if control.end_step > 0 and control.acked + 1 >= control.end_step:
                done.add(local_rank)
        finally:
            control.close()
    return done


def sweep(directory: Path) -> None:
    """Remove ring files and sockets a crashed sidecar left behind."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in directory.iterdir():
        if path.name.startswith(("ctl-", "slot-")) or path.name == messages.SOCKET_NAME:
            try:
                path.unlink()
            except FileNotFoundError:
                pass


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"
