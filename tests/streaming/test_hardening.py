"""The data plane as a cluster component: hostile peers, a full memory volume, memory order.

Real sidecars and real ZeroMQ; expected batches from lancedb's StreamingDataset
(reference_batches) or from the synthetic sidecar's own pattern (ring_sidecar.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import lancedb
import numpy as np
import pyarrow as pa
import pytest
import zmq

from splitfeed.sidecar.serving import service
from splitfeed.trainer_client import SidecarFailed, UserError
from splitfeed.trainer_client.contract import messages
from splitfeed.trainer_client.transport import ring, slots
from splitfeed.trainer_client.script.client import StreamClient

from tests.streaming.harness import manifest, reference_batches
from tests.streaming.ring_sidecar import pattern, size_of
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


def ids(batch) -> list[int]:
    return batch["id"].tolist()


def dealer(socket_dir: Path, **options: int) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(f"ipc://{socket_dir / messages.SOCKET_NAME}")
    return sock


# -- 1. protocol: hostile frames ------------------------------------------------------------

HOSTILE = [
    (b"[" * 60_000, "RecursionError"),
    (b'{"v":1,"type":"hello","local_rank":' + b"7" * 5_000 + b',"pid":1,"next_step":null}', "ValueError"),
    (b'{"v":1,"type":"checkpoint","step":' + b"[" * 900 + b"]" * 900 + b"}", "must be int"),
    (b'{"v":1,"type":"checkpoint","step":' + b"9" * 40 + b"}", "int64 range"),
    (b'{"v":1e999,"type":"hello"}', "protocol version"),
]


def test_hostile_frames_get_error_replies_and_the_trainer_still_gets_its_reference_batches(pods, table_uri):
    pod = pods("pod", manifest(table_uri), replicas=1, replica=0).start_thread()
    sock = dealer(pod.socket_dir)
    try:
        for frame, words in HOSTILE:
            sock.send(frame)
            assert sock.poll(10_000), f"no reply to {frame[:40]!r}..."
            reply = messages.decode(sock.recv())
            assert isinstance(reply, messages.Error) and not reply.fatal, reply
            assert words in reply.message, reply
        # Over MAX_MESSAGE_BYTES: ZeroMQ drops the frame (and the connection) before
        # buffering it, so there is no reply; the sidecar serves on.
        sock.send(b"x" * (4 << 20))
        assert not sock.poll(1_000), "a frame over MAXMSGSIZE reached the sidecar"
    finally:
        sock.close()
    # A peer that sends and never reads: its replies fill its queue and are dropped;
    # the sidecar never waits for it (a blocking send would stall every trainer).
    deaf = dealer(pod.socket_dir, RCVHWM=1, SNDHWM=100_000)
    try:
        sent = 0

        def send_all() -> bool:
            """Sends until the peer's queue is full (then wait_for waits) or 20,000 are sent."""
            nonlocal sent
            with contextlib.suppress(zmq.Again):
                while sent < 20_000:
                    deaf.send(b'{"v":1,"type":"wake"}', zmq.NOBLOCK)  # "say hello first": an error reply each
                    sent += 1
            return sent == 20_000

        wait_for(send_all, 60, "20,000 sends: the sidecar stopped reading, blocked on a peer that does not read",
                 interval=0.01)
        with StreamClient(pod.socket_dir, 0, timeout_s=30) as client:
            assert [ids(b) for b in client] == reference_batches(table_uri, {}, 1, 0)
    finally:
        deaf.close()
    assert pod.wait() == 0


def test_a_forked_sidecar_that_stops_right_after_its_last_reply_still_delivers_it(socket_root):
    """A drained sidecar exits right after its last `committed`; the reply must not die with it.

    ZeroMQ sends from its I/O thread: a sidecar that closes its socket without
    linger, or exits (os._exit, as forked sidecars do) before that thread sent
    the reply, loses it, and the trainer waits for its answer until it times
    out. Each of these sidecars answers one `hello` and exits at once.
    """
    count = 60
    proc = subprocess.Popen([sys.executable, "-m", "tests.streaming.last_answer_sidecar", str(socket_root),
                             str(count)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    lost = []
    try:
        for i in range(count):
            sock = dealer(socket_root / str(i))
            try:
                sock.send(messages.Hello(local_rank=0, pid=os.getpid(), next_step=None).encode())
                if not sock.poll(10_000):
                    lost.append(i)
                else:
                    assert isinstance(messages.decode(sock.recv()), messages.Welcome)
            finally:
                sock.close(linger=0)
            assert proc.stdout is not None and proc.stdout.readline().strip() == "0"
    finally:
        proc.kill()
        proc.communicate()
    assert not lost, f"{len(lost)} of {count} sidecars exited without delivering their last reply: {lost}"


# -- 2. memory: a volume too small for the ring -----------------------------------------------

@contextlib.contextmanager
def tmpfs(target: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` on `target`; skipped only where the mount syscall is refused."""
    target.mkdir(parents=True, exist_ok=True)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    if libc.mount(b"tmpfs", bytes(target), b"tmpfs", 0, f"size={size}".encode()) != 0:
        code = ctypes.get_errno()
        if code == errno.EPERM:
            pytest.skip(f"mount(2) of a tmpfs is refused here ({os.strerror(code)}): needs CAP_SYS_ADMIN")
        raise OSError(code, f"mount -t tmpfs -o size={size} tmpfs {target}: {os.strerror(code)}")
    try:
        yield target
    finally:
        libc.umount2(bytes(target), 2)  # MNT_DETACH: a process still inside cannot keep it busy


def big_table(uri: str) -> None:
    """96 rows of 64 KiB: batches of 16 rows are 1 MiB."""
    rows, dim = 96, 16 << 10
    vectors = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
    lancedb.connect(uri).create_table("big", pa.table({
        "id": pa.array(np.arange(rows), pa.int64()),
        "vec": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), dim),
    }))


def test_a_ring_that_cannot_fit_the_volume_is_a_clean_error_that_names_shm_size(pods, tmp_path):
    uri = str(tmp_path / "db")
    big_table(uri)
    pod = pods("pod", manifest(uri, table="big", numSplits=4, globalBatchSize=16), replicas=1, replica=0)
    with tmpfs(pod.socket_dir, "2m"):
        pod.start_process()
        with pytest.raises(SidecarFailed) as failed:
            with StreamClient(pod.socket_dir, 0, timeout_s=60) as client:
                next(iter(client))
        message = str(failed.value)
        assert "spec.sidecar.shmSize" in message and "needs 4 slots" in message, message
        code = pod.wait(60)
        assert code == 2, f"exit code {code} ({'SIGBUS' if code == -signal.SIGBUS else 'not 2'})"
        report = json.loads(pod.termination_log.read_text())
        assert "spec.sidecar.shmSize" in report["error"]


def ring_sidecar(directory: Path, mode: str, steps: int, prefetch: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.streaming.ring_sidecar", str(directory), mode,
                             str(steps), str(prefetch)], cwd=ROOT)


def test_a_slot_that_outgrows_the_volume_is_enospc_not_sigbus(socket_root):
    """The volume holds the ring at first, then a larger batch does not fit: posix_fallocate says so."""
    with tmpfs(socket_root / "shm", "2m") as volume:
        proc = ring_sidecar(volume, "grow", 10, 2)
        try:
            with pytest.raises(SidecarFailed, match="no space left for slot .*spec.sidecar.shmSize") as failed:
                with StreamClient(volume, 0, as_tensors=False, timeout_s=60) as client:
                    for step, batch in enumerate(client):
                        assert np.array_equal(batch["x"], pattern(step, size_of("grow", step)))
            assert step == 2 and "needs 4 slots" in str(failed.value)
            code = proc.wait(60)
            assert code == 2, f"exit code {code} ({'SIGBUS' if code == -signal.SIGBUS else 'not 2'})"
        finally:
            proc.kill()
            proc.wait()


def old_maps(instance: str) -> list[str]:
    """This process's mappings of files of sidecar instance `instance`."""
    return [line.split()[-2] if line.endswith("(deleted)") else line.split()[-1]
            for line in Path("/proc/self/maps").read_text().splitlines() if f"-{instance}-" in line]


def test_a_trainer_that_reconnects_unmaps_the_previous_sidecars_memory(pods, table_uri):
    pod = pods("pod", manifest(table_uri), replicas=1, replica=0).start_process()
    expected = reference_batches(table_uri, {}, 1, 0)
    with StreamClient(pod.socket_dir, 0, timeout_s=60) as client:
        it = iter(client)
        held = next(it)  # a batch of the first sidecar, kept across the restart
        got = [ids(held)] + [ids(next(it)) for _ in range(3)]
        first = client._instance
        assert old_maps(first)
        pod.kill()
        pod.start_process()
        got += [ids(b) for b in it]
        assert client._instance != first
        # Only the held batch's slot (and the control block its release needs) stay mapped.
        assert {Path(p).name.split("-")[0] for p in old_maps(first)} <= {"slot", "ctl"}
        assert len([p for p in old_maps(first) if "/slot-" in p]) <= 1, old_maps(first)
        assert ids(held) == expected[0]
        del held
        gc.collect()
        assert old_maps(first) == [], "the previous sidecar's files are still mapped"
    assert got == expected
    assert pod.wait() == 0


# -- 3. memory order -------------------------------------------------------------------------

def test_thousands_of_batches_of_every_size_cross_processes_intact(socket_root):
    """A sidecar process and this trainer process; every byte of every batch is checked."""
    steps = 3000
    proc = ring_sidecar(socket_root, "stress", steps, 2)
    try:
        held: list = []
        with StreamClient(socket_root, 0, as_tensors=False, timeout_s=60) as client:
            for step, batch in enumerate(client):
                assert batch.global_step == step
                x = batch["x"]
                assert np.array_equal(x, pattern(step, size_of("stress", step))), f"step {step} differs"
                if step % 97 == 0:  # hold some: the ring grows and slots are freed out of order
                    held.append(batch)
                if len(held) > 5:
                    held.pop(0)
            assert step == steps - 1
            for batch in held:  # held batches never changed
                assert np.array_equal(batch["x"], pattern(batch.global_step, size_of("stress", batch.global_step)))
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait()


ROWS = 8


def plain(step: int) -> pa.RecordBatch:
    return pa.record_batch({"id": pa.array(np.arange(step * ROWS, (step + 1) * ROWS))})


@pytest.fixture
def serve(socket_root):
    """An in-process sidecar serving `plain` batches; yields a starter."""
    started = []

    def start(total_steps: int) -> service.Server:
        server = service.Server(directory=socket_root, ranks=[0], world_size=1,
                                factory=lambda rank, first: ((s, plain(s)) for s in range(first, total_steps)),
                                steps_per_epoch=total_steps, total_steps=total_steps, start_step=0,
                                resume_step=0, prefetch=2)
        server.end_linger_s = 0.0
        thread = threading.Thread(target=lambda: (server.run(), server.close()), daemon=True)
        thread.start()
        started.append((server, thread))
        return server

    yield start
    for server, thread in started:
        server.stopping.set()
        thread.join(10)


def test_a_slot_marked_filled_before_its_payload_is_written_is_not_handed_out_until_it_is(
        serve, socket_root, monkeypatch):
    """A deliberately torn write: FILLED first, the payload and its trailer 30 ms later."""

    def torn_publish(self, global_step: int, batch: pa.RecordBatch, stop: threading.Event) -> bool:
        index = self._room(slots.ipc_size(batch), stop)
        if index is None or not self._through_gate(global_step, stop):
            return False
        self._writes += 1
        slot, seq, control = self.slots[index], self._writes, self.control
        stream = pa.BufferOutputStream()
        with pa.ipc.new_stream(stream, batch.schema) as writer:
            writer.write_batch(batch)
        blob = np.frombuffer(stream.getvalue(), np.uint8)
        slot.mark_header(global_step, seq)
        control.step[index], control.nbytes[index], control.seq[index] = global_step, len(blob), seq
        control.posted[global_step % ring.MAX_SLOTS] = index
        assert control.transition(index, ring.SlotState.FREE, ring.SlotState.FILLED)  # too early
        time.sleep(0.03)
        slot.payload[:len(blob)] = blob
        slot.mark_trailer(len(blob), global_step, seq)
        return True

    monkeypatch.setattr(service.Publisher, "_publish", torn_publish)
    serve(total_steps=12)
    with StreamClient(socket_root, 0, as_tensors=False, timeout_s=30) as client:
        got = [ids(b) for b in client]
        assert client.torn_retries > 0, "the trainer never saw a torn slot"
    assert got == [plain(s).column("id").to_pylist() for s in range(12)]


@pytest.mark.parametrize("mark", ["mark_header", "mark_trailer"])
def test_a_slot_whose_sequence_is_wrong_is_never_handed_out(serve, socket_root, monkeypatch, mark):
    """Step 3's slot carries a sequence number its write does not have (a stray or stale write)."""
    original = getattr(slots.SlotFile, mark)

    def wrong(self, *args: int) -> None:
        *rest, step, seq = args
        original(self, *rest, step, seq + 1000 if step == 3 else seq)

    monkeypatch.setattr(slots.SlotFile, mark, wrong)
    serve(total_steps=6)
    with StreamClient(socket_root, 0, as_tensors=False, timeout_s=4, heartbeat_s=0.2) as client:
        it = iter(client)
        assert [ids(next(it)) for _ in range(3)] == [plain(s).column("id").to_pylist() for s in range(3)]
        with pytest.raises(SidecarFailed, match="global step 3 in slot .* stayed torn"):
            next(it)
        assert client.torn_retries > 0


def test_a_waiting_trainer_is_woken_by_the_batch_not_by_its_heartbeat(serve, socket_root, monkeypatch):
    """No spin, a 30 s heartbeat, no look every slice: each of 300 batches that lands while the trainer sleeps must wake it."""
    from splitfeed.trainer_client.script import client as client_module

    monkeypatch.setattr(client_module, "SPIN_S", 0.0)
    monkeypatch.setattr(client_module, "WAIT_SLICE_S", 60.0)
    release = threading.Semaphore(0)

    def paced(rank: int, first: int):
        for step in range(first, 300):
            release.acquire()
            yield step, plain(step)

    server = service.Server(directory=socket_root, ranks=[0], world_size=1, factory=paced, steps_per_epoch=300,
                            total_steps=300, start_step=0, resume_step=0, prefetch=2)
    server.end_linger_s = 0.0
    thread = threading.Thread(target=lambda: (server.run(), server.close()), daemon=True)
    thread.start()
    try:
        with StreamClient(socket_root, 0, as_tensors=False, timeout_s=30, heartbeat_s=30) as client:
            it = iter(client)
            slowest = 0.0
            for step in range(300):
                # Let the publisher go once the trainer is (about to be) asleep: the race window.
                threading.Timer(0.0005 * (step % 3), release.release).start()
                started = time.monotonic()
                assert next(it).global_step == step
                slowest = max(slowest, time.monotonic() - started)
        assert slowest < 20, f"a wake-up was lost: a batch waited {slowest:.1f} s"
    finally:
        server.stopping.set()
        thread.join(10)


def test_a_volume_without_room_for_the_control_block_is_a_user_error(socket_root):
    with tmpfs(socket_root / "shm", "4k") as volume:
        (volume / "ballast").write_bytes(b"x" * 4096)
        with pytest.raises(UserError, match="control block of local rank 0 .* spec.sidecar.shmSize"):
            service.Publisher(directory=volume, instance="i", local_rank=0, rank=0, factory=lambda r, f: iter(()),
                              prefetch=2, start_step=0, total_steps=1)


def test_a_restarted_sidecar_knows_which_trainers_took_every_batch_from_its_predecessor(tmp_path):
    """A sidecar SIGKILLed after its trainer took the job's last batch leaves its control block
    in the emptyDir; the restarted one must not wait for that trainer's hello for ever."""
    from splitfeed.sidecar.serving import service
    from splitfeed.trainer_client.transport import ring

    done = ring.Control(ring.control_path(tmp_path, "old", 0), create=True)
    done.end_step, done.acked = 40, 39
    midway = ring.Control(ring.control_path(tmp_path, "old", 1), create=True)
    midway.end_step, midway.acked = 40, 12
    (tmp_path / "ctl-torn-r2").write_bytes(b"not a control block")
    try:
        assert service.served_out(tmp_path) == {0}
    finally:
        done.close()
        midway.close()
    assert service.served_out(tmp_path / "absent") == set()
