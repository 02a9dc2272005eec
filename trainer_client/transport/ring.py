"""The shared-memory ring: slot files holding batches, and a control block.

Both live in the pod's memory-backed emptyDir (SPLITFEED_SOCKET_DIR). The
sidecar creates them (and unlinks them: the creator cleans up); the trainer
only maps them. Names carry the sidecar's instance id, so a trainer still
holding batches of a crashed sidecar never sees their memory change, and a new
sidecar sweeps the old files at start.

A slot holds one batch as an Arrow IPC stream between two copies of its
(global step, sequence number); `slots` defines that format and the wake-up
rules, this module the control block. Slot files grow when a batch does not fit,
and the pool grows when the trainer holds more batches than there are slots,
so holding batches never deadlocks; at most MAX_SLOTS per rank. Files are
reserved with posix_fallocate: a full volume is an ENOSPC when a slot is
created, never a SIGBUS when a page of a sparse file is first written.

The control block is a small numpy structured array over a mapped file:
per-slot state and the global step each slot holds, plus counters each side
writes and the other reads without any message (acknowledgements, releases,
"I am waiting" flags), and two counters a waiting side sleeps on with a futex
(`posts`, `room`): a side wakes its peer, with one system call, only when the
peer said it waits (the rules are in `slots`), and no ZeroMQ message moves per
batch.

Memory order, on ARM as on x86: a slot changes hands only through its state
word, and state words and the two waiting flags change only by atomic
read-modify-writes with acquire-release order (`_fetch_add`). What the sidecar
wrote into a slot and its control fields before the RMW that made it FILLED is
visible to the trainer whose RMW takes it; what the trainer read from a slot
is done before the RMW that frees it. A waiting flag is read with an RMW too
(adding 0): of a waiter that sets its flag and then looks at the ring, and a
peer that changes the ring and then reads the flag, one always sees the other
(the two RMWs on the flag are ordered, and the later one synchronises with the
earlier), so no wake-up is lost. The counters change only by RMWs too, and
the futex compares and sleeps atomically against the peer's bump-then-wake.

Slot state transitions (SlotState):
    INVALID -> FREE           sidecar creates the slot
    FREE    -> FILLED         sidecar wrote a batch (and `posted` it), woken (futex) if the trainer waits
    FILLED  -> TAKEN          trainer handed the batch to user code
    TAKEN   -> FREE           trainer: nothing references the batch any more
    any     -> FREE           sidecar, when a new trainer process says hello
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..contract import stalls
from ..contract.errors import UnsupportedPlatform

if not sys.platform.startswith("linux"):
    # Checked before anything below runs: elsewhere the futex call number would name another call.
    raise UnsupportedPlatform(
        f"splitfeed's trainer client and sidecar need Linux (a futex(2) on a control block mapped "
        f"from a memory volume); this is {sys.platform}: run them in Linux containers, or "
        "`splitfeed local` on a Linux machine")

MAGIC = 0x53465247  # "SFRG"
LAYOUT_VERSION = 6
MAX_SLOTS = 256
PAGE = mmap.PAGESIZE


_EXCHANGE_AND_ADD = "_ZN9__gnu_cxx18__exchange_and_addEPVii"


def _load_fetch_add() -> tuple[Callable[[int, int], int], Callable[[ctypes.c_void_p, int], int]]:
    """An atomic fetch-add with acquire-release order on a C int, from libstdc++: by address,
    and the same function called with a pointer made once per word (`Control`).

    `__gnu_cxx::__exchange_and_add` is libstdc++'s exported atomic add
    (`__atomic_fetch_add(p, v, __ATOMIC_ACQ_REL)`; a `lock xadd` on x86). The
    library is loaded wherever splitfeed runs: pyarrow and pyzmq link it. A
    call costs ~0.4 us, half that without `argtypes` to convert an address (the
    second form: the hot path's several calls per batch); the `atomics`
    package's store/load cost 13-21 us each here, and it is GPL-3.0.
    """
    try:
        library = ctypes.PyDLL("libstdc++.so.6")  # PyDLL: a 20 ns call need not release the GIL
        function = getattr(library, _EXCHANGE_AND_ADD)
        at_pointer = library[_EXCHANGE_AND_ADD]  # a second function object: no argtypes
    except (OSError, AttributeError) as exc:
        raise ImportError(f"splitfeed's shared-memory ring needs libstdc++.so.6 (GCC's C++ runtime): {exc}") from exc
    function.restype = at_pointer.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return function, at_pointer


_fetch_add, _fetch_add_at = _load_fetch_add()

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98, "ppc64le": 221, "s390x": 238}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not the _PRIVATE forms: the word is shared with another process


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall() -> tuple[Callable[..., int], int]:
    """libc's syscall(2) and the futex call's number on this machine."""
    number = _SYS_FUTEX.get(platform.machine())
    try:
        function = ctypes.CDLL(None).syscall  # CDLL: a waiting call releases the GIL
    except (OSError, AttributeError) as exc:
        raise ImportError(f"splitfeed's shared-memory ring needs libc's syscall(): {exc}") from exc
    if number is None:
        raise ImportError(f"splitfeed's shared-memory ring has no futex call number for {platform.machine()}")
    function.restype = ctypes.c_long
    return function, number


_syscall, _futex_number = _load_syscall()


def futex_wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the int32 at `address` holds `expected`, at most `timeout_s`.

    Linux's futex: the kernel compares and sleeps atomically with respect to
    `futex_wake`, so a waiter that read `expected` and then looked at the ring
    cannot miss a change the peer made (and woke for) in between. Returns on a
    wake-up, a changed word, the timeout or a signal alike: the caller looks again.
    """
    whole = int(timeout_s)
    spec = _Timespec(whole, int((timeout_s - whole) * 1e9))
    _syscall(ctypes.c_long(_futex_number), ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAIT),
             ctypes.c_int(expected), ctypes.byref(spec), None, ctypes.c_int(0))


def futex_wake(address: int) -> None:
    """Wake every waiter on the int32 at `address` (a few microseconds; none waiting costs the same)."""
    _syscall(ctypes.c_long(_futex_number), ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAKE),
             ctypes.c_int(0x7FFFFFFF), None, None, ctypes.c_int(0))


class SlotState:
    """Slot states as plain ints: numpy compares an IntEnum member ~4 us slower
    than an int, and these comparisons run several times per batch."""

    INVALID = 0
    FREE = 1
    FILLED = 2
    TAKEN = 3


class Waiting:
    """What the sidecar waits for: the low bits of `sidecar_waiting` (when to wake it: slots.wake_due)."""

    NO = 0
    ROOM = 1    # `prefetch` slots are FILLED
    SLOT = 2    # every slot is held (MAX_SLOTS)
    KIND = 3    # the mask; the bits above count the sidecar's waits

    @staticmethod
    def episode(count: int, kind: int) -> int:
        """The value of `sidecar_waiting` for the sidecar's `count`th wait, for `kind`."""
        return (count << 2 | kind) & 0x7FFFFFFF


class _Word:
    """One int64 header word of the control block, read and written as an attribute (a plain
    aligned 8-byte load or store, through a memoryview: a third of a numpy scalar's cost)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __get__(self, control: Control, owner: type | None = None) -> int:
        return control._words[self.index]

    def __set__(self, control: Control, value: int) -> None:
        control._words[self.index] = value


class _Flag:
    """One int32 "I am waiting" word, read and written only by atomic RMWs (see the module doc).

    Each flag has one writer (its waiter); setting it takes two RMWs, which
    only that writer may do. The peer only reads (adds 0). A waiter writes a
    new non-zero value for every wait (the trainer: for every sleep), and the
    peer wakes it once per value: one wake-up per value, without the peer
    ever writing the flag.
    """

    def __init__(self, index: int) -> None:
        self.index = index  # of the word after the header: flags, then counters (Control._at)
        self.offset = _HEADER_BYTES + 4 * index

    def __get__(self, control: Control, owner: type | None = None) -> int:
        if not control._base:  # inline, not address(): read once or twice per batch
            raise ValueError(f"{control.path} is closed")
        return _fetch_add_at(control._at[self.index], 0)

    def __set__(self, control: Control, value: int) -> None:
        if not control._base:
            raise ValueError(f"{control.path} is closed")
        at = control._at[self.index]
        _fetch_add_at(at, value - _fetch_add_at(at, 0))


class _Counter:
    """One int32 word a side bumps (an atomic RMW) before it wakes the peer sleeping on it (`futex_wait`).

    Each counter has one writer; the peer reads it (adding 0) before it looks
    at the ring a last time, then sleeps only while the word still holds what it read.
    """

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.index = (offset - _HEADER_BYTES) // 4  # Control._at

    def __get__(self, control: Control, owner: type | None = None) -> int:
        if not control._base:
            raise ValueError(f"{control.path} is closed")
        return _fetch_add_at(control._at[self.index], 0)


# Header words (int64 each), by index. Plain arrays rather than a structured
# dtype: this is the per-batch hot path on both sides, and plain element access
# costs a fraction of a structured field's.
_NUM_WORDS = 16
_HEADER_BYTES = _NUM_WORDS * 8
_FLAG_BYTES = 64  # the two int32 flags and the two int32 wake-up counters, alone on their cache line
POSTS = _HEADER_BYTES + 8
"""Offset of `posts`, the counter a trainer with no batch sleeps on (Control.bump, .wake, .sleep)."""
ROOM = _HEADER_BYTES + 12
"""Offset of `room`, the counter a publisher with no room sleeps on."""
# Per slot: state (u4), then step, gen, nbytes, seq (i8), each an array of
# MAX_SLOTS; then `posted`: posted[s % MAX_SLOTS] is the slot the sidecar last
# filled with global step s, so the trainer finds a batch with two scalar reads
# instead of a scan (at most MAX_SLOTS batches are in flight, so the index is
# unambiguous).
_STATE_OFFSET = _HEADER_BYTES + _FLAG_BYTES
# Then the trainer's progress (`progress`, int64, the trainer writes, the sidecar
# reads): data-ready bucket counts (stalls.BUCKETS_S), then PROGRESS_FIELDS. Plain
# aligned 8-byte stores: a reader sees each word whole, and a count one batch
# stale is harmless for metrics; no message carries them.
PROGRESS_FIELDS = ("wait_ns", "wall_ns", "rows", "batches")
PROGRESS_WORDS = stalls.NUM_BUCKETS + len(PROGRESS_FIELDS)
_PROGRESS_OFFSET = _STATE_OFFSET + MAX_SLOTS * (4 + 8 + 8 + 8 + 8 + 8)
CONTROL_BYTES = _PROGRESS_OFFSET + PROGRESS_WORDS * 8


def control_path(directory: Path, instance: str, local_rank: int) -> Path:
    return directory / f"ctl-{instance}-r{local_rank}"


class Control:
    """The control block of one rank, mapped by both sides.

    `state[i]`, `step[i]` (global step held), `gen[i]` (file generation),
    `nbytes[i]` and `seq[i]` (the sidecar's sequence number of the write)
    describe slot i; header words are attributes (`control.acked`). Read
    `state` freely to choose a slot; change it only with `transition`.
    """

    magic = _Word(0)
    version = _Word(1)
    num_slots = _Word(2)
    acked = _Word(3)                 # last global step the trainer received (consumer commit)
    end_step = _Word(4)              # no batch at or after this global step
    prefetch = _Word(5)              # a waiting sidecar is woken below half of it
    skipping = _Word(6)              # 1: steps may be absent (onTransformError=skip/warn ends epochs early)
    trained = _Word(7)               # global steps the trainer said it trained (StreamClient.trained); -1: not said
    checkpoint_at = _Word(8)         # the world's agreed step: checkpoint once this many steps are taken (-1: none)
    drain_at = _Word(9)              # the same step when the world drains: no batch at or after it (-1: none)
    trainer_waiting = _Flag(0)       # non-zero: the trainer sleeps on the socket for a batch (the trainer writes it)
    sidecar_waiting = _Flag(1)       # Waiting.episode(...): the sidecar sleeps until woken (the sidecar writes it)
    posts = _Counter(POSTS)          # bumped by the sidecar after each batch it makes FILLED: the trainer sleeps on it
    room = _Counter(ROOM)            # bumped by whoever wakes the sidecar (its trainer, its own loop): it sleeps on it

    def __init__(self, path: Path, *, create: bool) -> None:
        self.path = Path(path)
        self._mm = map_file(self.path, CONTROL_BYTES, create=create)
        self.words = np.ndarray((_NUM_WORDS,), "<i8", buffer=self._mm, offset=0)
        offset = _STATE_OFFSET
        self.state = np.ndarray((MAX_SLOTS,), "<u4", buffer=self._mm, offset=offset)
        self._base = int(self.words.ctypes.data)
        self._states_at = self._base + _STATE_OFFSET  # 0 once closed
        offset += MAX_SLOTS * 4
        self.step = np.ndarray((MAX_SLOTS,), "<i8", buffer=self._mm, offset=offset)
        offset += MAX_SLOTS * 8
        self.gen = np.ndarray((MAX_SLOTS,), "<i8", buffer=self._mm, offset=offset)
        offset += MAX_SLOTS * 8
        self.nbytes = np.ndarray((MAX_SLOTS,), "<i8", buffer=self._mm, offset=offset)
        offset += MAX_SLOTS * 8
        self.seq = np.ndarray((MAX_SLOTS,), "<i8", buffer=self._mm, offset=offset)
        offset += MAX_SLOTS * 8
        self.posted = np.ndarray((MAX_SLOTS,), "<i8", buffer=self._mm, offset=offset)
        self.progress = np.ndarray((PROGRESS_WORDS,), "<i8", buffer=self._mm, offset=_PROGRESS_OFFSET)
        self._hot_views()
        if create:
            self.step[:] = -1
            self.magic, self.version, self.acked = MAGIC, LAYOUT_VERSION, -1
            self.checkpoint_at = self.drain_at = self.trained = -1
        elif self.magic != MAGIC or self.version != LAYOUT_VERSION:
            raise ValueError(f"{self.path} is not a splitfeed control block of layout {LAYOUT_VERSION}")

    def steps_done(self) -> int:
        """Global steps the trainer completed: trained where it says so (a framework reads
        ahead), else received."""
        received, trained = int(self.acked) + 1, int(self.trained)
        return received if trained < 0 else min(trained, received)

    def _hot_views(self) -> None:
        """What the per-batch path reads and writes, at a fraction of a numpy scalar's cost:
        memoryviews of the same words (native order, as the atomics: x86-64 and aarch64 are
        little-endian like the arrays above) and a pointer per atomic word, made once."""
        view = memoryview(self._mm)
        self._words = view[:_HEADER_BYTES].cast("q")
        self._states = view[_STATE_OFFSET:_STATE_OFFSET + MAX_SLOTS * 4].cast("I")
        at = _STATE_OFFSET + MAX_SLOTS * 4  # then step, gen, nbytes, seq, posted: as __init__ lays them out
        self._steps, self._gens, self._sizes, self._seqs, self._posted = (
            view[at + i * MAX_SLOTS * 8:at + (i + 1) * MAX_SLOTS * 8].cast("q") for i in range(5))
        self._views = [self._words, self._states, self._steps, self._gens, self._sizes, self._seqs, self._posted]
        view.release()
        self._at = [ctypes.c_void_p(self._base + _HEADER_BYTES + 4 * i) for i in range(4)]  # flags, counters
        self._state_at = [ctypes.c_void_p(self._states_at + 4 * i) for i in range(MAX_SLOTS)]

    def bump(self, counter: int) -> None:
        """Add one to the counter at offset POSTS or ROOM (an atomic RMW, release order)."""
        if not self._base:
            raise ValueError(f"{self.path} is closed")
        _fetch_add_at(self._at[(counter - _HEADER_BYTES) >> 2], 1)

    def wake(self, counter: int) -> None:
        """Wake whoever sleeps on the counter at offset POSTS or ROOM."""
        futex_wake(self.address(counter))

    def sleep(self, counter: int, seen: int, timeout_s: float) -> None:
        """Sleep on the counter at POSTS or ROOM while it still holds `seen` (read before the caller's last look)."""
        futex_wait(self.address(counter), seen, timeout_s)

    def address(self, offset: int) -> int:
        """The address of the byte at `offset`; ValueError once closed (never an access to unmapped memory)."""
        if not self._base:
            raise ValueError(f"{self.path} is closed")
        return self._base + offset

    def transition(self, slot: int, before: int, after: int) -> bool:
        """Move slot `slot` from state `before` to `after` by one atomic RMW; False (and undone) if it was not `before`.

        Acquire and release: the side that makes the change has seen all the
        peer wrote before its own last transition of this slot, and the peer
        will see all this side wrote before this one. An add, not a
        compare-and-swap (libstdc++ exports no CAS), so call it only for a
        state this side owns or has just read: each state has one side that
        may leave it (the sidecar FREE, the trainer FILLED and TAKEN) but for
        a sidecar's reset, which runs while its trainer waits for `welcome`.
        """
        if not self._states_at:  # inline: this runs several times per batch
            raise ValueError(f"{self.path} is closed")
        at = self._state_at[slot]
        if _fetch_add_at(at, after - before) == before:
            return True
        _fetch_add_at(at, before - after)
        return False

    def acquire(self, slot: int) -> int:
        """Slot `slot`'s state, read with acquire order (an RMW adding 0)."""
        if not self._states_at:
            raise ValueError(f"{self.path} is closed")
        return _fetch_add_at(self._state_at[slot], 0)

    def states(self) -> list[int]:
        """Every slot's state (a list: counting in one costs a tenth of a numpy reduction here)."""
        return self._states[: self._words[2]].tolist()  # num_slots

    def filled(self) -> int:
        return self.states().count(SlotState.FILLED)

    def find(self, step: int, *, scan: bool = False) -> int | None:
        """The slot holding global step `step`, FILLED, or None.

        `posted` is exact for every FILLED slot; `scan` double-checks with a full
        scan (microseconds) where a miss means going to sleep. Plain reads: the
        caller takes the slot with `transition`, which orders everything after it.
        """
        index: int = self._posted[step % MAX_SLOTS]
        if self._states[index] == SlotState.FILLED and self._steps[index] == step:
            return index
        if not scan:
            return None
        found = np.flatnonzero((self.step == step) & (self.state == SlotState.FILLED))
        return int(found[0]) if len(found) else None

    def describe(self, slot: int, step: int, nbytes: int, seq: int) -> None:
        """The sidecar's plain stores of what slot `slot` holds, before it makes the slot FILLED."""
        self._steps[slot], self._sizes[slot], self._seqs[slot] = step, nbytes, seq
        self._posted[step % MAX_SLOTS] = slot

    def written(self, slot: int) -> tuple[int, int, int]:
        """(gen, nbytes, seq) of slot `slot`: the trainer reads them after its RMW took the slot."""
        return self._gens[slot], self._sizes[slot], self._seqs[slot]

    def find_after(self, step: int) -> tuple[int, int] | None:
        """(slot, step) of the lowest FILLED step after `step`, or None.

        For a skip job: the sidecar posts steps in rising order, so a later step
        posted while `step` is not means `step` does not exist (the world's epoch
        ended before it; docs/preprocessing.md).
        """
        n = int(self.num_slots)
        found = np.flatnonzero((self.state[:n] == SlotState.FILLED) & (self.step[:n] > step))
        if not len(found):
            return None
        index = int(found[np.argmin(self.step[found])])
        return index, int(self.step[index])

    def read_progress(self) -> tuple[list[int], dict[str, int]]:
        """The trainer's data-ready bucket counts and its PROGRESS_FIELDS (the sidecar's side)."""
        words = self.progress.tolist()
        return words[:stalls.NUM_BUCKETS], dict(zip(PROGRESS_FIELDS, words[stalls.NUM_BUCKETS:]))

    def write_progress(self, counts: list[int], **fields: int) -> None:
        """The trainer's side: its cumulative counts (every PROGRESS_FIELDS name)."""
        self.progress[: stalls.NUM_BUCKETS] = counts
        self.progress[stalls.NUM_BUCKETS:] = [fields[name] for name in PROGRESS_FIELDS]

    def close(self) -> None:
        # numpy views pin the mapping; drop them first.
        self._base = self._states_at = 0
        del self.words, self.state, self.step, self.gen, self.nbytes, self.seq, self.posted, self.progress
        for view in self._views:
            view.release()
        self._mm.close()


def free_bytes(directory: Path) -> tuple[int, int]:
    """(free, total) bytes of the file system holding `directory`, for unprivileged writers."""
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize


def map_file(path: Path, size: int, *, create: bool) -> mmap.mmap:
    """Map a file shared with the peer; the creator reserves its blocks (and must be first).

    Reserved rather than sized with ftruncate: a sparse file on a full tmpfs
    maps fine and kills its writer with SIGBUS on the first page that has no
    memory behind it; posix_fallocate fails with ENOSPC instead, up front.
    """
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError:
                os.unlink(path)
                raise
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def round_up(size: int) -> int:
    return max(PAGE, -(-size // PAGE) * PAGE)
