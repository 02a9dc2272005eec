"""Transforms for the onTransformError=skip/warn tests (imported by path by the sidecar and
its spawned loader workers). Row-wise and deterministic, as lancedb's exact resume requires."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa


def ids_fragile(batch: pa.RecordBatch, bad: list[int] | None = None) -> list[dict[str, Any]]:
    """The row's id (int64) and label; a batch holding an id listed in `bad` raises."""
    ids = batch.column("id").to_pylist()
    broken = sorted(set(ids) & set(bad or []))
    if broken:
        raise ValueError(f"cannot decode ids {broken}")
    return [{"id": np.int64(i), "label": np.int64(label)}
            for i, label in zip(ids, batch.column("label").to_pylist())]


def passthrough_fragile(batch: pa.RecordBatch, bad: list[int] | None = None) -> list[dict[str, Any]]:
    """What tests/e2e/trainer.py trains on (id, label, vec as per-row numpy values); a batch
    holding an id listed in `bad` raises."""
    ids = batch.column("id").to_pylist()
    broken = sorted(set(ids) & set(bad or []))
    if broken:
        raise ValueError(f"cannot decode ids {broken}")
    vecs = batch.column("vec").flatten().to_numpy().reshape(len(ids), -1)
    return [{"id": np.int64(i), "label": np.int32(label), "vec": vec.copy()}
            for i, label, vec in zip(ids, batch.column("label").to_pylist(), vecs)]
