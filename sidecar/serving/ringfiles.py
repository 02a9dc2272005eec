"""One local rank's ring files: its control block and slot files, made to fit each batch, the wait for room in them, and their removal."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

from splitfeed.trainer_client.contract import errors
from splitfeed.trainer_client.transport import ring, slots


KEPT_WRITERS = 16
"""Slots that keep their IPC writer from batch to batch (slots.SlotWriter; each holds a file
descriptor): the ring's steady slots, prefetch + 2, unless prefetch is large; slots beyond, made
while a trainer holds many batches (up to ring.MAX_SLOTS), write with a new writer each time."""


class RingFiles:
    """The control block and slot files of one local rank's ring; the publishing thread alone
    (or the loop, while it is stopped) touches the slots."""

    def __init__(self, directory: Path, instance: str, local_rank: int, *, prefetch: int,
                 local_ranks: int, total_steps: int) -> None:
        self._dir = directory
        self._instance = instance
        self.local_rank = local_rank
        self.local_ranks = local_ranks
        self.prefetch = prefetch
        try:
            self.control = ring.Control(ring.control_path(directory, instance, local_rank), create=True)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            free, total = ring.free_bytes(directory)
            raise errors.UserError(
                f"no space left in {directory} for the control block of local rank {local_rank} "
                f"({size_text(free)} free of {size_text(total)}): raise spec.sidecar.shmSize") from None
        self.control.end_step = total_steps
        self.control.prefetch = prefetch
        self.slots: list[slots.SlotFile] = []
        self._waits = 0  # numbers this ring's waits in sidecar_waiting

    def room(self, size: int, stop: threading.Event) -> int | None:
        """A free slot for `size` bytes once fewer than `prefetch` batches wait, or None if stopped.

        Says what it waits for before sleeping, then looks again (slots, rule 1).
        """
        if stop.is_set():
            return None
        index, waiting_for = self._try_slot(size)
        if index is not None:  # the common case: no wait, so no read of `room` (it matters only before a sleep)
            return index
        return self._wait_for_room(size, waiting_for, stop)

    def _wait_for_room(self, size: int, waiting_for: int, stop: threading.Event) -> int | None:
        """room() once a first look found no slot: say so, read `room`, look again, sleep on it."""
        control = self.control
        waiting = ring.Waiting.NO
        index: int | None = None
        try:
            while True:
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
                if stop.is_set():
                    return None
                seen = control.room  # before a look at the ring: a wake-up after it changes the word
                index, waiting_for = self._try_slot(size)
        finally:
            if waiting != ring.Waiting.NO:
                control.sidecar_waiting = ring.Waiting.NO

    def _try_slot(self, size: int) -> tuple[int | None, int]:
        states = self.control.states()
        waits_for = slots.sidecar_waits_for(states, self.prefetch)
        if waits_for == ring.Waiting.ROOM:
            return None, waits_for
        return self.free_slot(size, states), waits_for

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
            return slots.SlotFile(path, capacity, create=True, keep_writer=index < KEPT_WRITERS)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise errors.UserError(self._too_small(
                capacity, f"no space left for slot {index} ({size_text(capacity)})")) from None

    def _too_small(self, capacity: int, what: str) -> str:
        """What the ring needs and where, and which setting to change."""
        slots = self.prefetch + 2  # prefetch filled, one in the trainer's hand, one being released
        need = slots * capacity
        free, total = ring.free_bytes(self._dir)
        pod = (f" (the pod's {self.local_ranks} local ranks: {size_text(self.local_ranks * need)})"
               if self.local_ranks > 1 else "")
        return (f"{what}: the ring of local rank {self.local_rank} needs {slots} slots "
                f"(spec.sidecar.prefetchBatches + 2) x {size_text(capacity)} = {size_text(need)}{pod}, and "
                f"{self._dir} has {size_text(free)} free of {size_text(total)}. Raise spec.sidecar.shmSize "
                "(the pod's memory emptyDir, counted against its memory limit), or lower "
                "spec.sidecar.prefetchBatches or the batch size")

    def discard(self, *, trainer_gone: bool) -> None:
        """Free what was published (and, with the trainer gone, what it held); no publisher runs."""
        control = self.control
        for i in range(len(self.slots)):
            state = control.acquire(i)
            if state == ring.SlotState.FILLED or (trainer_gone and state == ring.SlotState.TAKEN):
                control.transition(i, state, ring.SlotState.FREE)

    def close(self) -> None:
        """Remove the files; no publisher runs."""
        for slot in self.slots:
            try:
                os.unlink(slot.path)
            except FileNotFoundError:
                pass
            slot.close()
        os.unlink(self.control.path)
        self.control.close()


def size_text(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"
