"""The world's coordinator answers only the job: CURVE with the job's keypair (trainer_client.keys).

Real ZeroMQ sockets on TCP, no data. A peer with no key, and one with a keypair of its own,
send well-formed requests; neither gets an answer or changes the coordinator, each is counted
(splitfeed_coordinator_rejected_total) and logged, and the job's own key still works.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest
import zmq
from prometheus_client import generate_latest

from splitfeed.sidecar.world import agreement, wire
from splitfeed.sidecar import opening
from splitfeed.sidecar.world.settings import SidecarSettings
from splitfeed.sidecar.serving import metrics
from splitfeed.trainer_client.contract import wellknown, errors, messages
from splitfeed.trainer_client.transport import keys, worlds
from tests.support import ports
from tests.support.keys import session_keypair
from tests.support.waiting import wait_for

NO_ANSWER_S = 1.0
"""How long a rejected request waits: a coordinator that answers does so in milliseconds."""


def forged_ask(address: str, request: messages.Message, server_key: bytes | None = None) -> bytes | None:
    """A DEALER that any process able to reach the port could open: no CURVE at all, or (with
    `server_key`, the job's public key, which is no secret) a CURVE client with a keypair of its own."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        if server_key is not None:
            sock.curve_serverkey = server_key
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.connect(address)
        sock.send(request.encode())
        return sock.recv() if sock.poll(int(NO_ANSWER_S * 1000)) else None
    finally:
        sock.close(linger=0)


LABELS = {"job": "j", "namespace": "ns", "world": "0", "replica": "0"}


def coordinator_sample(thread: wire.CoordinatorThread, name: str, **labels: str) -> float | None:
    """One splitfeed_coordinator_* sample as /metrics serves it."""
    observed = metrics.SidecarMetrics(metrics.Labels(job="j", namespace="ns", world=0, replica=0),
                                      rejected=lambda: thread.rejected, traffic=thread.traffic.snapshot)
    assert name in generate_latest(observed.registry).decode()
    return observed.registry.get_sample_value(name, {**LABELS, **labels})


def rejected_series(thread: wire.CoordinatorThread) -> float:
    """splitfeed_coordinator_rejected_total as /metrics serves it."""
    found = coordinator_sample(thread, "splitfeed_coordinator_rejected_total")
    assert found is not None, "no splitfeed_coordinator_rejected_total series"
    return found


def test_only_the_jobs_keypair_gets_a_drain_request_through(caplog: pytest.LogCaptureFixture) -> None:
    job_keys = session_keypair()
    coordinator = agreement.Coordinator(replicas=2, total_steps=40, resume_step=0)
    coordinator.on_join(b"m0", 0)
    thread = wire.CoordinatorThread(coordinator, ports.tcp_address(), keys=job_keys)
    caplog.set_level(logging.WARNING, logger="splitfeed.sidecar.world.agreement")
    try:
        forged = messages.DrainRequest(token="forged", reason="rescale", replicas=1)
        assert forged_ask(thread.address, forged, server_key=job_keys.public) is None
        assert "rejected a peer at 127.0.0.1: its CURVE key is not the job's" in caplog.text
        assert forged_ask(thread.address, forged) is None
        lost = messages.DrainRequest(token="forged-lost", reason="replace", replicas=1, lost=[1])
        assert forged_ask(thread.address, lost, server_key=job_keys.public) is None
        assert forged_ask(thread.address, lost) is None
        assert worlds.request_drain(thread.address, "forged-2", "rescale", timeout_s=NO_ANSWER_S, replicas=1,
                                    keys=keys.generate()) is None  # another job's keypair
        assert coordinator.tokens == set() and coordinator.phase == agreement.IDLE
        assert coordinator.next_replicas == 0 and coordinator.lost is None
        wait_for(lambda: thread.rejected >= 5, 10, "the coordinator to count the rejected peers")
        assert rejected_series(thread) == thread.rejected

        assert worlds.request_drain(thread.address, "rescale-w0", "rescale", timeout_s=5,
                                    keys=job_keys) == agreement.WAITING_FOR_MEMBERS
        assert coordinator.tokens == {"rescale-w0"}
        # Only the job's request reached the coordinator's socket (splitfeed_coordinator_messages_total);
        # its answer is counted once sent, which may be just after the requester read it.
        total = "splitfeed_coordinator_messages_total"
        wait_for(lambda: coordinator_sample(thread, total, direction="sent", type="drain_ack") == 1, 5,
                 "the coordinator to count its answer")
        assert coordinator_sample(thread, total, direction="received", type="drain_request") == 1
        assert thread.traffic.snapshot()[0] == {("received", "drain_request"): 1, ("sent", "drain_ack"): 1}
        request = messages.DrainRequest(token="rescale-w0", reason="rescale").encode()
        assert coordinator_sample(thread, "splitfeed_coordinator_message_bytes_total",
                                  direction="received") == len(request)
    finally:
        thread.close()


def test_a_member_with_another_keypair_never_joins() -> None:
    """A forged member: its `join` would make it count in every drain."""
    coordinator = agreement.Coordinator(replicas=2, total_steps=40, resume_step=0)
    thread = wire.CoordinatorThread(coordinator, ports.tcp_address(), keys=session_keypair())
    member = wire.Member(thread.address, 1, "forged", keys=keys.generate())  # another job's keypair
    try:
        with pytest.raises(errors.UserError, match="no coordinator answered"):
            member.join(published=-1, timeout_s=1)
        assert coordinator.members == {}
        assert thread.rejected >= 1
    finally:
        member.close()
        thread.close()


def test_rejections_are_logged_at_most_once_a_minute() -> None:
    seen = wire.Rejections()
    assert seen.note("10.0.0.9:4000", "no key", now=100.0) == (
        "rejected a peer at 10.0.0.9:4000: no key; its messages are dropped")
    assert seen.note("10.0.0.9:4001", "no key", now=130.0) is None
    line = seen.note("10.0.0.7:4002", "no key", now=161.0)
    assert line is not None and "10.0.0.7:4002" in line and "2 rejections since the last such line" in line


def test_no_coordinator_or_request_without_the_jobs_keypair(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """No insecure default: a sidecar or a request without SPLITFEED_KEYS_DIR is refused by name."""
    settings = SidecarSettings(config=tmp_path / "c.json", socket_dir=tmp_path)
    with pytest.raises(errors.UserError, match=wellknown.KEYS_DIR_ENV):
        opening.job_keys(settings)
    monkeypatch.delenv(wellknown.KEYS_DIR_ENV)
    with pytest.raises(errors.UserError, match=f"{wellknown.KEYS_DIR_ENV} is not set"):
        worlds.request_drain("tcp://127.0.0.1:1", "rescale-w0", "rescale")
    (tmp_path / "keys").mkdir()
    with pytest.raises(errors.UserError, match="cannot read the job's keypair"):
        keys.load(tmp_path / "keys")
    other = keys.generate()
    keys.write(tmp_path / "keys", keys.Keypair(public=other.public, secret=keys.generate().secret))
    with pytest.raises(errors.UserError, match="is not the public key of"):
        keys.load(tmp_path / "keys")


def test_a_written_keypair_is_owner_only(tmp_path: Path) -> None:
    written = keys.create(tmp_path / "keys")
    assert (tmp_path / "keys").stat().st_mode & 0o777 == 0o700
    for name in (wellknown.KEY_PUBLIC, wellknown.KEY_SECRET):
        assert (tmp_path / "keys" / name).stat().st_mode & 0o777 == 0o600
    assert keys.load(tmp_path / "keys") == written
    assert written.secret.decode() not in repr(written)


class Recorder:
    """A TCP relay between one client and the coordinator that keeps what the client sent: what
    anyone on the network path (a node's other tenants, a mirrored port) can capture."""

    def __init__(self, upstream: str) -> None:
        import socket
        import threading

        host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
        self._upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent = bytearray()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import socket
        import threading

        client, _ = self.listener.accept()
        server = socket.create_connection(self._upstream)

        def pump(src: socket.socket, dst: socket.socket, keep: bytearray | None) -> None:
            with contextlib.suppress(OSError):
                while chunk := src.recv(65536):
                    if keep is not None:
                        keep.extend(chunk)
                    dst.sendall(chunk)
                dst.shutdown(socket.SHUT_WR)

        back = threading.Thread(target=pump, args=(server, client, None), daemon=True)
        back.start()
        try:
            pump(client, server, self.sent)
        except OSError:
            pass
        back.join(5)
        for sock in (client, server, self.listener):
            sock.close()


def test_a_captured_request_replayed_to_the_coordinator_changes_nothing() -> None:
    """CURVE's handshake binds a connection to a cookie of the server's, fresh each time: the
    bytes of a genuine drain request, sent again on a new connection, are refused at INITIATE."""
    import socket

    job_keys = session_keypair()
    genuine = agreement.Coordinator(replicas=2, total_steps=40, resume_step=0)
    genuine.on_join(b"m0", 0)
    first = wire.CoordinatorThread(genuine, ports.tcp_address(), keys=job_keys)
    fresh = agreement.Coordinator(replicas=2, total_steps=40, resume_step=0)
    fresh.on_join(b"m0", 0)
    second = wire.CoordinatorThread(fresh, ports.tcp_address(), keys=job_keys)
    try:
        relay = Recorder(first.address)
        assert worlds.request_drain(relay.address, "rescale-w0", "rescale", timeout_s=5, replicas=1,
                                    keys=job_keys) == agreement.WAITING_FOR_MEMBERS
        assert genuine.tokens == {"rescale-w0"}
        wait_for(lambda: b"rescale-w0" not in relay.sent and len(relay.sent) > 200, 5, "the captured bytes")
        host, port = second.address.removeprefix("tcp://").rsplit(":", 1)
        for replay in range(3):
            with socket.create_connection((host, int(port)), timeout=NO_ANSWER_S) as raw:
                raw.sendall(bytes(relay.sent))
                received = bytearray()
                try:
                    while chunk := raw.recv(65536):
                        received.extend(chunk)
                except TimeoutError:
                    pass
            assert b"drain_ack" not in received  # encrypted or not, no answer of the coordinator's
        assert fresh.tokens == set() and fresh.phase == agreement.IDLE and fresh.next_replicas == 0
        assert worlds.request_drain(second.address, "rescale-w1", "rescale", timeout_s=5, replicas=1,
                                    keys=job_keys) == agreement.WAITING_FOR_MEMBERS  # the job's own still works
        assert fresh.tokens == {"rescale-w1"}
    finally:
        first.close()
        second.close()
