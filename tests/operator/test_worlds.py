"""The operator's fast drain path: a drain_request straight to a world's coordinator, over real ZeroMQ."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from splitfeed.operator.lifecycle import deciding
from splitfeed.operator.cluster import reconciling
from splitfeed.operator.objects import views
from splitfeed.trainer_client.transport import keys, worlds
from splitfeed.trainer_client.contract import messages
from tests.support.keys import session_keypair
from tests.support.waiting import wait_for


class Router:
    """A stand-in coordinator: a ROUTER that records requests and answers drain_ack (or nothing);
    a CURVE server with the session's job keypair, as a coordinator is."""

    def __init__(self, answer: str | None = "freezing", reply: bytes | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        keys.serve(self.sock, session_keypair())
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.answer, self.reply = answer, reply
        self.received: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            peer, frame = self.sock.recv_multipart()
            message = messages.DrainRequest.decode(frame)  # validated; recorded as it came
            self.received.append(json.loads(frame))
            if self.reply is not None:
                self.sock.send_multipart([peer, self.reply])
            elif self.answer is not None:
                self.sock.send_multipart([peer, messages.DrainAck(token=message.token, state=self.answer).encode()])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()
        self.ctx.term()


@pytest.fixture()
def router() -> Iterator[Router]:
    r = Router()
    yield r
    r.close()


def test_a_coordinator_that_answers_gets_the_request_and_its_state_comes_back(router):
    assert worlds.request_drain(router.address, "rescale-w3", "rescale") == "freezing"
    assert router.received == [{"v": messages.PROTOCOL_VERSION, "type": "drain_request",
                                "token": "rescale-w3", "reason": "rescale"}]


def test_asking_again_uses_a_fresh_socket_each_time(router):
    for _ in range(3):
        assert worlds.request_drain(router.address, "rescale-w3", "rescale") == "freezing"
    assert len(router.received) == 3


TIMEOUT_S = 1.5
"""Longer than request_drain's default (1 s): a call that waited at least this long used the
timeout it was given. A lower bound holds on a loaded machine; an upper one near it does not."""


def test_nothing_listening_is_none_within_the_timeout():
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as probe:
        port = probe.bind_to_random_port("tcp://127.0.0.1")
        probe.unbind(f"tcp://127.0.0.1:{port}")  # a port nobody holds now
    start = time.monotonic()
    assert worlds.request_drain(f"tcp://127.0.0.1:{port}", "rescale-w0", "rescale", timeout_s=TIMEOUT_S) is None
    assert TIMEOUT_S - 0.05 <= time.monotonic() - start < 30  # it returns, and only after its timeout


def test_a_coordinator_that_never_answers_is_none_within_the_timeout():
    silent = Router(answer=None)
    try:
        start = time.monotonic()
        assert worlds.request_drain(silent.address, "suspend-w1", "suspend", timeout_s=TIMEOUT_S) is None
        assert TIMEOUT_S - 0.05 <= time.monotonic() - start < 30
        # The stand-in's thread records what it read; nothing orders that before the caller's timeout.
        wait_for(lambda: silent.received, what="the request at the silent coordinator")
        assert [m["type"] for m in silent.received] == ["drain_request"]
    finally:
        silent.close()


@pytest.mark.parametrize("reply", [b"not json", messages.DrainAck(token="other", state="idle").encode()],
                         ids=["garbage", "other-token"])
def test_a_wrong_answer_is_none_not_an_exception(reply):
    odd = Router(reply=reply)
    try:
        assert worlds.request_drain(odd.address, "rescale-w0", "rescale", timeout_s=1.0) is None
    finally:
        odd.close()


class RecordingKube:
    """Only the calls `reconciling._apply` makes, in the order it makes them."""

    def __init__(self, router: Router) -> None:
        self.calls: list[str] = []
        self.router = router

    async def patch_job_status(self, namespace: str, name: str, patch: dict[str, Any],
                               resource_version: str | None = None) -> None:
        self.calls.append(f"status@{resource_version}")

    async def create(self, obj: dict[str, Any]) -> bool:
        self.calls.append("create")
        return True

    async def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        assert not self.router.received  # the annotation (the sure path) goes first
        self.calls.append(f"annotate {name}")

    async def delete_pod(self, namespace: str, name: str) -> bool:
        self.calls.append(f"delete {name}")
        return True

    async def job_keys(self, namespace: str, owner: Any, *, create: bool = False) -> keys.Keypair:
        return session_keypair()  # the job's Secret (tests/operator/test_kube_api.py reads a real one)


def test_the_reconciler_sends_a_decisions_notify_after_its_status_and_annotations(router):
    kube = RecordingKube(router)
    ctx = reconciling.Context(kube=kube, settings=None)  # type: ignore[arg-type]
    d = deciding.Decision(step="CheckpointRequested", status={"phase": "Rescaling"},
                           annotate={"resnet-w0-0": {"splitfeed.io/drain": "rescale-w0"}},
                           notify=(router.address, "rescale-w0", "rescale"))
    body = {"metadata": {"namespace": "ns", "name": "resnet", "resourceVersion": "41"}}
    asyncio.run(reconciling._apply(ctx, views.Job.parse(body), d, {}))
    assert kube.calls == ["status@41", "annotate resnet-w0-0"]
    # Recorded before the stand-in answers, but a loaded machine may keep its thread past the
    # caller's one-second wait for the answer (best effort by design): wait for the record.
    wait_for(lambda: router.received, what="the drain request at the coordinator")
    assert [(m["type"], m["token"], m["reason"]) for m in router.received] == [
        ("drain_request", "rescale-w0", "rescale")]
