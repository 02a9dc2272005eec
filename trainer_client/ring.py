"""The shared-memory ring: slot files holding batches, and a control block.

Both live in the pod's memory-backed emptyDir (SPLITFEED_SOCKET_DIR). The
sidecar creates them (and unlinks them: the creator cleans up); the trainer
only maps them. Names carry the sidecar's instance id, so a trainer still
holding batches of a crashed sidecar never sees their memory change, and a new
sidecar sweeps the old files at start.

A slot holds one batch as an Arrow IPC stream (self-describing, zero-copy to
numpy/torch). Slot files grow when a batch does not fit, and the pool grows
when the trainer holds more batches than there are slots, so holding batches
never deadlocks; at most MAX_SLOTS per rank.

The control block is a small numpy structured array over a mapped file:
per-slot state and the global step each slot holds, plus counters each side
writes and the other reads without any message (acknowledgements, releases,
"I am waiting" flags). A side sends a ZeroMQ message only to wake a peer that
said it is waiting, so a pipeline that keeps up costs no message per batch.
Single-word stores, the state written last (x86's store order makes the slot's
contents visible first); each side re-checks after a timeout, so a missed
flag costs milliseconds, never correctness.

Slot state transitions (SlotState):
    INVALID -> FREE           sidecar creates the slot
    FREE    -> FILLED         sidecar wrote a batch (and `posted` it), `ready` if the trainer waits
    FILLED  -> TAKEN          trainer handed the batch to user code
    TAKEN   -> FREE           trainer: nothing references the batch any more
    any     -> FREE           sidecar, when a new trainer process says hello
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

MAGIC = 0x53465247  # "SFRG"
LAYOUT_VERSION = 3
MAX_SLOTS = 256
PAGE = mmap.PAGESIZE


class SlotState:
    """Slot states as plain ints: numpy compares an IntEnum member ~4 us slower
    than an int, and these comparisons run several times per batch."""

    INVALID = 0
    FREE = 1
    FILLED = 2
    TAKEN = 3


class Waiting:
    """Values of `sidecar_waiting`: what the sidecar waits for, so the trainer
    wakes it only when that has happened (not on every batch)."""

    NO = 0
    ROOM = 1    # `prefetch` slots are FILLED: wake when at most prefetch // 2 are
    SLOT = 2    # every slot is held (MAX_SLOTS): wake when one is freed


class _Word:
    """One int64 header word of the control block, read and written as an attribute."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __get__(self, control: Control, owner: type | None = None) -> int:
        return int(control.words[self.index])

    def __set__(self, control: Control, value: int) -> None:
        control.words[self.index] = value


# Header words (int64 each), by index. Plain arrays rather than a structured
# dtype: this is the per-batch hot path on both sides, and plain element access
# costs a fraction of a structured field's.
_NUM_WORDS = 16
_HEADER_BYTES = _NUM_WORDS * 8
# Per slot: state (u4), then step, gen, nbytes (i8), each an array of MAX_SLOTS;
# then `posted`: posted[s % MAX_SLOTS] is the slot the sidecar last filled with
# global step s, so the trainer finds a batch with two scalar reads instead of a
# scan (at most MAX_SLOTS batches are in flight, so the index is unambiguous).
CONTROL_BYTES = _HEADER_BYTES + MAX_SLOTS * (4 + 8 + 8 + 8 + 8)


def control_path(directory: Path, instance: str, local_rank: int) -> Path:
    return directory / f"ctl-{instance}-r{local_rank}"


def slot_path(directory: Path, instance: str, local_rank: int, slot: int, gen: int) -> Path:
    return directory / f"slot-{instance}-r{local_rank}-{slot}-g{gen}"


class Control:
    """The control block of one rank, mapped by both sides.

    `state[i]`, `step[i]` (global step held), `gen[i]` (file generation) and
    `nbytes[i]` describe slot i; header words are attributes (`control.acked`).
    """

    magic = _Word(0)
    version = _Word(1)
    num_slots = _Word(2)
    acked = _Word(3)                 # last global step the trainer received (consumer commit)
    end_step = _Word(4)              # no batch at or after this global step
    prefetch = _Word(5)              # a waiting sidecar is woken below half of it
    sidecar_waiting = _Word(6)       # a Waiting value: the sidecar sleeps until woken
    trainer_waiting = _Word(7)       # the trainer sleeps on the socket for a batch
    checkpoint_at = _Word(8)         # the world's agreed step: checkpoint once this many steps are taken (-1: none)
    drain_at = _Word(9)              # the same step when the world drains: no batch at or after it (-1: none)

    def __init__(self, path: Path, *, create: bool) -> None:
        self.path = Path(path)
        self._mm = _map(self.path, CONTROL_BYTES, create=create)
        self.words = np.ndarray((_NUM_WORDS,), "<i8", buffer=self._mm, offset=0)
        offset = _HEADER_BYTES
        self.state = np.ndarray((MAX_SLOTS,), "<u4", buffer=self._mm, offset=offset)
        offset += MAX_SLOTS * 4
        self.step = np.ndarray((MAX_SLOTS,), "<i8", buffer=self._mm, offset=offset)
        offset += MAX_SLOTS * 8
        self.gen = np.ndarray((MAX_SLOTS,), "<i8", buffer=self._mm, offset=offset)
        offset += MAX_SLOTS * 8
        self.nbytes = np.ndarray((MAX_SLOTS,), "<i8", buffer=self._mm, offset=offset)
        offset += MAX_SLOTS * 8
        self.posted = np.ndarray((MAX_SLOTS,), "<i8", buffer=self._mm, offset=offset)
        if create:
            self.step[:] = -1
            self.magic, self.version, self.acked = MAGIC, LAYOUT_VERSION, -1
            self.checkpoint_at = self.drain_at = -1
        elif self.magic != MAGIC or self.version != LAYOUT_VERSION:
            raise ValueError(f"{self.path} is not a splitfeed control block of layout {LAYOUT_VERSION}")

    def states(self) -> list[int]:
        """Every slot's state (a list: counting in one costs a tenth of a numpy reduction here)."""
        return self.state[: self.num_slots].tolist()  # type: ignore[no-any-return]

    def filled(self) -> int:
        return self.states().count(SlotState.FILLED)

    def find(self, step: int, *, scan: bool = False) -> int | None:
        """The slot holding global step `step`, FILLED, or None.

        `posted` is exact for every FILLED slot; `scan` double-checks with a full
        scan (microseconds) where a miss means going to sleep.
        """
        index = int(self.posted[step % MAX_SLOTS])
        if self.state[index] == SlotState.FILLED and self.step[index] == step:
            return index
        if not scan:
            return None
        found = np.flatnonzero((self.step == step) & (self.state == SlotState.FILLED))
        return int(found[0]) if len(found) else None

    def close(self) -> None:
        # numpy views pin the mapping; drop them first.
        del self.words, self.state, self.step, self.gen, self.nbytes, self.posted
        self._mm.close()


class SlotFile:
    """One slot's mapping. The sidecar writes into `view`; the trainer reads it."""

    def __init__(self, path: Path, size: int, *, create: bool) -> None:
        self.path = Path(path)
        self.size = size
        self._mm = _map(self.path, size, create=create)
        self.view = np.frombuffer(self._mm, dtype=np.uint8)

    def close(self) -> None:
        """Unmap once nothing references the view; a live batch keeps it mapped."""
        del self.view
        try:
            self._mm.close()
        except BufferError:
            pass  # still exported to a batch the user holds; unmapped when it is freed


def _map(path: Path, size: int, *, create: bool) -> mmap.mmap:
    """Map a file shared with the peer; the creator sizes it (and must be first)."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def round_up(size: int) -> int:
    return max(PAGE, -(-size // PAGE) * PAGE)
