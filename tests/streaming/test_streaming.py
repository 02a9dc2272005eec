"""A sidecar hands each rank exactly its reference batches through shared memory."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch
import zmq

from splitfeed.trainer_client.contract import messages
from splitfeed.trainer_client.transport import ring
from splitfeed.trainer_client.script.client import StreamClient

from tests.streaming.harness import coordinator_address, DIM, manifest, reference_batches
from tests.support.waiting import wait_for


def ids(batch) -> list[int]:
    return batch["id"].tolist()


@pytest.mark.parametrize("world,data", [
    pytest.param(2, {}, id="world2"),
    pytest.param(3, {"filter": "label >= 2", "epochs": 2}, id="world3-filter-2epochs"),
    pytest.param(2, {"numWorkers": 2, "shuffleClumpSize": 5}, id="world2-2workers-clumps"),
])
def test_every_rank_receives_its_reference_batches_in_order(pods, table_uri, world, data):
    job = manifest(table_uri, **data)
    coordinator = coordinator_address()
    started = [pods(f"pod{r}", job, replicas=world, replica=r, coordinator=coordinator).start_thread()
               for r in range(world)]
    for rank, pod in enumerate(started):
        expected = reference_batches(table_uri, data, world, rank)
        with StreamClient(pod.socket_dir, 0) as client:
            got = []
            for batch in client:
                assert isinstance(batch["id"], torch.Tensor)
                assert batch["vec"].shape == (48 // world, DIM)
                assert batch.global_step == len(got)
                assert batch.global_step == batch.epoch * client.steps_per_epoch + batch.step
                got.append(ids(batch))
            assert (client.rank, client.world_size, client.resume_step) == (rank, world, 0)
        assert got == expected
        assert pod.wait() == 0


def test_held_batches_never_change_even_beyond_the_number_of_slots(pods, table_uri):
    pod = pods("pod", manifest(table_uri), replicas=1, replica=0).start_thread()
    expected = reference_batches(table_uri, {}, 1, 0)
    with StreamClient(pod.socket_dir, 0) as client:
        held = [batch for batch in client]  # prefetchBatches is 2; hold all 20
        copies = [ids(b) for b in held]
        vec_sums = [float(b["vec"].sum()) for b in held]
        gc.collect()
        assert copies == expected
        assert [ids(b) for b in held] == expected
        assert [float(b["vec"].sum()) for b in held] == vec_sums
        assert len(held) > 2


def test_released_slots_are_reused(pods, table_uri):
    pod = pods("pod", manifest(table_uri), replicas=1, replica=0).start_thread()
    with StreamClient(pod.socket_dir, 0) as client:
        count = sum(1 for _ in client)
        slot_files = [p for p in os.listdir(pod.socket_dir) if p.startswith("slot-")]
    assert count == 20
    # prefetch 2 filled + the batch in hand + one being released
    assert len(slot_files) <= 4, slot_files


def test_a_view_that_outlives_its_batch_keeps_its_slot(pods, table_uri):
    pod = pods("pod", manifest(table_uri), replicas=1, replica=0).start_thread()
    expected = reference_batches(table_uri, {}, 1, 0)
    with StreamClient(pod.socket_dir, 0) as client:
        first = next(iter(client))["id"][:5]  # the batch itself is dropped at once
        rest = [ids(b) for b in client]
        gc.collect()
        assert first.tolist() == expected[0][:5]
        assert rest == expected[1:]


def test_the_sidecar_never_runs_more_than_prefetch_batches_ahead(pods, table_uri):
    pod = pods("pod", manifest(table_uri), replicas=1, replica=0).start_thread()
    with StreamClient(pod.socket_dir, 0) as client:
        control = client._control
        wait_for(lambda: control.filled() == 2,
                 what="two prefetched batches", interval=0.05)
        import time
        time.sleep(0.5)
        assert control.filled() == 2
        assert control.num_slots == 2
        next(iter(client))
        assert sum(1 for _ in client) == 19


def test_one_sidecar_serves_every_gpu_of_its_pod(pods, table_uri):
    coordinator = coordinator_address()
    pods("pod0", manifest(table_uri), replicas=2, replica=0, gpus=2, coordinator=coordinator).start_thread()
    pod = pods("pod1", manifest(table_uri), replicas=2, replica=1, gpus=2, coordinator=coordinator).start_thread()
    for local_rank in (0, 1):
        rank = 2 + local_rank
        with StreamClient(pod.socket_dir, local_rank) as client:
            assert client.rank == rank and client.world_size == 4
            assert [ids(b) for b in client] == reference_batches(table_uri, {}, 4, rank)


# Oversized frames, deep nesting, huge numbers and peers that never read: test_hardening.py.
GARBAGE = [
    pytest.param([b"\x00\xff garbage"], "not JSON", id="bytes"),
    pytest.param([b'{"v": 1, "type": "hello", "local_rank": "0", "pid": 1, "next_step": null}'],
                 "must be int", id="ill-typed"),
    # Another protocol version (an int) is refused fatally, in the sender's version: test_versions.py.
    pytest.param([b'{"v": "1", "type": "hello"}'], "protocol version", id="version"),
    pytest.param([b'{"v": 1, "type": "ready", "global_step": 0}'], "does not send", id="wrong-direction"),
    pytest.param([b'{"v": 1, "type": "checkpoint", "step": 3}'], "say hello first", id="out-of-order"),
    pytest.param([b'{"v": 1, "type": "hello", "local_rank": 7, "pid": 1, "next_step": null}'],
                 "not served here", id="bad-rank"),
    pytest.param([b"a", b"b"], "expected 1 frame", id="multipart"),
]


@pytest.mark.parametrize("frames,words", GARBAGE)
def test_garbage_gets_an_error_reply_and_the_sidecar_keeps_serving(pods, table_uri, frames, words):
    pod = pods("pod", manifest(table_uri), replicas=1, replica=0).start_thread()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{pod.socket_dir / messages.SOCKET_NAME}")
    try:
        sock.send_multipart(frames)
        assert sock.poll(10_000), "no reply to a malformed message"
        reply = messages.decode(sock.recv())
        assert isinstance(reply, messages.Error) and not reply.fatal
        assert words in reply.message
    finally:
        sock.close()
    with StreamClient(pod.socket_dir, 0) as client:
        assert [ids(b) for b in client] == reference_batches(table_uri, {}, 1, 0)


def test_a_checkpoint_before_hello_is_answered_not_welcomed(pods, table_uri):
    """What a trainer hears from a sidecar that restarted and does not know it yet: the code
    that makes its client say hello again and ask once more (Checkpoints._request)."""
    pod = pods("pod", manifest(table_uri), replicas=1, replica=0).start_thread()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{pod.socket_dir / messages.SOCKET_NAME}")
    try:
        sock.send(messages.Checkpoint(step=3).encode())
        assert sock.poll(10_000), "no reply to a checkpoint before hello"
        reply = messages.decode(sock.recv())
        assert isinstance(reply, messages.Error) and reply.code == messages.NOT_WELCOMED and not reply.fatal
    finally:
        sock.close()


def test_numpy_columns_without_torch(pods, table_uri):
    pod = pods("pod", manifest(table_uri), replicas=1, replica=0).start_thread()
    with StreamClient(pod.socket_dir, 0, as_tensors=False) as client:
        batch = next(iter(client))
        assert isinstance(batch["vec"], np.ndarray) and batch["vec"].flags.writeable
        assert batch["label"].dtype == np.int32


def test_a_dictionary_encoded_column_reaches_the_trainer_as_its_values(pods, tmp_path):
    """A categorical column (pandas' category, Arrow's dictionary) is a column lance keeps
    as it is: the trainer gets its values, row for row, for the reference batches."""
    import lancedb
    import pyarrow as pa

    uri = str(tmp_path / "db")
    names = np.array(["cat", "dog", "owl"])
    ids_ = np.arange(200, dtype=np.int64)
    lancedb.connect(uri).create_table("frames", pa.table({
        "id": pa.array(ids_), "label": pa.array((ids_ % 5).astype(np.int32)),
        "kind": pa.array(names[ids_ % 3]).dictionary_encode()}))
    pod = pods("pod", manifest(uri), replicas=1, replica=0).start_thread()
    expected = reference_batches(uri, {}, 1, 0)
    with StreamClient(pod.socket_dir, 0, as_tensors=False) as client:
        got = [(batch["id"].tolist(), list(batch["kind"])) for batch in client]
    assert [ids_ for ids_, _ in got] == expected
    assert all(kinds == [names[i % 3] for i in batch_ids] for batch_ids, kinds in got)
    assert pod.wait() == 0
