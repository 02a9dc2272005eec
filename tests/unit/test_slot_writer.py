"""The sidecar's write half of a slot (trainer_client/transport/slots.py): a writer kept from batch to
batch writes the very stream a fresh pyarrow stream writer writes, and `ipc_size` of batches
with equal schemas (new objects each) is what pyarrow says it is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from splitfeed.trainer_client.transport import slots


def fresh_stream(batch: pa.RecordBatch) -> bytes:
    """pyarrow's own stream of `batch`, as an independent oracle."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=pa.ipc.IpcWriteOptions(use_threads=False)) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def ints(n: int, start: int = 0) -> pa.RecordBatch:
    return pa.record_batch({"id": pa.array(np.arange(start, start + n), pa.int64()),
                            "x": pa.array(np.linspace(0, 1, n, dtype=np.float32))})


def mixed(n: int) -> pa.RecordBatch:
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(4 * n, dtype=np.float32)), 4)
    return pa.record_batch({"id": pa.array(range(n), pa.int64()),
                            "name": pa.array([f"row {i}" * (i % 3) for i in range(n)]),
                            "maybe": pa.array([None if i % 4 == 0 else i for i in range(n)], pa.int32()),
                            "vector": vectors})


@pytest.fixture
def slot(tmp_path: Path) -> Iterator[slots.SlotFile]:
    made = slots.SlotFile(tmp_path / "slot", 1 << 20, create=True, keep_writer=True)
    yield made
    made.close()


def written(slot: slots.SlotFile, batch: pa.RecordBatch, step: int) -> bytes:
    nbytes = slots.write(slot, batch, step, step + 100)
    assert slot.marks(nbytes) == ((step, step + 100), (step, step + 100))
    return bytes(slot.view[slots.SLOT_HEADER:slots.SLOT_HEADER + nbytes])


def test_a_kept_writer_writes_what_a_fresh_writer_writes_batch_after_batch(slot: slots.SlotFile) -> None:
    # Larger and smaller batches, other values, then another schema and back.
    batches = [ints(1000), ints(10, 5), ints(4000, 7), ints(0), mixed(33), mixed(500), ints(3),
               ints(3).replace_schema_metadata({"k": "v"}), ints(3)]
    for step, batch in enumerate(batches):
        assert written(slot, batch, step) == fresh_stream(batch), f"batch {step}"
        columns, rows = slots.Reader().columns(slot._mm, slots.root_of(slot, len(fresh_stream(batch))))
        assert rows == batch.num_rows
        np.testing.assert_array_equal(np.asarray(columns["id"]), batch.column("id").to_numpy(zero_copy_only=False))
        del columns
    assert slot.writer is not None  # kept


def test_a_slot_kept_for_one_schema_takes_a_new_writer_for_another(slot: slots.SlotFile) -> None:
    written(slot, ints(50), 0)
    first = slot.writer
    written(slot, ints(60), 1)
    assert slot.writer is first
    assert written(slot, mixed(20), 2) == fresh_stream(mixed(20))
    assert slot.writer is not first and slot.writer is not None


def test_batches_with_dictionaries_are_written_fresh_and_not_kept(slot: slots.SlotFile) -> None:
    batch = pa.record_batch({"kind": pa.array(["a", "b", "a"]).dictionary_encode(), "id": pa.array([1, 2, 3])})
    for step in range(3):
        assert written(slot, batch, step) == fresh_stream(batch)
        assert slot.writer is None


def test_a_slot_that_keeps_no_writer_writes_the_same_stream(tmp_path: Path) -> None:
    slot = slots.SlotFile(tmp_path / "slot", 1 << 20, create=True)
    try:
        for step, batch in enumerate([ints(100), mixed(10), ints(7)]):
            assert written(slot, batch, step) == fresh_stream(batch)
        assert slot.writer is None
    finally:
        slot.close()


def test_a_batch_too_large_for_its_slot_fails_and_leaves_no_writer(tmp_path: Path) -> None:
    slot = slots.SlotFile(tmp_path / "slot", 1 << 16, create=True, keep_writer=True)
    try:
        written(slot, ints(10), 0)
        with pytest.raises(Exception):
            slots.write(slot, ints(20_000), 1, 1)
        assert slot.writer is None
        assert written(slot, ints(10), 2) == fresh_stream(ints(10))
    finally:
        slot.close()


def test_ipc_size_of_new_batches_with_equal_schemas_and_of_other_schemas() -> None:
    for batch in [ints(10), ints(10), ints(500), mixed(20), ints(10).replace_schema_metadata({"k": "v" * 100}),
                  ints(10)]:
        assert batch.schema is not ints(10).schema
        size = slots.ipc_size(batch)
        assert len(fresh_stream(batch)) <= size <= len(fresh_stream(batch)) + 64


def test_dictionary_columns_nested_or_not_are_written_as_their_values():
    labels = pa.array(["cat", "dog", "cat"]).dictionary_encode()
    tags = pa.array([["a"], [], ["b", "a"]], pa.list_(pa.dictionary(pa.int8(), pa.string())))
    point = pa.StructArray.from_arrays([pa.array(["x", "y", "x"]).dictionary_encode(), pa.array([1, 2, 3])],
                                       names=["axis", "at"])
    batch = pa.record_batch({"id": pa.array([1, 2, 3]), "label": labels, "tags": tags, "point": point})
    plain = slots.without_dictionaries(batch)
    assert plain.schema.types[:3] == [pa.int64(), pa.string(), pa.list_(pa.string())]
    assert plain.schema.field("point").type == pa.struct([("axis", pa.string()), ("at", pa.int64())])
    assert plain.to_pylist() == batch.to_pylist()  # the values, row for row


def test_a_batch_without_dictionaries_is_passed_on_as_it_is():
    batch = ints(4)
    assert slots.without_dictionaries(batch) is batch
