"""The bench's preprocessing: JPEG decode and normalise, as an image job would.

Named by import path (spec.data.transform) in the sidecar and passed as a callable
to StreamingDataset in-process: the same function both ways.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pyarrow as pa
from PIL import Image

MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)


def decode_normalise(batch: pa.RecordBatch) -> list[dict[str, Any]]:
    """JPEG bytes -> float32 (3, H, W), ImageNet-normalised; label as int64."""
    out = []
    for jpeg, label in zip(batch.column("jpeg").to_pylist(), batch.column("label").to_pylist()):
        rgb = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"), np.float32) / 255.0
        out.append({"image": (rgb.transpose(2, 0, 1) - MEAN) / STD, "label": np.int64(label)})
    return out
