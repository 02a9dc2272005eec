"""Tables for the data-plane read tests, and StreamingDataset's own order for them.

The oracle is always `streaming.reference_dataset(...)` (a plain
`lancedb.streaming.StreamingDataset`) iterated in-process, never splitfeed's own
output, so a drift of the pinned lancedb, of the split assignment or of the
columnar reader shows up as a mismatch.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping
from typing import Any

import lancedb
import numpy as np
import pyarrow as pa

from splitfeed.sidecar.data import streaming
from splitfeed.trainer_client.contract import specs
from tests.support import s3, tables

TABLE = "frames"
NUM_ROWS = 1000
"""Not a multiple of 24 splits (16 surplus rows), nor is its split size (41) a
multiple of the rows a step takes per split: both truncations are exercised."""
DIM = 4

BUCKET, CREDENTIALS, endpoint_options = s3.BUCKET, s3.CREDENTIALS, s3.endpoint_options


def frames(num_rows: int = NUM_ROWS) -> pa.Table:
    """int64 `id` (= row number), int32 `label` (id % 10), float32[DIM] `vec` (id*DIM ..)."""
    return tables.frames(num_rows, DIM)


def write_table(uri: str, storage_options: Mapping[str, str] | None = None) -> None:
    tables.write_table(uri, NUM_ROWS, TABLE, dim=DIM, storage_options=storage_options)


def data_spec(uri: str, **overrides: Any) -> specs.DataSpec:
    """The tests' job: 24 splits, 48 rows per global step, two shuffled epochs."""
    fields: dict[str, Any] = dict(
        uri=uri, table=TABLE, num_splits=24, global_batch_size=48, shuffle_seed=7, epochs=2
    )
    return specs.DataSpec(**{**fields, **overrides})


def open_reference_table(data: specs.DataSpec, storage_options: Mapping[str, str] | None = None) -> Any:
    """The table opened with plain lancedb, independently of reading.open_table."""
    options = {**data.storage_options, **(storage_options or {})}
    return lancedb.connect(data.uri, storage_options=options or None).open_table(data.table)


def reference_rows(
    data: specs.DataSpec,
    *,
    epoch: int,
    rank: int,
    world_size: int,
    storage_options: Mapping[str, str] | None = None,
    state: dict[str, Any] | None = None,
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """Rows of rank `rank`'s StreamingDataset for `epoch`, iterated in-process.

    With `state`, the dataset first loads it (`load_state_dict`), as a resumed
    trainer would; `limit` stops after that many rows.
    """
    table = open_reference_table(data, storage_options)
    dataset = streaming.reference_dataset(table, data, epoch=epoch, rank=rank, world_size=world_size)
    if state is not None:
        dataset.load_state_dict(state)
    with contextlib.closing(iter(dataset)) as rows:
        return list(itertools.islice(rows, limit))


def whole_batches(rows: list[dict[str, Any]], batch_size: int) -> list[list[dict[str, Any]]]:
    """Cut a reference order into batches, dropping rows that cannot fill one."""
    return [rows[i : i + batch_size] for i in range(0, len(rows) - batch_size + 1, batch_size)]


def as_rows(batch: pa.RecordBatch) -> list[dict[str, Any]]:
    return batch.to_pylist()


def ids_of(batch: pa.RecordBatch) -> list[int]:
    return batch.column(batch.schema.get_field_index("id")).to_pylist()
