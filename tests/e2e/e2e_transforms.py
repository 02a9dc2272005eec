"""The transform module of tests/e2e/test_transform.py, shipped to the sidecar as a ConfigMap.

The README's "Small functions from a ConfigMap": the test creates a ConfigMap from this
file's text and the job's trainer template declares it as the `splitfeed-transforms`
volume, which the operator mounts into the sidecar and puts on its PYTHONPATH. Only
numpy and pyarrow, which the sidecar image has. Row-wise and deterministic.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def tagged(batch: Any, bad: list[int] | None = None) -> list[dict[str, Any]]:
    """Keeps id, label and vec (what tests/e2e/trainer.py trains on) and adds `tag`, a float
    that depends on the row's id and vector; a batch holding an id listed in `bad` raises."""
    ids = batch.column("id").to_pylist()
    broken = sorted(set(ids) & set(bad or []))
    if broken:
        raise ValueError(f"cannot decode ids {broken}")
    labels = batch.column("label").to_pylist()
    vecs = batch.column("vec").flatten().to_numpy().reshape(len(ids), -1)
    return [
        {"id": np.int64(i), "label": np.int32(label), "vec": vec.copy(),
         "tag": np.float64(i) * 0.5 + float(vec.sum())}
        for i, label, vec in zip(ids, labels, vecs)
    ]
