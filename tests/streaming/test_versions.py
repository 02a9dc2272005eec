"""A trainer and a sidecar of different splitfeed versions: one clear error, or a plain welcome.

Real sidecars and real ZeroMQ. A trainer of another wire protocol version is a real
StreamClient whose `messages.PROTOCOL_VERSION` is patched (every frame it sends and
expects says that version), or a raw DEALER sending such a hello. Before, each refused
reply cost the trainer a log line and another hello: 20,118 lines in 6 s, then a
SidecarUnavailable that blamed a sidecar that had answered every time. The bound on time
is the client's own: a mismatch not detected would end in SidecarUnavailable after
`timeout_s` instead of the VersionMismatch asserted here.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
import zmq

from splitfeed.trainer_client.contract import errors, messages, versions
from splitfeed.trainer_client.script.client import StreamClient
from tests.streaming.harness import manifest, reference_batches

OURS = versions.package_version()
TODAYS_HELLO = b'{"v":1,"type":"hello","local_rank":0,"pid":1,"next_step":null}'
"""The hello of a splitfeed whose hello did not say its version yet (the same protocol, 1)."""
TODAYS_WELCOME_FIELDS = {"v", "type", "instance", "rank", "world_size", "ctl", "resume_step", "next_step",
                         "total_steps", "steps_per_epoch"}
"""Every field such a trainer's decode accepts in a welcome: any other and it refuses the welcome."""


def dealer(socket_dir: Path) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{socket_dir / messages.SOCKET_NAME}")
    return sock


def ask(sock: zmq.Socket, frame: bytes) -> dict:
    sock.send(frame)
    assert sock.poll(30_000), f"no answer to {frame!r}"
    answer = json.loads(sock.recv())
    assert isinstance(answer, dict)
    return answer


def log_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_a_trainer_of_another_protocol_version_is_refused_at_once_with_both_versions(
        pods, table_uri, caplog, monkeypatch):
    pod = pods("pod", manifest(table_uri), replicas=1, replica=0).start_process()
    sidecar_log = pod.dir / "sidecar.log"
    caplog.set_level(logging.DEBUG, logger="splitfeed")
    with monkeypatch.context() as patch:
        patch.setattr(messages, "PROTOCOL_VERSION", 2)
        with pytest.raises(errors.VersionMismatch) as refused:
            StreamClient(pod.socket_dir, 0, timeout_s=60, heartbeat_s=0.2)
    text = str(refused.value)
    assert "the trainer speaks wire protocol 2" in text and "its sidecar speaks wire protocol 1" in text, text
    assert f"splitfeed {OURS}" in text and "same splitfeed version in the trainer image" in text, text
    assert len(caplog.records) < 5, [r.getMessage() for r in caplog.records]
    before = len(log_lines(sidecar_log))
    # A trainer of protocol 2 that says hello, as a raw socket: the answer is in its own version.
    sock = dealer(pod.socket_dir)
    try:
        answer = ask(sock, b'{"v":2,"type":"hello","local_rank":0,"pid":1,"next_step":null,"package":"9.9.9"}')
    finally:
        sock.close()
    assert answer["v"] == 2 and answer["type"] == "error" and answer["fatal"] is True, answer
    assert answer["code"] == messages.VERSION_MISMATCH
    assert "wire protocol 2 (splitfeed 9.9.9)" in answer["message"], answer
    assert f"wire protocol 1 (splitfeed {OURS})" in answer["message"], answer
    # The sidecar said so in one line (the raw hello's line may still be on its way).
    refusals = [line for line in log_lines(sidecar_log)[before - 1:] if "is refused" in line]
    assert 1 <= len(refusals) <= 2 and len(log_lines(sidecar_log)) - before < 5, log_lines(sidecar_log)
    # Neither refusal harmed the sidecar: a trainer of its version gets lancedb's batches.
    with StreamClient(pod.socket_dir, 0, timeout_s=60, as_tensors=False) as client:
        assert [batch["id"].tolist() for batch in client] == reference_batches(table_uri, {}, 1, 0)
    assert pod.wait() == 0


def test_a_hello_that_says_no_version_gets_the_welcome_its_splitfeed_reads(pods, table_uri):
    """The same protocol version: served, and its welcome holds no field it would refuse."""
    pod = pods("pod", manifest(table_uri), replicas=1, replica=0).start_thread()
    sock = dealer(pod.socket_dir)
    try:
        plain = ask(sock, TODAYS_HELLO)
        assert plain["type"] == "welcome" and set(plain) == TODAYS_WELCOME_FIELDS, plain
        said = ask(sock, messages.Hello(local_rank=0, pid=1, next_step=None, package=OURS).encode())
        assert said["type"] == "welcome" and said["package"] == OURS, said
    finally:
        sock.close()
    pod.stop()


class OlderSidecar:
    """A ROUTER that answers every frame as a sidecar of splitfeed before this change did: its
    decode refuses the hello's `package` field, and any frame of a protocol version not 1.
    Its frames were taken from that version's real sidecar (same text, same fields)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"ipc://{directory / messages.SOCKET_NAME}")
        self.heard = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            peer, frame = self.sock.recv_multipart()
            self.heard += 1
            hello = json.loads(frame)
            text = ("hello message has unknown fields ['package']" if hello.get("v") == 1 else
                    f"protocol version {hello.get('v')!r} is not 1; run the same splitfeed version "
                    "in the trainer and the sidecar")
            reply = {"v": 1, "type": "error", "code": "protocol", "message": text, "fatal": False}
            self.sock.send_multipart([peer, json.dumps(reply, separators=(",", ":")).encode()])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.mark.parametrize("protocol", [1, 2], ids=["same-protocol", "newer-protocol"])
def test_an_older_sidecar_that_refuses_the_hello_ends_the_handshake_in_one_error(
        socket_root, caplog, monkeypatch, protocol):
    directory = socket_root / "sock"
    older = OlderSidecar(directory)
    caplog.set_level(logging.DEBUG, logger="splitfeed")
    try:
        with monkeypatch.context() as patch:
            patch.setattr(messages, "PROTOCOL_VERSION", protocol)
            with pytest.raises(errors.VersionMismatch) as refused:
                StreamClient(directory, 0, timeout_s=60, heartbeat_s=0.2)
    finally:
        older.close()
    text = str(refused.value)
    assert f"splitfeed {OURS}" in text and "same splitfeed version in the trainer image" in text, text
    if protocol == 1:
        assert "older than this trainer's" in text, text
    else:
        assert "trainer speaks wire protocol 2" in text and "sidecar speaks wire protocol 1" in text, text
    assert older.heard == 1, f"{older.heard} hellos: the trainer said hello again after the refusal"
    assert len(caplog.records) < 5, [r.getMessage() for r in caplog.records]
