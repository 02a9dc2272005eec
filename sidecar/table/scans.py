"""Rows gathered from a scan (takes.scan_rows): the asked rows each batch holds, put where asked."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyarrow as pa

ROW_ID = "_rowid"
KEY_BITS = 16
"""Asked row ids are grouped by a 16-bit key that grows with the id (the fragment, then the
top bits of the row's offset in it): numpy sorts 16-bit keys by radix, 1.7M of them in ~9 ns
a row, where a sort of the int64 ids took ~55 (and ~60 ns a row of a window at 50M rows was
that sort), and a scanned batch of consecutive row ids finds its asked rows among the few
buckets it spans."""
MAX_RUNS = 64
"""A batch of more ascending runs of row ids than this is sorted instead of cut in runs (lance
scans a fragment's rows in order, so a batch is one run, or a few where it crosses fragments)."""
_LOW = (1 << 32) - 1

Hits = tuple[np.ndarray, np.ndarray]
"""(indexes into the asked ids, positions in a scanned batch) of the asked rows it holds."""


class Wanted:
    """The asked row ids (int64 values of lance's u64 row ids, which are far below 2^63),
    grouped by key: `order` lists the indexes of the asked ids bucket by bucket (int32 where
    they fit: 4 B a row held through the scan), `starts` where each bucket begins."""

    def __init__(self, asked: np.ndarray) -> None:
        self.asked = asked
        self._low = int(asked.min() >> 32)
        span = int(asked.max() >> 32) - self._low
        self._span = span
        self._top = max((int((part & _LOW).max()) for part in _chunks(asked)), default=0)
        frag_bits = span.bit_length()
        self._frag_shift = max(0, frag_bits - KEY_BITS)
        self._off_bits = min(KEY_BITS - frag_bits + self._frag_shift, self._top.bit_length())
        self._off_shift = self._top.bit_length() - self._off_bits
        self._last = self._key_of(span, self._top)
        keys = np.empty(len(asked), dtype=np.uint16)
        at = 0
        for part in _chunks(asked):  # a chunk at a time: an int64 temporary of 1M ids, not of all
            keys[at:at + len(part)] = (((part >> 32) - self._low) >> self._frag_shift << self._off_bits
                                       | (part & _LOW) >> self._off_shift)
            at += len(part)
        self.starts = np.zeros(self._last + 2, dtype=np.int64)
        np.cumsum(np.bincount(keys, minlength=self._last + 1), out=self.starts[1:])
        order = np.argsort(keys, kind="stable")  # a radix sort of 16-bit keys
        del keys
        self.order = order.astype(np.int32) if len(asked) < (1 << 31) else order

    def _key_of(self, frag: int, offset: int) -> int:
        return (frag >> self._frag_shift << self._off_bits) | (min(offset, self._top) >> self._off_shift)

    def key(self, row_id: int) -> int:
        """The bucket of `row_id`, clipped to the asked ids' buckets (monotone in the id)."""
        frag = (row_id >> 32) - self._low
        if frag < 0:
            return 0
        return self._last if frag > self._span else self._key_of(frag, row_id & _LOW)

    def between(self, first: int, last: int) -> np.ndarray:
        """Indexes of the asked ids in the buckets of `first`..`last` (a superset of those
        between them)."""
        return self.order[self.starts[self.key(first)]:self.starts[self.key(last) + 1]]

    def hits(self, found: np.ndarray) -> Hits:
        """The asked rows that `found` (a scanned batch's row ids, int64) holds. A batch of
        one fragment's rows in order (the usual one) is a range of row ids; any other is cut
        into ascending runs, each searched."""
        first, last = int(found[0]), int(found[-1])
        if last - first == len(found) - 1:
            index = self.between(first, last)
            ids = self.asked[index]
            inside = (ids >= first) & (ids <= last)
            at = ids[inside] - first
            if bool((found[at] == ids[inside]).all()):
                return index[inside], at
        cuts = np.flatnonzero(found[1:] <= found[:-1]) + 1
        if len(cuts) >= MAX_RUNS:
            return self._sorted_hits(found)
        bounds = [0, *cuts.tolist(), len(found)]
        parts = [self._run_hits(found[a:b], a) for a, b in zip(bounds, bounds[1:])]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def _run_hits(self, run: np.ndarray, base: int) -> Hits:
        """Hits of an ascending run of row ids at `base` in its batch."""
        index = self.between(int(run[0]), int(run[-1]))
        at = np.searchsorted(run, self.asked[index]).clip(0, len(run) - 1)
        hit = run[at] == self.asked[index]
        return index[hit], at[hit] + base

    def _sorted_hits(self, found: np.ndarray) -> Hits:
        order = np.argsort(found)
        index, at = self._run_hits(found[order], 0)
        return index, order[at]


def _chunks(ids: np.ndarray, size: int = 1 << 20) -> Iterable[np.ndarray]:
    return (ids[at:at + size] for at in range(0, len(ids), size))


def fixed_width(kind: pa.DataType) -> np.dtype | None:
    """The numpy type of one value of a column put in place: fixed-width values of 1-8 bytes,
    or fixed-size lists of them (vectors); None for any other (strings, booleans, nesting)."""
    if pa.types.is_fixed_size_list(kind):
        inner = kind.value_type
        return fixed_width(inner) if not pa.types.is_fixed_size_list(inner) else None
    if pa.types.is_primitive(kind) and kind.bit_width in (8, 16, 32, 64):
        return np.dtype(f"u{kind.bit_width // 8}")
    return None


def in_place(schema: pa.Schema) -> bool:
    """Every column of `schema` (but the row id) is put in place (`fixed_width`)."""
    return all(fixed_width(field.type) is not None for field in schema if field.name != ROW_ID)


def _values(array: pa.Array, dtype: np.dtype) -> tuple[np.ndarray, pa.Array]:
    """`array`'s values as numpy, a row each (a vector's values a row of a 2-D view), and the
    arrow array that holds them (the list's values for a vector)."""
    if pa.types.is_fixed_size_list(array.type):
        size = array.type.list_size
        values = array.values
        start = values.offset + array.offset * size
        flat = np.frombuffer(values.buffers()[1], dtype)[start:start + len(array) * size]
        return flat.reshape(len(array), size), values.slice(array.offset * size, len(array) * size)
    flat = np.frombuffer(array.buffers()[1], dtype)
    return flat[array.offset:array.offset + len(array)], array


class _Column:
    """One fixed-width column put in place: its values scattered to the asked positions, its
    nulls (rare) cleared in a bitmap of the asked rows (a vector's elements: of its values)."""

    def __init__(self, field: pa.Field, count: int) -> None:
        self.field = field
        dtype = fixed_width(field.type)
        assert dtype is not None
        self.dtype = dtype
        self.size = field.type.list_size if pa.types.is_fixed_size_list(field.type) else 0
        self.count = count
        self.values = np.empty((count, self.size) if self.size else count, dtype=dtype)
        self.valid: list[np.ndarray | None] = [None, None]
        """Bitmaps of the rows, of a vector's values: None until a null is put."""

    def put(self, array: pa.Array, index: np.ndarray, at: np.ndarray) -> None:
        values, inner = _values(array, self.dtype)
        self.values[index] = values[at]
        if array.null_count:
            self._nulls(0, index[np.asarray(array.is_null())[at]])
        if self.size and inner.null_count:
            nulls = np.asarray(inner.is_null()).reshape(len(array), self.size)[at]
            row, element = np.nonzero(nulls)
            self._nulls(1, index[row] * self.size + element)

    def _nulls(self, level: int, positions: np.ndarray) -> None:
        if not len(positions):
            return
        bitmap = self.valid[level]
        if bitmap is None:
            bitmap = np.full(-(-self.count * max(1, self.size if level else 1) // 8), 0xFF, np.uint8)
            self.valid[level] = bitmap
        np.bitwise_and.at(bitmap, positions >> 3, ~(np.uint8(1) << (positions & 7).astype(np.uint8)))

    def array(self) -> pa.Array:
        def buffer(bitmap: np.ndarray | None) -> pa.Buffer | None:
            return None if bitmap is None else pa.py_buffer(bitmap)

        values = pa.py_buffer(self.values)
        if not self.size:
            return pa.Array.from_buffers(self.field.type, self.count, [buffer(self.valid[0]), values])
        inner = pa.Array.from_buffers(self.field.type.value_type, self.count * self.size,
                                      [buffer(self.valid[1]), values])
        return pa.Array.from_buffers(self.field.type, self.count, [buffer(self.valid[0])], children=[inner])


class Into:
    """The asked rows, put where they were asked as scanned batches give them: fixed-width
    columns in place (their bytes held once: one array a column, no copy to reorder);
    any other column picked per batch and put in order at the end (held three times at
    its peak: the picked rows, joined, reordered)."""

    def __init__(self, schema: pa.Schema, count: int) -> None:
        self.schema = pa.schema([field for field in schema if field.name != ROW_ID], metadata=schema.metadata)
        self.count = count
        self.filled = 0
        self._fixed = {field.name: _Column(field, count) for field in self.schema
                       if fixed_width(field.type) is not None}
        self._others = [field.name for field in self.schema if field.name not in self._fixed]
        self._picked: list[pa.RecordBatch] = []
        self._where: list[np.ndarray] = []

    def put(self, batch: pa.RecordBatch, hits: Hits) -> None:
        index, at = hits
        self.filled += len(index)
        for name, column in self._fixed.items():
            column.put(batch.column(name), index, at)
        if self._others:
            self._picked.append(batch.select(self._others).take(pa.array(at)))
            self._where.append(index)

    def batch(self) -> pa.RecordBatch:
        columns: dict[str, pa.Array] = {
            name: column.array() for name, column in self._fixed.items()}
        if self._others:
            rows_at = np.empty(self.count, dtype=np.int64)
            rows_at[np.concatenate(self._where)] = np.arange(self.count)
            self._where.clear()
            picked = pa.Table.from_batches(self._picked)
            self._picked.clear()
            ordered = picked.take(pa.array(rows_at)).combine_chunks()
            columns.update({name: ordered.column(name).chunk(0) for name in self._others})
        return pa.RecordBatch.from_arrays([columns[field.name] for field in self.schema], schema=self.schema)


def gather(batches: Iterable[pa.RecordBatch], asked: np.ndarray) -> pa.RecordBatch | None:
    """The rows of `asked` (int64 row ids, in the order asked, repeats given each time)
    that `batches` (a scan of the table with its row ids) hold; None where one is missing
    (or `asked` is empty), for a take to say why."""
    if not len(asked) or int(asked.min()) < 0:
        return None
    wanted = Wanted(asked)
    into: Into | None = None
    for batch in batches:
        if not batch.num_rows or (into is not None and into.filled >= len(asked)):
            continue
        hits = wanted.hits(batch.column(ROW_ID).to_numpy().view(np.int64))
        if into is None:
            into = Into(batch.schema, len(asked))
        if len(hits[0]):
            into.put(batch, hits)
    if into is None or into.filled != len(asked):
        return None
    return into.batch()
