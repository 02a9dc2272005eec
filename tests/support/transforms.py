"""Transforms the preprocessing tests name by import path (spec.data.transform).

Row-wise and deterministic, as lancedb's exact resume requires. They live in a
module of their own so that loader worker processes (spawned) import them too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa


def features(batch: pa.RecordBatch, scale: float = 1.0) -> list[dict[str, Any]]:
    """Changes types and shapes: vec float32[4] -> (2, 2) float64 image scaled, id -> int16
    `key`, label -> a string `name`."""
    ids = batch.column("id").to_pylist()
    labels = batch.column("label").to_pylist()
    vecs = batch.column("vec").flatten().to_numpy().reshape(-1, 4)
    return [
        {
            "key": np.int16(i % 30000),
            "image": (vec.astype(np.float64) * scale).reshape(2, 2),
            "name": f"label-{label}",
        }
        for i, label, vec in zip(ids, labels, vecs)
    ]


def fragile(batch: pa.RecordBatch, bad: list[int] | None = None) -> list[dict[str, Any]]:
    """`features`, but a batch holding an id listed in `bad` raises."""
    ids = batch.column("id").to_pylist()
    broken = sorted(set(ids) & set(bad or []))
    if broken:
        raise ValueError(f"cannot decode ids {broken}")
    return features(batch)


def one_short(batch: pa.RecordBatch) -> list[dict[str, Any]]:
    """Returns one row fewer than it was given: a transform bug."""
    return features(batch)[:-1]


NOT_CALLABLE = 42


def image(batch: pa.RecordBatch, scale: float = 1.0) -> list[dict[str, Any]]:
    """For the data-plane table (vec float32[8]): a (2, 2, 2) float32 image, an int64
    label, a string tag (which the trainer receives copied)."""
    ids = batch.column("id").to_pylist()
    vecs = batch.column("vec").flatten().to_numpy().reshape(-1, 8)
    return [
        {"image": (vec * np.float32(scale)).reshape(2, 2, 2), "label": int(i) % 7, "tag": f"t{i}"}
        for i, vec in zip(ids, vecs)
    ]


def image_fragile(batch: pa.RecordBatch, bad: int = -1) -> list[dict[str, Any]]:
    """`image`, raising for a batch that holds id `bad`."""
    if bad in batch.column("id").to_pylist():
        raise ValueError(f"corrupt JPEG in row id {bad}")
    return image(batch)


def passthrough_plus(batch: pa.RecordBatch) -> list[dict[str, Any]]:
    """Keeps id, label and vec (what tests/e2e/trainer.py trains on) as per-row numpy
    values and adds a (2, 4) image: the rows' order must not change."""
    ids = batch.column("id").to_pylist()
    labels = batch.column("label").to_pylist()
    vecs = batch.column("vec").flatten().to_numpy().reshape(-1, 8)
    return [
        {"id": np.int64(i), "label": np.int32(label), "vec": vec.copy(), "image": vec.reshape(2, 4) * 2}
        for i, label, vec in zip(ids, labels, vecs)
    ]
