"""The zero-copy take: a batch's columns viewed in its ring slot's shared memory, and the
slot given back once nothing references them (docs/architecture.md, "The ring")."""

from __future__ import annotations

import functools
import struct
import weakref
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import numpy as np

from ..transport import ring, slots

_torch: Any = None

def _torch_module() -> Any:
    """torch if installed (imported on first use: it takes seconds), else False."""
    global _torch
    if _torch is None:
        try:
            import torch as module
        except ImportError:  # numpy arrays are handed out without it
            _torch = False
        else:
            _torch = module
    return _torch


class Batch(MutableMapping[str, Any]):
    """One rank's batch of one global step: column name -> tensor/array.

    Frameworks move and rebuild batches: `to()` and `pin_memory()` keep the step metadata
    (Lightning and Accelerate call `.to`, a DataLoader's pin thread `.pin_memory`), and so
    does `copy.copy` (torch's `default_convert` copies a mutable mapping and updates it).
    `type(batch)(mapping)` (HF Trainer's `_prepare_input`) builds a Batch whose metadata is
    unknown (-1): count trained steps where the batch came from, not from a rebuilt one.
    """

    def __init__(self, columns: Mapping[str, Any] | None = None, *, epoch: int = -1, step: int = -1,
                 global_step: int = -1, rows: int = 0) -> None:
        self._columns = dict(columns or {})
        self.epoch = epoch
        self.step = step
        self.global_step = global_step
        self.rows = rows
        """Rows in this rank's batch (globalBatchSize / worldSize but for a short last batch)."""

    def __getitem__(self, key: str) -> Any:
        return self._columns[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._columns[key] = value

    def __delitem__(self, key: str) -> None:
        del self._columns[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._columns)

    def __len__(self) -> int:
        return len(self._columns)

    def __copy__(self) -> Batch:
        return self._with(self._columns)

    def _with(self, columns: Mapping[str, Any]) -> Batch:
        return Batch(columns, epoch=self.epoch, step=self.step, global_step=self.global_step, rows=self.rows)

    def to(self, *args: Any, **kwargs: Any) -> Batch:
        """Every tensor column `.to(*args, **kwargs)` (device, dtype, non_blocking=...); the rest as is."""
        return self._with({k: v.to(*args, **kwargs) if hasattr(v, "to") else v for k, v in self._columns.items()})

    def pin_memory(self, *args: Any) -> Batch:
        """Every tensor column in pinned memory (a copy out of the ring: its slot is freed sooner)."""
        return self._with({k: v.pin_memory(*args) if hasattr(v, "pin_memory") else v
                           for k, v in self._columns.items()})

    def __repr__(self) -> str:
        return f"Batch(global_step={self.global_step}, epoch={self.epoch}, step={self.step}, columns={list(self._columns)})"


def to_tensor(value: Any) -> Any:
    torch = _torch_module()
    if torch and isinstance(value, np.ndarray) and value.dtype != object:
        return torch.from_numpy(value)
    return value


def _release(holds: dict[int, weakref.ref[np.ndarray]], control: ring.Control, slot: int, gen: int,
             ref: weakref.ref[np.ndarray]) -> None:
    """Give a slot back once nothing references its batch (a weakref callback).

    Runs on whatever thread dropped the last reference: a shared-memory store
    only, never a socket call (sockets belong to one thread).
    """
    holds.pop(id(ref), None)
    try:
        if control.written(slot)[0] == gen:
            # Release order: every read of the batch is done before the sidecar may reuse it.
            control.transition(slot, ring.SlotState.TAKEN, ring.SlotState.FREE)
    except (ValueError, AttributeError, TypeError):
        pass  # the control block is already closed


class Taker:
    """One trainer process's views of its sidecar's slot files, by (instance, slot, generation)."""

    def __init__(self, directory: Path, local_rank: int, *, as_tensors: bool) -> None:
        self._dir = directory
        self._local_rank = local_rank
        self._as_tensors = as_tensors
        self._files: dict[tuple[str, int, int], slots.SlotFile] = {}
        self._reader = slots.Reader()
        self._holds: dict[int, weakref.ref[np.ndarray]] = {}  # keeps the release callbacks alive

    def take(self, control: ring.Control, instance: str, slot: int, step: int) -> tuple[dict[str, Any], int] | None:
        """Slot `slot`'s columns of `step` and its rows; None (the slot left FILLED) if it is torn or stale."""
        # Acquire order: all the sidecar wrote before it marked the slot FILLED is visible from here.
        if not control.transition(slot, ring.SlotState.FILLED, ring.SlotState.TAKEN):
            return None
        gen, nbytes, seq = control.written(slot)
        slot_file = self._files.get((instance, slot, gen))
        if slot_file is None:
            for key in [k for k in self._files if k[:2] == (instance, slot)]:
                self._files.pop(key).close()  # the sidecar replaced that slot's file
            slot_file = slots.open_slot(self._dir, instance, self._local_rank, slot, gen)
            self._files[(instance, slot, gen)] = slot_file
        # Before the parse: a write still under way (its trailer not yet marked) is not read at
        # all, so a stream that fails to parse below is a real error, not a write caught midway.
        if not slots.intact(slot_file, nbytes, step, seq):
            control.transition(slot, ring.SlotState.TAKEN, ring.SlotState.FILLED)
            return None
        root = slots.root_of(slot_file, nbytes)
        try:
            columns, rows = self._reader.columns(slot_file._mm, root)
            broken: Exception | None = None
        except Exception as exc:  # a torn stream may not parse; the marks below decide
            broken = exc
        # After the views: the marks before and after the payload still name this step and write.
        if not slots.intact(slot_file, nbytes, step, seq):
            control.transition(slot, ring.SlotState.TAKEN, ring.SlotState.FILLED)
            return None
        if broken is not None:
            raise broken
        # weakref.ref with a callback, not weakref.finalize: a third of the cost.
        ref = weakref.ref(root, functools.partial(_release, self._holds, control, slot, gen))
        self._holds[id(ref)] = ref
        if self._as_tensors:
            columns = {name: to_tensor(value) for name, value in columns.items()}
        return columns, rows

    def forget_others(self, instance: str) -> None:
        """Close the files of other sidecar instances: unmapped now, or when their last batch is freed."""
        for key in [k for k in self._files if k[0] != instance]:
            self._files.pop(key).close()

    def why_torn(self, control: ring.Control, instance: str, slot: int, step: int, timeout_s: float) -> str:
        expected = (step, int(control.seq[slot]))
        try:
            found = slots.open_slot(self._dir, instance, self._local_rank, slot, int(control.gen[slot]))
            marks = found.marks(int(control.nbytes[slot]))
            found.close()
        except (OSError, ValueError, struct.error) as exc:
            marks = exc  # type: ignore[assignment]
        return (f"the batch of global step {step} in slot {slot} stayed torn for {timeout_s} s: "
                f"its (step, sequence) marks before and after it are {marks}, the control block says "
                f"{expected}; the sidecar wrote it incompletely")
