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
per-slot state, plus counters each side writes and the other reads without
any message (acknowledgements, releases, "I am waiting" flags). Single-word
stores; each side re-checks after a timeout, so a missed flag costs
milliseconds, never correctness.

Slot state transitions (SlotState):
    INVALID -> FREE           sidecar creates the slot
    FREE    -> FILLED         sidecar wrote a batch and sent `ready`
    FILLED  -> TAKEN          trainer handed the batch to user code
    TAKEN   -> FREE           trainer: nothing references the batch any more
    any     -> FREE           sidecar, when a new trainer process says hello
"""

from __future__ import annotations

import enum
import mmap
import os
from pathlib import Path

import numpy as np

MAGIC = 0x53465247  # "SFRG"
LAYOUT_VERSION = 1
MAX_SLOTS = 256
PAGE = mmap.PAGESIZE


class SlotState(enum.IntEnum):
    INVALID = 0
    FREE = 1
    FILLED = 2
    TAKEN = 3


HEADER_DTYPE = np.dtype(
    [
        ("magic", "<u4"),
        ("version", "<u4"),
        ("num_slots", "<u4"),
        ("sidecar_waiting", "<u4"),  # sidecar blocks for a free slot / ack
        ("acked", "<i8"),  # global steps the trainer has received (consumer commit)
        ("checkpoint_requested", "<u4"),
        ("drain_requested", "<u4"),
    ],
    align=True,
)
SLOT_DTYPE = np.dtype(
    [("state", "<u4"), ("gen", "<u4"), ("global_step", "<i8"), ("nbytes", "<i8")],
    align=True,
)
_HEADER_BYTES = 128
CONTROL_BYTES = _HEADER_BYTES + MAX_SLOTS * SLOT_DTYPE.itemsize


def control_path(directory: Path, instance: str, local_rank: int) -> Path:
    return directory / f"ctl-{instance}-r{local_rank}"


def slot_path(directory: Path, instance: str, local_rank: int, slot: int, gen: int) -> Path:
    return directory / f"slot-{instance}-r{local_rank}-{slot}-g{gen}"


class Control:
    """The control block of one rank, mapped by both sides."""

    def __init__(self, path: Path, *, create: bool) -> None:
        self.path = Path(path)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, CONTROL_BYTES)
            self._mm = mmap.mmap(fd, CONTROL_BYTES)
        finally:
            os.close(fd)
        self.header = np.ndarray((), HEADER_DTYPE, buffer=self._mm, offset=0)
        self.slots = np.ndarray((MAX_SLOTS,), SLOT_DTYPE, buffer=self._mm, offset=_HEADER_BYTES)
        if create:
            self.header["magic"] = MAGIC
            self.header["version"] = LAYOUT_VERSION
            self.header["acked"] = -1
        elif int(self.header["magic"]) != MAGIC or int(self.header["version"]) != LAYOUT_VERSION:
            raise ValueError(f"{self.path} is not a splitfeed control block of layout {LAYOUT_VERSION}")

    def close(self) -> None:
        # numpy views pin the mapping; drop them first.
        del self.header, self.slots
        self._mm.close()


class SlotFile:
    """One slot's mapping. The sidecar writes into `view`; the trainer reads it."""

    def __init__(self, path: Path, size: int, *, create: bool) -> None:
        self.path = Path(path)
        self.size = size
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.view = np.frombuffer(self._mm, dtype=np.uint8)

    def close(self) -> None:
        """Unmap once nothing references the view; a live batch keeps it mapped."""
        del self.view
        try:
            self._mm.close()
        except BufferError:
            pass  # still exported to a batch the user holds; unmapped when it is freed


def round_up(size: int) -> int:
    return max(PAGE, -(-size // PAGE) * PAGE)
