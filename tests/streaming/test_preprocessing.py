"""Transforms through real sidecars and the ring: what a trainer receives.

Expected batches come from lancedb's StreamingDataset with the same transform,
iterated in-process (tests/reading/test_preprocessing.py covers every world size,
numWorkers, fill and packing at the reader; this file covers the ring's tensors
and how a failing transform reaches the trainer and the termination report).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from splitfeed.sidecar.data import reading, streaming
from splitfeed.trainer_client.contract import errors, specs, topology
from splitfeed.trainer_client.transport import worlds
from splitfeed.trainer_client.script.client import StreamClient

from tests.support import transforms
from tests.streaming.harness import coordinator_address, manifest, reference_batches
from tests.support.tables import check_exact
from tests.support.waiting import wait_for

IMAGE = {"transform": "tests.support.transforms:image", "transformArgs": '{"scale": 2.0}'}


def reference(uri: str, data_overrides: dict, world: int, rank: int) -> list[list[dict]]:
    data = specs.parse_job(manifest(uri, **data_overrides), check_replicas=False).data
    table = reading.open_table(data)
    dataset = streaming.reference_dataset(table, data, epoch=0, rank=rank, world_size=world)
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
    bad = list(streaming.reference_dataset(table, data, epoch=0, rank=0, world_size=1))[100]["id"]
    job = manifest(table_uri, transform="tests.support.transforms:image_fragile",
                   transformArgs=json.dumps({"bad": bad}))
    pod = pods("pod", job, replicas=1, replica=0).start_process()
    with pytest.raises(errors.SidecarFailed) as info:
        with StreamClient(pod.socket_dir, 0, timeout_s=60) as client:
            for _ in client:
                pass
    assert "tests.support.transforms:image_fragile' failed on the row at position" in str(info.value)
    assert pod.wait() == 2
    report = json.loads(pod.termination_log.read_text())
    assert report["permanent"] is True
    assert f"corrupt JPEG in row id {bad}" in report["error"] and f"'id': {bad}" in report["error"]


def test_fill_counts_substituted_rows_in_the_live_status_and_the_report(pods, table_uri):
    data = specs.parse_job(manifest(table_uri), check_replicas=False).data
    table = reading.open_table(data)
    bad = list(streaming.reference_dataset(table, data, epoch=0, rank=0, world_size=1))[5]["id"]
    job = manifest(table_uri, transform="tests.support.transforms:image_fragile",
                   transformArgs=json.dumps({"bad": bad}), onTransformError="fill", numWorkers=2)
    address = coordinator_address()
    pod = pods("pod", job, replicas=1, replica=0, coordinator=address).start_process()
    with StreamClient(pod.socket_dir, 0, timeout_s=60) as client:
        batches = iter(client)
        next(batches)  # step 0 holds the filled row: the member's `progress` carries it
        live = wait_for(lambda: getattr(worlds.request_status(address, timeout_s=5), "filled_rows", 0),
                        timeout=30, what="the coordinator's status counting the filled row")
        steps = 1 + sum(1 for _ in batches)
    assert live == 1
    assert steps == client.total_steps
    assert pod.wait() == 0
    assert json.loads(pod.termination_log.read_text())["filledRows"] == 1


E2E_TRAINER = Path(__file__).parents[1] / "e2e" / "trainer.py"


def splitfeed(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splitfeed.trainer_client.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_a_live_rescale_2_to_4_to_3_of_a_transform_job_with_ddp_trainers_is_exact(table_uri, tmp_path):
    """`splitfeed local --scale-at` with a transform: real DDP trainers (gloo) train on the
    transformed columns; every global step holds the reference rows exactly once."""
    logs, store = tmp_path / "logs", tmp_path / "ckpt"
    job = manifest(table_uri, str(store), transform="tests.support.transforms:passthrough_plus",
                   numWorkers=2)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    done = splitfeed("local", "-f", str(path), "--replicas", "2", "--resume", "none",
                     "--scale-at", "4:4", "--scale-at", "10:3",
                     "--", sys.executable, str(E2E_TRAINER), str(logs), "--sleep-s", "0.25", timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("; 0 steps redone") == 2, done.stderr
    summary = check_exact(logs, store / "test" / "job", table_uri)
    assert [w.size for w in summary.worlds] == [2, 4, 3], summary
    assert summary.replayed == 0, summary


def test_plan_imports_the_transform_and_prints_the_packing_budget(table_uri, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest(table_uri, transform="tests.reading.no_such:f")))
    done = splitfeed("plan", "-f", str(path), "--read-table")
    assert done.returncode == 2
    assert "spec.data.transform='tests.reading.no_such:f': cannot import module 'tests.reading.no_such'" in done.stderr
    path.write_text(yaml.safe_dump(manifest(table_uri, transform="tests.support.transforms:image")))
    done = splitfeed("plan", "-f", str(path), "--read-table")
    assert done.returncode == 0, done.stderr
    assert "transform tests.support.transforms:image: imports here" in done.stdout
