"""Transforms through real sidecars and the ring: what a trainer receives.

Expected batches come from lancedb's StreamingDataset with the same transform,
iterated in-process (tests/data/test_preprocessing.py covers every world size,
numWorkers, fill and packing at the reader; this file covers the ring's tensors
and how a failing transform reaches the trainer and the termination report).
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch

from splitfeed.sidecar import reading
from splitfeed.trainer_client import errors, specs, topology
from splitfeed.trainer_client.client import StreamClient

from tests.data import transforms
from tests.dataplane.harness import coordinator_address, manifest

IMAGE = {"transform": "tests.data.transforms:image", "transformArgs": '{"scale": 2.0}'}


def reference(uri: str, data_overrides: dict, world: int, rank: int) -> list[list[dict]]:
    data = specs.parse_job(manifest(uri, **data_overrides), check_replicas=False).data
    table = reading.open_table(data)
    dataset = reading.reference_dataset(table, data, epoch=0, rank=rank, world_size=world)
    dataset._transform = functools.partial(transforms.image, **data.transform_kwargs)
    rows = list(dataset)
    b = topology.rank_batch_size(data.global_batch_size, world)
    return [rows[k * b:(k + 1) * b] for k in range(len(rows) // b)]


@pytest.mark.parametrize("data", [pytest.param(IMAGE, id="K=1"),
                                  pytest.param({**IMAGE, "numWorkers": 2}, id="K=2")])
def test_transformed_columns_arrive_as_tensors_in_the_reference_order(pods, table_uri, data):
    world = 2
    job = manifest(table_uri, **data)
    coordinator = coordinator_address()
    started = [pods(f"pod{r}", job, replicas=world, replica=r, coordinator=coordinator).start_thread()
               for r in range(world)]
    for rank, pod in enumerate(started):
        expected = reference(table_uri, data, world, rank)
        got = 0
        with StreamClient(pod.socket_dir, 0) as client:
            for batch in client:
                ref = expected[batch.global_step]
                assert isinstance(batch["image"], torch.Tensor) and batch["image"].dtype == torch.float32
                assert batch["image"].shape == (24, 2, 2, 2)
                assert np.array_equal(batch["image"].numpy(), np.stack([r["image"] for r in ref]))
                assert batch["label"].dtype == torch.int64
                assert batch["label"].tolist() == [r["label"] for r in ref]
                assert list(batch["tag"]) == [r["tag"] for r in ref]  # strings: copied, numpy objects
                got += 1
        assert got == len(expected) > 0
        assert pod.wait() == 0


def test_a_failing_row_under_raise_fails_the_trainer_and_the_report_naming_it(pods, table_uri):
    data = specs.parse_job(manifest(table_uri), check_replicas=False).data
    table = reading.open_table(data)
    bad = list(reading.reference_dataset(table, data, epoch=0, rank=0, world_size=1))[100]["id"]
    job = manifest(table_uri, transform="tests.data.transforms:image_fragile",
                   transformArgs=json.dumps({"bad": bad}))
    pod = pods("pod", job, replicas=1, replica=0).start_process()
    with pytest.raises(errors.SidecarFailed) as info:
        with StreamClient(pod.socket_dir, 0, timeout_s=60) as client:
            for _ in client:
                pass
    assert "tests.data.transforms:image_fragile' failed on the row at position" in str(info.value)
    assert pod.wait() == 2
    report = json.loads(pod.termination_log.read_text())
    assert report["permanent"] is True
    assert f"corrupt JPEG in row id {bad}" in report["error"] and f"'id': {bad}" in report["error"]


def test_fill_counts_substituted_rows_in_the_report(pods, table_uri):
    data = specs.parse_job(manifest(table_uri), check_replicas=False).data
    table = reading.open_table(data)
    bad = list(reading.reference_dataset(table, data, epoch=0, rank=0, world_size=1))[5]["id"]
    job = manifest(table_uri, transform="tests.data.transforms:image_fragile",
                   transformArgs=json.dumps({"bad": bad}), onTransformError="fill", numWorkers=2)
    pod = pods("pod", job, replicas=1, replica=0).start_process()
    with StreamClient(pod.socket_dir, 0, timeout_s=60) as client:
        steps = sum(1 for _ in client)
    assert steps == client.total_steps
    assert pod.wait() == 0
    assert json.loads(pod.termination_log.read_text())["filledRows"] == 1
