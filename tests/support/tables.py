"""The test table and its reference order, for every tier that reads data.

One writer: `frames` is the table every tier reads (int64 `id` = row number, int32
`label` = id % 10, float32[dim] `vec`). Expected batches always come from lancedb's
own `StreamingDataset` iterated in-process (`streaming.reference_dataset`), never
from splitfeed's output, so a drift of the pinned lancedb shows up as a mismatch.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import lancedb
import numpy as np
import pyarrow as pa

from splitfeed.sidecar.data import reading, streaming
from splitfeed.trainer_client.contract import specs, topology
from tests.support import exactness
from tests.support.manifests import data_manifest

TABLE = "frames"
ROWS = 1000


def frames(num_rows: int = ROWS, dim: int = 4, seed: int | None = None) -> pa.Table:
    """The table: `vec` counts up (id*dim ..) or, with `seed`, is standard normal (for training)."""
    ids = np.arange(num_rows, dtype=np.int64)
    if seed is None:
        values = pa.array(np.arange(num_rows * dim, dtype=np.float32))
    else:
        values = pa.array(np.random.default_rng(seed).standard_normal((num_rows, dim)).astype(np.float32).ravel())
    return pa.table({
        "id": pa.array(ids),
        "label": pa.array((ids % 10).astype(np.int32)),
        "vec": pa.FixedSizeListArray.from_arrays(values, dim),
    })


def write_table(uri: str, rows: int = ROWS, name: str = TABLE, *, dim: int = 4, seed: int | None = None,
                storage_options: Mapping[str, str] | None = None) -> None:
    db = lancedb.connect(uri, storage_options=dict(storage_options or {}) or None)
    db.create_table(name, frames(rows, dim, seed), mode="overwrite")


TRAINING_DIM = 8


def write_training_table(uri: str, rows: int = ROWS, name: str = TABLE) -> None:
    """The table with TRAINING_DIM-wide random vectors: what the trainers of the streaming and
    end-to-end tiers train on."""
    write_table(uri, rows, name, dim=TRAINING_DIM, seed=1)


def check_exact(logs: Path, store: Path, uri: str, data_overrides: dict | None = None) -> exactness.Summary:
    """The trainers' logs (tests/e2e/trainer.py) under `logs` against StreamingDataset over the
    job of `data_manifest(uri, **data_overrides)`, by tests/support/exactness.py's rule, with
    the complete checkpoints found in `store` (the job's directory of the store)."""
    overrides = data_overrides or {}
    return exactness.check(logs, exactness.complete_checkpoints(store),
                           [set(b) for b in reference_batches(uri, overrides, 1, 0)],
                           lambda world, rank: reference_batches(uri, overrides, world, rank))


def reference_batches(uri: str, data_overrides: dict, world: int, rank: int) -> list[list[int]]:
    """Rank `rank`'s batches of ids, every epoch, from StreamingDataset in-process
    (the job of `manifests.data_manifest(uri, **data_overrides)`)."""
    job = specs.parse_job(data_manifest(uri, **data_overrides), check_replicas=False)
    data = job.data
    table = reading.open_table(data)
    b = topology.rank_batch_size(data.global_batch_size, world)
    out: list[list[int]] = []
    for epoch in range(data.epochs):
        ids = [row["id"] for row in streaming.reference_dataset(
            table, data, epoch=epoch, rank=rank, world_size=world)]
        out.extend(ids[k * b:(k + 1) * b] for k in range(len(ids) // b))
    return out


def reference_global_steps(uri: str, data_overrides: dict) -> list[set[int]]:
    """The set of ids in each global step: one rank's order at world size 1."""
    return [set(batch) for batch in reference_batches(uri, data_overrides, 1, 0)]
