"""The slot format and the wake-up rules: both halves of the trainer<->sidecar ring agreement.

`ring` holds the control block (who owns each slot, the waiting flags, the
memory order); this module holds what goes *into* a slot and when a side
wakes the other. The sidecar's publisher calls the write half, StreamClient
the read half; nothing else spells the format.

Slot format. A slot file holds one batch:

    [0, 16)            header marks: (global step, sequence number) as two int64
    [16, 64)           padding: the stream starts 64-byte aligned
    [64, 64 + n)       the batch as an Arrow IPC stream (schema, batch, end marker)
    [64 + n8, +16)     trailer marks: the same (step, sequence), n rounded up to 8

The sidecar numbers every write (the sequence) and writes the header marks,
the stream, then the trailer marks, then the control block's fields of the
slot, then makes the slot FILLED (`post`). The trainer builds its views of the
stream and then compares both marks with the control block: a slot whose marks
do not match (a torn or stale write) is looked at again, never handed out.

Wake-up rules (each side writes only its own flag; ring's module doc says why
no wake-up is lost). A side that must wait sleeps on a futex over a counter of
the control block that its peer bumps before it wakes it (`ring.futex_wait`):
`posts` for the trainer, `room` for the sidecar. It reads the counter after
saying it waits and before its last look at the ring, and sleeps only while
the counter still holds that value, so a wake-up between the look and the
sleep is never lost. One system call per wake-up, no ZeroMQ message and no
thread in between (a `ready` message through the sidecar's serving loop cost
both processes ~100 us and three thread switches per wake-up: make bench).

1. A waiter says so before it sleeps, then reads its counter, then looks at
   the ring once more: the trainer sets `trainer_waiting` to a new number
   before every sleep (`next_trainer_wait`; once per wait lost wake-ups: a
   wake spent on a bump with no batch left the trainer's next sleep without
   one), the sidecar sets `sidecar_waiting` to
   `ring.Waiting.episode(n, kind)` with the kind of what it waits for
   (`sidecar_waits_for`).
2. The sidecar bumps `posts` after every batch it posts (`post`) and wakes
   the trainer once per `trainer_waiting` value (`ready_due`, `ready`). A
   bump can come after the trainer took what it announced (`post` bumps
   after FILLED, the sidecar's messages bump after they are sent), so a
   trainer woken with no batch sleeps on `posts` again and looks at its
   socket after short slices (`client.AFTER_BARE_WAKE_SLICE_S`).
3. The trainer bumps `room` and wakes the sidecar once per sidecar wait, and
   only once what the sidecar waits for has happened: at most half of
   `prefetch` FILLED (ROOM) or a FREE slot (SLOT) (`wake_due`).
4. The sidecar re-checks the ring every ROOM_RECHECK_S without a wake-up (a
   batch freed by another thread of a trainer asleep on `posts` wakes no
   one); the sidecar also bumps and wakes `posts` when it sends the trainer a
   message (an error, the end), and the trainer looks at its socket after
   slices of sleep that double from WAIT_SLICE_S to MAX_WAIT_SLICE_S (a
   restarted sidecar's welcome) and says `hello` every heartbeat.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
import pyarrow as pa

from . import ring

T = TypeVar("T")

SLOT_HEADER = 64
"""(step, sequence) as two int64, then padding: the IPC stream starts 64-byte aligned."""
SLOT_TRAILER = 16
"""(step, sequence) again, right after the stream (8-byte aligned)."""
_MARKS = struct.Struct("<qq")
_BYTE = np.dtype(np.uint8)
_LENGTH = struct.Struct("<i")
"""An IPC message's metadata length, after its 0xFFFFFFFF continuation marker."""

ROOM_RECHECK_S = 0.005
"""A publisher waiting for room re-checks the ring this often even without a wake-up (rule 4)."""


def slot_path(directory: Path, instance: str, local_rank: int, slot: int, gen: int) -> Path:
    return directory / f"slot-{instance}-r{local_rank}-{slot}-g{gen}"


def slot_bytes(payload: int) -> int:
    """Bytes a slot needs for a `payload`-byte IPC stream and its two (step, sequence) marks."""
    return _trailer_offset(payload) + SLOT_TRAILER


def _trailer_offset(payload: int) -> int:
    return SLOT_HEADER + -(-payload // 8) * 8


class SlotFile:
    """One slot's mapping. The sidecar writes into `payload`; the trainer reads it.

    `payload` is the part the IPC stream goes into, after the header marks.
    """

    def __init__(self, path: Path, size: int, *, create: bool, keep_writer: bool = False) -> None:
        self.path = Path(path)
        self.size = size
        self._mm = ring.map_file(self.path, size, create=create)
        self.view = np.frombuffer(self._mm, dtype=np.uint8)
        self.payload = self.view[SLOT_HEADER:size - SLOT_TRAILER]  # made once: a slice per batch costs
        self.keep_writer = keep_writer
        """The sidecar's side: write through a SlotWriter kept from batch to batch (it holds a file descriptor)."""
        self.writer: SlotWriter | None = None

    def mark_header(self, step: int, seq: int) -> None:
        """Before the payload is written."""
        _MARKS.pack_into(self._mm, 0, step, seq)

    def mark_trailer(self, nbytes: int, step: int, seq: int) -> None:
        """After the payload (`nbytes` long) is written."""
        _MARKS.pack_into(self._mm, _trailer_offset(nbytes), step, seq)

    def marks(self, nbytes: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(step, sequence) before and after an `nbytes` payload."""
        header: Any = _MARKS.unpack_from(self._mm, 0)
        trailer: Any = _MARKS.unpack_from(self._mm, _trailer_offset(nbytes))
        return header, trailer

    def drop_writer(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def close(self) -> None:
        """Unmap once nothing references the view; a live batch keeps it mapped."""
        self.drop_writer()
        del self.view, self.payload
        try:
            self._mm.close()
        except BufferError:
            pass  # still exported to a batch the user holds; unmapped when it is freed


# -- the write half (the sidecar's publisher) ----------------------------------------------------

# A thread pool per write cost more than the copy it parallelises (make bench).
_WRITE_OPTIONS = pa.ipc.IpcWriteOptions(use_threads=False)


class _BySchema(Generic[T]):
    """`compute(schema)`, remembered for the few schemas seen last, newest first. A stream's
    batches are new objects with equal schemas: they are found by identity or equality
    (tenths of a microsecond), where a schema's hash walks its fields (microseconds) and a
    cache by id() missed every new batch."""

    def __init__(self, compute: Callable[[pa.Schema], T]) -> None:
        self._compute = compute
        self._known: tuple[tuple[pa.Schema, T], ...] = ()

    def __call__(self, schema: pa.Schema) -> T:
        known = self._known
        for other, value in known:
            if other is schema or other.equals(schema, check_metadata=True):
                return value
        value = self._compute(schema)
        self._known = ((schema, value), *known[:7])  # one rebinding: publishers of other ranks read it meanwhile
        return value


def without_dictionaries(batch: pa.RecordBatch) -> pa.RecordBatch:
    """`batch` with every dictionary-encoded column (a categorical: lance keeps them as
    they are) cast to its values, nested ones included: a slot holds a schema and one
    record batch, which the trainer's `Reader` maps without a dictionary message. A batch
    without dictionaries costs one look-up of its schema."""
    plain = _plain_schema(batch.schema)
    return batch if plain is None else batch.cast(plain)


def _without_dictionary_types(schema: pa.Schema) -> pa.Schema | None:
    """The schema with dictionaries replaced by their values; None where it has none."""
    fields = [field.with_type(_plain_type(field.type)) for field in schema]
    return None if all(f.type == g.type for f, g in zip(fields, schema)) else pa.schema(fields, schema.metadata)


def _plain_type(typ: pa.DataType) -> pa.DataType:
    if pa.types.is_dictionary(typ):
        return _plain_type(typ.value_type)
    if pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ):
        item = typ.value_field.with_type(_plain_type(typ.value_type))
        if pa.types.is_fixed_size_list(typ):
            return pa.list_(item, typ.list_size)
        return pa.large_list(item) if pa.types.is_large_list(typ) else pa.list_(item)
    if pa.types.is_struct(typ):
        return pa.struct([f.with_type(_plain_type(f.type)) for f in typ])
    return typ


_plain_schema = _BySchema(_without_dictionary_types)


def ipc_size(batch: pa.RecordBatch) -> int:
    """Bytes of `batch` as an IPC stream (schema, batch, end marker), without writing it (and 64 spare)."""
    return _schema_stream_bytes(batch.schema) + int(pa.ipc.get_record_batch_size(batch)) + 64


def _stream_bytes_less_batch(schema: pa.Schema) -> int:
    """Bytes of a stream of `schema` less its batch: the schema message and the end marker
    (writing the schema message costs ~3 us)."""
    sink = pa.MockOutputStream()
    pa.ipc.new_stream(sink, schema).close()
    return int(sink.size())


_schema_stream_bytes = _BySchema(_stream_bytes_less_batch)


_END = struct.Struct("<Ii")
"""The IPC stream's end marker (0xFFFFFFFF, a zero length), as a stream writer's close writes it."""


class SlotWriter:
    """One slot's IPC stream writer, kept from batch to batch (the sidecar's side).

    Its first batch writes the schema message and the batch; each later batch
    of an equal schema goes right after that schema message, which stays in the
    slot: no new writer and no schema message per batch (a fresh writer cost
    ~2.5 us of a 1 KiB batch's ~4 us write, and ~4 us at 1 MiB: make bench,
    transport). The stream is the same bytes a fresh writer writes. A schema
    whose batches carry dictionaries is not kept: a kept writer writes a
    dictionary once, and each slot's stream needs its own.
    """

    def __init__(self, slot: SlotFile, schema: pa.Schema) -> None:
        self.schema = schema
        self._mm = slot._mm
        self._file = pa.memory_map(str(slot.path), "r+")  # seekable, unlike a FixedSizeBufferWriter
        self._file.seek(SLOT_HEADER)
        self._writer = pa.ipc.new_stream(self._file, schema, options=_WRITE_OPTIONS)
        self._batch_at = 0  # where each batch's message starts: after the schema's, once written
        self.kept = True
        """False once the writer cannot be used again (dictionaries; a failed write)."""

    def takes(self, schema: pa.Schema) -> bool:
        """Batches of `schema` may follow the schema this writer wrote (metadata included)."""
        return schema is self.schema or schema.equals(self.schema, check_metadata=True)

    def write(self, batch: pa.RecordBatch) -> int:
        """`batch` as the slot's stream (schema, batch, end marker); its length in bytes."""
        self.kept = False  # until this write is done
        file, first = self._file, not self._batch_at
        if not first:
            file.seek(self._batch_at)
        self._writer.write_batch(batch)  # the first: the schema's message, then the batch's
        end = int(file.tell())
        if first and not self._writer.stats.num_dictionary_batches:
            self._batch_at = SLOT_HEADER + 8 + _LENGTH.unpack_from(self._mm, SLOT_HEADER + 4)[0]  # the schema's
        _END.pack_into(self._mm, end, 0xFFFFFFFF, 0)  # the same pages as `file`'s, a third of its write's cost
        self.kept = bool(self._batch_at)
        return end + _END.size - SLOT_HEADER

    def close(self) -> None:
        """Unmap; the writer is dropped unclosed (closing it would write an end marker)."""
        del self._writer
        self._file.close()


def write_stream(slot: SlotFile, batch: pa.RecordBatch) -> int:
    """`batch` as an IPC stream into the slot's payload; its length in bytes."""
    schema = batch.schema
    writer = slot.writer
    if writer is not None and not writer.takes(schema):
        slot.drop_writer()
        writer = None
    if writer is None and slot.keep_writer:
        writer = slot.writer = SlotWriter(slot, schema)
    if writer is not None:
        try:
            nbytes = writer.write(batch)
        finally:
            if not writer.kept:
                slot.drop_writer()
        if nbytes > len(slot.payload):  # past the payload, as a FixedSizeBufferWriter over it refuses
            raise OSError(f"a {nbytes}-byte stream does not fit the {len(slot.payload)} bytes of {slot.path}")
        return nbytes
    sink = pa.FixedSizeBufferWriter(pa.py_buffer(slot.payload))
    with pa.ipc.RecordBatchStreamWriter(sink, batch.schema, options=_WRITE_OPTIONS) as writer:
        writer.write_batch(batch)
    return int(sink.tell())


def write(slot: SlotFile, batch: pa.RecordBatch, step: int, seq: int) -> int:
    """Header marks, stream, trailer marks, in that order; the stream's length."""
    slot.mark_header(step, seq)
    nbytes = write_stream(slot, batch)
    slot.mark_trailer(nbytes, step, seq)
    return nbytes


def post(control: ring.Control, index: int, step: int, nbytes: int, seq: int) -> None:
    """Describe a written slot in the control block, then make it FILLED (release order, last)."""
    control.describe(index, step, nbytes, seq)
    if not control.transition(index, ring.SlotState.FREE, ring.SlotState.FILLED):
        raise AssertionError(f"slot {index} changed state while the sidecar wrote it")
    control.bump(ring.POSTS)  # after FILLED: a trainer that read `posts` before it changed does not sleep (rule 1)


def ready(control: ring.Control) -> None:
    """Wake a trainer asleep on `posts` (rule 2; `post` bumped it already)."""
    control.wake(ring.POSTS)


# -- the read half (StreamClient) ----------------------------------------------------------------

View = tuple[int, int, np.dtype, tuple[int, ...]]
"""Where a column lies in its slot: (start, stop, dtype, shape)."""


def view_of(array: pa.Array, base_address: int) -> View | None:
    """Where `array`'s values lie in the slot, if numpy can view them as they are.

    Views are made from the slot's root array (not by pyarrow) so that they are
    writable, torch accepts them without copying, and each one keeps the root
    (and so the slot) alive exactly as long as it lives.
    """
    typ = array.type
    if array.null_count == 0 and (pa.types.is_integer(typ) or pa.types.is_floating(typ)):
        dtype = np.dtype(typ.to_pandas_dtype())
        start = array.buffers()[1].address - base_address + array.offset * dtype.itemsize
        return start, start + len(array) * dtype.itemsize, dtype, (len(array),)
    if pa.types.is_fixed_size_list(typ) and array.null_count == 0:
        flat = array.flatten()
        inner = view_of(flat, base_address) if flat.null_count == 0 else None
        if inner is not None:
            return inner[0], inner[1], inner[2], (len(array), typ.list_size)
    if isinstance(typ, pa.FixedShapeTensorType) and array.null_count == 0:
        # A transform's fixed-shape output (docs/preprocessing.md): (rows, *shape).
        storage = view_of(array.storage, base_address)
        row_major = not typ.permutation or list(typ.permutation) == sorted(typ.permutation)
        if storage is not None and row_major:
            return storage[0], storage[1], storage[2], (len(array), *typ.shape)
    # Strings, nested lists, booleans (bit-packed), nulls: no zero-copy numpy form.
    return None


class Reader:
    """Turns a slot's stream into numpy columns, remembering each distinct layout.

    pyarrow reads the stream without a copy (`read_schema`/`read_record_batch`
    over the mapping), but its arrays are read-only views whose lifetime is
    pyarrow's buffer, not the slot's root array, and parsing the flatbuffers of
    every batch costs more than the rest of the read path (make bench). So the
    columns are numpy views of the root, and where they lie is worked out by
    pyarrow once per distinct stream metadata. The only hand-written part is
    reading the IPC format's 8-byte message prefix (0xFFFFFFFF continuation,
    int32 metadata length) twice, to find the metadata bytes that key the
    cache: two slots whose metadata bytes are equal lay out their bodies
    identically. pyarrow has no call that returns those lengths without
    parsing the message.
    """

    def __init__(self) -> None:
        self._layouts: dict[bytes, tuple[pa.Schema, int, list[tuple[str, View | None]]]] = {}

    def columns(self, mm: mmap.mmap, root: np.ndarray) -> tuple[dict[str, Any], int]:
        """The slot's columns as views of `root` (copies where numpy cannot view), and the row count."""
        at = SLOT_HEADER  # where the stream starts; offsets below are the stream's
        schema_end = 8 + _LENGTH.unpack_from(mm, at + 4)[0]  # after the continuation marker: metadata length
        body = schema_end + 8 + _LENGTH.unpack_from(mm, at + schema_end + 4)[0]
        key = mm[at:at + body]
        known = self._layouts.get(key)
        record_batch: pa.RecordBatch | None = None
        if known is None:
            if len(self._layouts) > 16:
                self._layouts.clear()
            buffer = pa.py_buffer(root)
            schema = pa.ipc.read_schema(buffer.slice(0, schema_end))
            record_batch = _read_batch(buffer, schema_end, schema)
            known = self._layouts[key] = (schema, record_batch.num_rows, [
                (name, view_of(array, buffer.address))
                for name, array in zip(schema.names, record_batch.columns)])
        schema, rows, layout = known
        columns: dict[str, Any] = {}
        for name, view in layout:
            if view is not None:
                start, stop, dtype, shape = view
                value = root[start:stop].view(dtype)
                columns[name] = value.reshape(shape) if len(shape) > 1 else value
            else:
                if record_batch is None:
                    record_batch = _read_batch(pa.py_buffer(root), schema_end, schema)
                columns[name] = record_batch.column(name).to_numpy(zero_copy_only=False)
        return columns, rows


def _read_batch(buffer: pa.Buffer, schema_end: int, schema: pa.Schema) -> pa.RecordBatch:
    return pa.ipc.read_record_batch(pa.ipc.read_message(buffer.slice(schema_end)), schema)


def root_of(slot: SlotFile, nbytes: int) -> np.ndarray:
    """The one array every column of the slot's batch views (its lifetime frees the slot)."""
    return np.frombuffer(slot._mm, _BYTE, nbytes, SLOT_HEADER)  # positional: keywords cost twice the call


def intact(slot: SlotFile, nbytes: int, step: int, seq: int) -> bool:
    """Both marks name this step and this write: read before the parse and after the views are built."""
    mm = slot._mm  # inline, not marks(): twice per batch
    return _MARKS.unpack_from(mm, 0) == _MARKS.unpack_from(mm, _trailer_offset(nbytes)) == (step, seq)


def open_slot(directory: Path, instance: str, local_rank: int, slot: int, gen: int) -> SlotFile:
    """The trainer's mapping of a slot file the sidecar created."""
    path = slot_path(directory, instance, local_rank, slot, gen)
    return SlotFile(path, os.path.getsize(path), create=False)


# -- the wake-up rules ---------------------------------------------------------------------------

def next_trainer_wait(count: int) -> int:
    """The trainer's next non-zero `trainer_waiting` value, before each sleep (rule 1)."""
    return count % 0x7FFFFFFF + 1


def sidecar_waits_for(states: list[int], prefetch: int) -> int:
    """What a publisher without a usable slot waits for: ROOM when `prefetch` are FILLED, else SLOT."""
    if states.count(ring.SlotState.FILLED) >= prefetch:
        return ring.Waiting.ROOM
    return ring.Waiting.SLOT


def ready_due(trainer_waiting: int, readied: int) -> bool:
    """The sidecar owes a `ready`: the trainer waits, and not yet told for this wait (rule 2)."""
    return trainer_waiting != 0 and trainer_waiting != readied


def wake_due(control: ring.Control, sidecar_waiting: int, woken: int) -> bool:
    """The trainer owes a `wake`: the sidecar waits, for something that has happened, not yet woken (rule 3).

    Reads the slot states only when the sidecar waits: this runs twice per batch.
    """
    if not sidecar_waiting or sidecar_waiting == woken:
        return False
    kind = sidecar_waiting & ring.Waiting.KIND
    if kind == ring.Waiting.ROOM:
        return control.filled() <= control.prefetch // 2
    if kind == ring.Waiting.SLOT:
        return ring.SlotState.FREE in control.states()
    return True
