"""Batches the frameworks move, copy and rebuild, and the read-ahead-safe positions, against a
real sidecar (a thread of this process) and the real torch, Lightning and Accelerate functions."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate.utils import concatenate, send_to_device
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_convert

from splitfeed.trainer_client import CheckpointError, StreamClient
from splitfeed.trainer_client.script.taking import Batch
from tests.streaming.harness import manifest, pods, reference_batches, socket_root  # noqa: F401


def a_batch() -> Batch:
    return Batch({"id": torch.arange(4), "vec": torch.ones(4, 2)}, epoch=1, step=2, global_step=22, rows=4)


def meta(b: Batch) -> tuple[int, int, int, int]:
    return b.epoch, b.step, b.global_step, b.rows


@pytest.mark.parametrize("move", [
    pytest.param(lambda b: b.to("cpu", non_blocking=True), id="to"),
    pytest.param(lambda b: move_data_to_device(b, torch.device("cpu")), id="lightning-move_data_to_device"),
    pytest.param(lambda b: send_to_device(b, "cpu", non_blocking=True), id="accelerate-send_to_device"),
    pytest.param(default_convert, id="torch-default_convert"),
    pytest.param(copy.copy, id="copy"),
])
def test_a_moved_or_copied_batch_keeps_its_step(move):
    batch = a_batch()
    moved = move(batch)
    assert isinstance(moved, Batch) and meta(moved) == (1, 2, 22, 4)
    assert torch.equal(moved["id"], torch.arange(4)) and set(moved) == {"id", "vec"}


def test_a_copy_changed_leaves_the_batch_as_it_was():
    batch = a_batch()
    clone = copy.copy(batch)
    clone["id"] = torch.zeros(4)
    assert torch.equal(batch["id"], torch.arange(4))


def test_a_rebuild_from_a_plain_mapping_works_without_the_step():
    """HF Trainer's `_prepare_input` and Accelerate's `concatenate` call `type(batch)({...})`."""
    rebuilt = type(a_batch())({"id": torch.arange(2)})
    assert isinstance(rebuilt, Batch) and rebuilt.global_step == -1 and list(rebuilt) == ["id"]
    joined = concatenate([a_batch(), a_batch()])
    assert joined["id"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]


def test_pin_memory_keeps_the_step_for_columns_that_cannot_pin():
    import numpy as np

    batch = Batch({"text": np.array(["a", "b"], dtype=object)}, epoch=0, step=3, global_step=3, rows=2)
    assert meta(batch.pin_memory()) == (0, 3, 3, 2)


def test_a_dataloader_over_the_client_yields_its_batches_in_order(pods, table_uri):  # noqa: F811
    pod = pods("pod", manifest(table_uri), replicas=1, replica=0).start_thread()
    expected = reference_batches(table_uri, {}, 1, 0)
    with StreamClient(pod.socket_dir, 0) as client:
        dataset = client.as_iterable_dataset()
        assert len(dataset) == 20
        dataset.set_epoch(3)  # frameworks call it; the order does not change
        got = [(b.global_step, b["id"].tolist()) for b in DataLoader(dataset, batch_size=None)]
    assert got == list(enumerate(expected))


def test_a_loader_that_reads_ahead_checkpoints_the_steps_it_trained(pods, table_uri, tmp_path):  # noqa: F811
    """A loop that takes batch k + 1 before it trains batch k (Lightning, Accelerate, a
    prefetching DataLoader) says what it trained; its checkpoint is of that, not of what it took."""
    pod = pods("pod", manifest(table_uri, str(tmp_path / "ckpt")), replicas=1, replica=0).start_thread()
    with StreamClient(pod.socket_dir, 0) as client:
        stream = iter(client)
        ahead = next(stream)
        for _ in range(5):
            trained, ahead = ahead, next(stream)  # batch k + 1 taken, then batch k trained
            client.trained(trained)
        assert (trained.global_step, ahead.global_step) == (4, 5)
        assert client.checkpoint_position == 5
        # The sidecar's progress (its splitfeed_global_step, the operator's status) counts trained steps.
        from splitfeed.sidecar.serving import metrics
        assert metrics.read_rank(pod._sidecar.server.feeds[0]).global_step == 5
        assert client.checkpoint() == 5  # 6 batches handed out, 5 trained
        client.commit(5)
        with pytest.raises(CheckpointError, match="was handed 6 global steps"):
            client.trained(7)
        with pytest.raises(CheckpointError, match=r"name a step in 0\.\.6"):
            client.checkpoint(after_step=9)
        assert client.checkpoint(after_step=6) == 6
        client.commit(6)
    from tests.support.exactness import complete_checkpoints
    assert {5, 6} <= complete_checkpoints(tmp_path / "ckpt")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: no group to save over
def test_a_dcp_checkpoint_of_the_data_resumes_only_at_its_step(pods, table_uri, tmp_path):  # noqa: F811
    """torch.distributed.checkpoint saves the data position beside the model; a new world loads
    it only where it resumes (DCP calls state_dict() before load_state_dict(): no side effects)."""
    import torch.distributed.checkpoint as dcp

    job = manifest(table_uri, str(tmp_path / "ckpt"))
    pod = pods("a", job, replicas=1, replica=0).start_thread()
    with StreamClient(pod.socket_dir, 0) as client:
        for batch in client:
            if batch.global_step == 5:
                break
        for after in (4, 6):  # a checkpoint of step 4 (trained: 4), then of step 6
            step = client.checkpoint(after_step=after)
            dcp.save({"data": client.data_state(), "w": torch.full((2,), float(step))},
                     checkpoint_id=str(tmp_path / f"dcp-{step}"), no_dist=True)
            client.commit(step)
        assert client.checkpoint_position == 6  # saving moved nothing
    again = pods("b", job, replicas=1, replica=0).start_thread()
    with StreamClient(again.socket_dir, 0) as client:
        assert client.resume_step == 6
        model = {"data": client.data_state(), "w": torch.zeros(2)}
        dcp.load(model, checkpoint_id=str(tmp_path / "dcp-6"), no_dist=True)
        assert model["w"].tolist() == [6.0, 6.0]
        with pytest.raises(Exception, match="holds global step 4, but the world resumes its data at step 6"):
            dcp.load({"data": client.data_state(), "w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "dcp-4"), no_dist=True)
        assert next(iter(client)).global_step == 6
