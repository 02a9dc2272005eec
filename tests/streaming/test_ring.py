"""The ring's flow control with an in-process sidecar: who waits for what, and who wakes whom.

The sidecar's publishing thread writes batches straight into slots; these tests
drive it with a trivial in-memory factory so that every wait is deliberate.
"""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pyarrow as pa
import pytest

from splitfeed.sidecar.serving import service
from splitfeed.trainer_client.contract import messages
from splitfeed.trainer_client.transport import ring
from splitfeed.trainer_client.script.client import StreamClient

from tests.support.waiting import wait_for

ROWS = 8


def factory(rank: int, first: int):
    def batches():
        for step in range(first, 1_000_000):
            yield step, pa.record_batch({"id": pa.array(np.arange(step * ROWS, (step + 1) * ROWS))})
    return batches()


@pytest.fixture
def serve(socket_root):
    started = []

    def start(total_steps: int, prefetch: int, source=factory) -> service.Server:
        server = service.Server(directory=socket_root, ranks=[0], world_size=1, factory=source,
                                steps_per_epoch=total_steps, total_steps=total_steps, start_step=0,
                                resume_step=0, prefetch=prefetch)
        server.end_linger_s = 0.0
        thread = threading.Thread(target=lambda: (server.run(), server.close()), daemon=True)
        thread.start()
        started.append((server, thread))
        return server

    yield start
    for server, thread in started:
        server.stopping.set()
        thread.join(10)
        assert not thread.is_alive()


def ids(batch) -> list[int]:
    return [int(x) for x in batch["id"]]


def test_every_slot_held_makes_the_sidecar_wait_for_a_slot_and_a_release_wakes_it(serve, socket_root,
                                                                                monkeypatch):
    from splitfeed.trainer_client.transport import slots

    monkeypatch.setattr(ring, "MAX_SLOTS", 3)  # both sides are in this process
    monkeypatch.setattr(slots, "ROOM_RECHECK_S", 60.0)  # only the trainer's futex wake ends the wait in time
    serve(total_steps=6, prefetch=2)
    with StreamClient(socket_root, 0, as_tensors=False, timeout_s=30) as client:
        it = iter(client)
        held = [next(it) for _ in range(3)]  # every slot the ring may have
        control = client._control
        wait_for(lambda: control.sidecar_waiting & ring.Waiting.KIND == ring.Waiting.SLOT,
                 what="the sidecar to wait for a slot", interval=0.05)
        assert control.num_slots == 3 and control.filled() == 0
        first = ids(held.pop(0))
        assert first == list(range(0, ROWS))
        rest = []
        while (batch := next(it, None)) is not None:  # the drop above freed a slot: wakes the sidecar
            rest.append(ids(batch))
            del batch  # a loop variable would keep a slot until the next batch is in hand
    got = [first] + [ids(b) for b in held] + rest
    assert got == [list(range(s * ROWS, (s + 1) * ROWS)) for s in range(6)]


def test_holding_every_slot_while_asking_for_more_is_a_clear_error(serve, socket_root, monkeypatch):
    from splitfeed.trainer_client import SidecarUnavailable

    monkeypatch.setattr(ring, "MAX_SLOTS", 3)
    serve(total_steps=6, prefetch=2)
    with StreamClient(socket_root, 0, as_tensors=False, timeout_s=1.5, heartbeat_s=0.2) as client:
        held = [next(client) for _ in range(3)]
        with pytest.raises(SidecarUnavailable, match="references 3 earlier batches, every slot"):
            next(client)
        assert [ids(b)[0] for b in held] == [0, ROWS, 2 * ROWS]


def test_a_full_ring_makes_the_sidecar_wait_for_room_and_taking_half_wakes_it(serve, socket_root, monkeypatch):
    from splitfeed.trainer_client.transport import slots

    # No periodic re-check: only the trainer's futex wake can end the sidecar's waits in time.
    monkeypatch.setattr(slots, "ROOM_RECHECK_S", 60.0)
    serve(total_steps=40, prefetch=4)
    with StreamClient(socket_root, 0, as_tensors=False, timeout_s=30) as client:
        control = client._control
        wait_for(lambda: control.sidecar_waiting & ring.Waiting.KIND == ring.Waiting.ROOM,
                 what="the sidecar to fill the ring", interval=0.05)
        assert control.filled() == 4
        time.sleep(0.05)
        assert control.filled() == 4  # never more than prefetch ahead
        got = [ids(b)[0] // ROWS for b in client]
    assert got == list(range(40))


def test_a_trainer_that_waits_is_told_when_its_batch_lands(serve, socket_root, monkeypatch):
    """No spinning, no look every slice: the trainer sleeps on `posts` and the sidecar's futex wake must wake it."""
    from splitfeed.trainer_client.script import client as client_module

    monkeypatch.setattr(client_module, "SPIN_S", 0.0)
    monkeypatch.setattr(client_module, "WAIT_SLICE_S", 60.0)
    gate = threading.Event()

    def slow(rank: int, first: int):
        for step in range(first, 3):
            gate.wait(10)
            yield step, pa.record_batch({"id": pa.array(np.arange(step * ROWS, (step + 1) * ROWS))})

    serve(total_steps=3, prefetch=2, source=slow)
    with StreamClient(socket_root, 0, as_tensors=False, timeout_s=30, heartbeat_s=30) as client:
        threading.Timer(0.3, gate.set).start()
        started = time.monotonic()
        got = [ids(b)[0] // ROWS for b in client]
        # heartbeat_s=30, WAIT_SLICE_S=60: only the sidecar's wake can have woken it this soon
        assert time.monotonic() - started < 10
    assert got == [0, 1, 2]


def test_a_wake_with_no_batch_and_no_message_leaves_the_next_batch_its_own_wake(serve, socket_root, monkeypatch):
    """A bump of `posts` can come after what it announced was taken: `_send` bumps after its
    message, which the trainer may have read already (here the welcome's bump lands 0.2 s
    late, while the trainer sleeps for batch 0), and `post` bumps after FILLED. Such a wake
    brings no batch and no message; the batch that lands later must still wake the trainer
    (it used to wait on its socket for the rest of the slice, and the sidecar wakes once
    per `trainer_waiting` value: the timeout, 30 s, under load)."""
    from splitfeed.trainer_client.script import client as client_module

    monkeypatch.setattr(client_module, "SPIN_S", 0.0)
    monkeypatch.setattr(client_module, "WAIT_SLICE_S", 60.0)
    monkeypatch.setattr(client_module, "AFTER_BARE_WAKE_SLICE_S", 60.0)  # only wakes may wake it
    send = service.Server._send

    def bump_late(self, peer: bytes, message) -> None:
        if not isinstance(message, messages.Welcome):
            return send(self, peer, message)
        self.sock.send_multipart([peer, message.encode()])  # the welcome now, its bump and wake later
        controls = [feed.control for feed in self.feeds]

        def bump() -> None:
            for control in controls:
                with contextlib.suppress(ValueError):  # closed: the test is over
                    control.bump(ring.POSTS)
                    control.wake(ring.POSTS)
        threading.Timer(0.2, bump).start()

    monkeypatch.setattr(service.Server, "_send", bump_late)
    gate = threading.Event()

    def slow(rank: int, first: int):
        for step in range(first, 3):
            gate.wait(10)
            yield step, pa.record_batch({"id": pa.array(np.arange(step * ROWS, (step + 1) * ROWS))})

    serve(total_steps=3, prefetch=2, source=slow)
    with StreamClient(socket_root, 0, as_tensors=False, timeout_s=30, heartbeat_s=30) as client:
        threading.Timer(0.6, gate.set).start()
        started = time.monotonic()
        got = [ids(b)[0] // ROWS for b in client]
        assert time.monotonic() - started < 10
    assert got == [0, 1, 2]


def hears_the_failure_of_its_second_batch_at_once(serve, socket_root, monkeypatch) -> None:
    """A trainer asleep for batch 1, with its periodic looks at the socket made 60 s and
    its heartbeats 30 s: the sidecar's failure must reach it within 10 s all the same."""
    from splitfeed.trainer_client.script import client as client_module
    from splitfeed.trainer_client.contract.errors import SidecarFailed

    monkeypatch.setattr(client_module, "SPIN_S", 0.0)
    monkeypatch.setattr(client_module, "WAIT_SLICE_S", 60.0)
    gate = threading.Event()

    def failing(rank: int, first: int):
        yield first, pa.record_batch({"id": pa.array(np.arange(first * ROWS, (first + 1) * ROWS))})
        gate.wait(10)
        raise OSError("the table's storage went away")

    serve(total_steps=3, prefetch=2, source=failing)
    with StreamClient(socket_root, 0, as_tensors=False, timeout_s=30, heartbeat_s=30) as client:
        batches = iter(client)
        assert ids(next(batches)) == list(range(ROWS))
        threading.Timer(0.3, gate.set).start()
        started = time.monotonic()
        with pytest.raises(SidecarFailed, match="storage went away"):
            next(batches)
        assert time.monotonic() - started < 10


def test_a_sleeping_trainer_hears_of_a_failure_at_once(serve, socket_root, monkeypatch):
    """The sidecar wakes `posts` when it sends its trainer a message: the failure is not left
    for the trainer's next look at its socket."""
    hears_the_failure_of_its_second_batch_at_once(serve, socket_root, monkeypatch)


def test_a_wake_that_comes_before_its_message_still_delivers_the_message(serve, socket_root, monkeypatch):
    """ZeroMQ's I/O threads may hand the trainer the message after the futex woke it (seen
    under load: a trainer asleep for its whole slice). Here the sidecar's wake always
    comes first, its message 0.5 s later, with no second wake: the socket must deliver it."""

    def wake_then_send(self, peer: bytes, message) -> None:
        for feed in self.feeds:
            feed.control.bump(ring.POSTS)
            feed.control.wake(ring.POSTS)
        time.sleep(0.5)
        self.sock.send_multipart([peer, message.encode()])

    monkeypatch.setattr(service.Server, "_send", wake_then_send)
    hears_the_failure_of_its_second_batch_at_once(serve, socket_root, monkeypatch)


def mixed(step: int) -> pa.RecordBatch:
    """Every kind of column, with lengths that repeat (equal metadata) and change (new metadata)."""
    n = (3, 5, 3, 5, 1)[step % 5]
    base = step * 100
    floats = [float(base + i) if (base + i) % 3 else None for i in range(n)]
    return pa.record_batch({
        "id": pa.array(np.arange(base, base + n), pa.int64()),
        "maybe": pa.array(floats, pa.float32()),
        "name": pa.array([f"row-{base + i}" for i in range(n)]),
        "flag": pa.array([(base + i) % 2 == 0 for i in range(n)]),
        "vec": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(n * 4, dtype=np.float32) + base), 4),
        "tags": pa.array([[base + i] * (i % 3) for i in range(n)], pa.list_(pa.int64())),
    })


def test_every_column_type_arrives_intact_and_numeric_columns_are_writable_views(serve, socket_root):
    steps = 12

    def source(rank: int, first: int):
        return ((s, mixed(s)) for s in range(first, steps))

    serve(total_steps=steps, prefetch=2, source=source)
    with StreamClient(socket_root, 0, as_tensors=False, timeout_s=30) as client:
        for step, batch in enumerate(client):
            want = mixed(step)
            assert batch.global_step == step and batch.rows == want.num_rows
            for name in want.schema.names:
                got = batch[name]
                expected = want.column(name).to_numpy(zero_copy_only=False)
                if name in ("maybe", "tags"):  # nulls / lists: compared as Python values
                    assert pa.array(list(got) if name == "tags" else got,
                                    want.schema.field(name).type, from_pandas=True).to_pylist() \
                        == want.column(name).to_pylist(), name
                elif name == "vec":
                    assert np.array_equal(got, np.stack(expected)), name
                else:
                    assert list(got) == list(expected), name
            for name in ("id", "vec"):  # views of the slot: writable, not owning their memory
                assert batch[name].flags.writeable and not batch[name].flags.owndata
    assert step == steps - 1
