"""Output rows of a transform -> one Arrow batch per step (sidecar/data/preprocessing.py).

Expected values are written out here, not computed by the code under test.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from splitfeed.sidecar.data import preprocessing
from splitfeed.trainer_client.contract import errors, specs


def test_fixed_shape_numeric_values_become_one_tensor_column_each():
    rows = [{"img": np.full((2, 3), i, np.float32), "label": i, "w": torch.tensor([i, i + 1])}
            for i in range(3)]
    batch = preprocessing.collate(rows, "m:f")
    assert batch.schema.names == ["img", "label", "w"]
    img = batch.column("img")
    assert isinstance(img.type, pa.FixedShapeTensorType) and img.type.shape == [2, 3]
    assert img.type.value_type == pa.float32()
    assert img.to_numpy_ndarray()[2].tolist() == [[2.0] * 3] * 2
    assert batch.column("label").type == pa.int64() and batch.column("label").to_pylist() == [0, 1, 2]
    assert batch.column("w").to_numpy_ndarray().tolist() == [[0, 1], [1, 2], [2, 3]]


def test_other_values_keep_an_arrow_form():
    rows = [{"text": "a", "ragged": np.arange(1), "ok": True},
            {"text": "bc", "ragged": np.arange(2), "ok": False}]
    batch = preprocessing.collate(rows, "m:f")
    assert batch.column("text").to_pylist() == ["a", "bc"]
    assert batch.column("ragged").to_pylist() == [[0], [0, 1]]
    assert batch.column("ok").to_pylist() == [True, False]


def test_tuples_and_plain_values_get_positional_and_value_columns():
    assert preprocessing.collate([(1, "x"), (2, "y")], "m:f").schema.names == ["0", "1"]
    single = preprocessing.collate([np.zeros(4, np.int16), np.ones(4, np.int16)], "m:f")
    assert single.schema.names == ["value"]
    assert single.column("value").to_numpy_ndarray().tolist() == [[0] * 4, [1] * 4]


def test_rows_with_different_fields_name_the_transform():
    with pytest.raises(errors.UserError, match=r"spec.data.transform='m:f' returned rows with different fields"):
        preprocessing.collate([{"a": 1}, {"b": 1}], "m:f")


def test_a_failing_row_becomes_a_marker_and_the_rest_keep_their_outputs():
    def transform(batch):
        values = batch.column("x").to_pylist()
        if 3 in values:
            raise ValueError("three")
        return [{"y": v * 10} for v in values]

    guarded = preprocessing.Guarded(transform, "m:f")
    out = guarded(pa.record_batch({"x": [1, 3, 5]}))
    assert out[0] == {"y": 10} and out[2] == {"y": 50}
    assert isinstance(out[1], preprocessing.Failed) and str(out[1].error) == "three"
    assert out[1].preview == "{'x': 3}"


def test_loading_binds_the_json_arguments():
    data = specs.DataSpec(uri="/x", table="t", num_splits=1, global_batch_size=1,
                          transform="tests.support.transforms:features", transform_args='{"scale": 3.0}')
    fn = preprocessing.load_transform(data)
    batch = pa.record_batch({"id": [7], "label": [1], "vec": pa.FixedSizeListArray.from_arrays(
        pa.array([1.0, 2.0, 3.0, 4.0], pa.float32()), 4)})
    assert fn(batch)[0]["image"].tolist() == [[3.0, 6.0], [9.0, 12.0]]
