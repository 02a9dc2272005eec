"""Replica 0's sidecar, the world's coordinator, SIGKILLed and restarted under running trainers.

The native sidecar container is restarted in place by the kubelet (an OOM kill, say): its
trainer says `hello` with the next step it expects, its peers' sidecars keep serving, and the
world must go on exactly (docs/agreement.md, "Failure cases"). Replica 0's sidecar runs as a
process (killed by PID), the others as threads of this process; the trainers are threads held
in step by a barrier (the all-reduce of a synchronous trainer). References: lancedb's
StreamingDataset in-process (`reference_batches`, tests/support/skipping.py's `expected_steps`).
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Any

import pytest
import zmq

from splitfeed.sidecar.world import agreement, wire
from splitfeed.trainer_client.contract import messages
from splitfeed.trainer_client.script.client import StreamClient
from splitfeed.trainer_client.transport.worlds import request_drain

from tests.streaming.harness import coordinator_address, manifest, reference_batches
from tests.support.keys import session_keypair
from tests.support.skipping import G, expected_steps, job, lancedb_ids, lockstep
from tests.support.waiting import wait_for

KILL_AT = 5
"""The global step after which replica 0's sidecar is killed: mid-epoch 0, the look-ahead full."""
STEP_S = 0.05
"""A drain asked of a restarted coordinator waits for its members to rejoin; trainers that
took no time at all ran the 32 steps left in 90 ms and the world ended before that."""


def test_a_restarted_coordinator_learns_every_reach_and_end_its_members_reported_before():
    """Real ZeroMQ, no data: a member reports twice, its coordinator is replaced by a fresh one
    on the same address, and the member (which has no news) rejoins at once and says it all
    again; the fresh watermark then holds what the first one held."""
    address = coordinator_address()

    def coordinator() -> wire.CoordinatorThread:
        return wire.CoordinatorThread(agreement.Coordinator(
            replicas=1, total_steps=40, resume_step=0,
            watermark=agreement.Watermark(ranks=2, steps_per_epoch=20)), address, keys=session_keypair())

    def rebound() -> wire.CoordinatorThread | None:
        try:
            return coordinator()
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            return None

    def state(c: wire.CoordinatorThread) -> tuple[int, dict[int, int]]:
        assert c.coordinator.watermark is not None
        return c.coordinator.watermark.through, dict(c.coordinator.watermark.ends)

    first = coordinator()
    member = wire.Member(address, 0, "m", keys=session_keypair())
    try:
        member.join(published=-1, timeout_s=10)
        member.report_reach({0: (8, {0: 17}), 1: (6, {})})
        member.report_reach({1: (9, {0: 15})})
        wait_for(lambda: state(first) == (8, {0: 15}), timeout=10, what="the first coordinator's watermark")
        first.close()
        second = wait_for(rebound, timeout=10, what="the address free again")  # ZeroMQ unbinds in its I/O thread
        try:
            def resent() -> bool:
                member.heartbeat(time.monotonic())
                if any(isinstance(m, messages.Joined) for m in member.receive()):
                    member.joined()
                return state(second) == (8, {0: 15})
            # Well under the heartbeat's period: the reconnection itself makes the member rejoin.
            wait_for(resent, timeout=agreement.JOIN_RESEND_S * 2, what="the restarted coordinator's watermark")
        finally:
            second.close()
    finally:
        member.close()


class KilledOnceItsOwnMemberIsTold:
    """The coordinator's ROUTER socket in replica 0's sidecar, SIGKILLed the moment the
    coordinator has handed that same sidecar's member an `agreed` (which its publisher acts on):
    what was handed over before goes out, nothing after it does. Everything else is the real
    socket's."""

    def __init__(self, sock: zmq.Socket[Any], own_member: Any) -> None:
        self._sock = sock
        self._own_member = own_member
        self.killed = False

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        if self.killed:
            return
        self._sock.send_multipart(frames, flags)
        message = messages.decode(frames[1])
        if frames[0] == self._own_member() and isinstance(message, messages.Agreed) and message.through >= 0:
            self.killed = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def test_every_other_member_holds_an_agreed_before_the_coordinators_own_member_does():
    """Real ZeroMQ, no data. The coordinator dies with replica 0's sidecar, its own member: a
    step that member was told exists may be published and taken by its trainer, which then
    waits in the all-reduce for its peers. The restarted coordinator learns that rank's reach
    only once that trainer says hello again, after the all-reduce; so the other members must
    already hold every `agreed` replica 0's member got, or the world deadlocks (CI: a rank got
    no batch for 60 s after the kill two steps before epoch 1's end)."""
    address = coordinator_address()
    thread = wire.CoordinatorThread(agreement.Coordinator(
        replicas=3, total_steps=40, resume_step=0,
        watermark=agreement.Watermark(ranks=3, steps_per_epoch=20)), address, keys=session_keypair())
    dying = KilledOnceItsOwnMemberIsTold(thread._sock, lambda: thread.coordinator.members.get(0))
    thread._sock = dying  # type: ignore[assignment]
    members = [wire.Member(address, replica, f"m{replica}", keys=session_keypair()) for replica in range(3)]
    told: dict[int, int] = {replica: -1 for replica in range(3)}

    def heard(replica: int) -> int:
        for message in members[replica].receive():
            if isinstance(message, messages.Agreed):
                told[replica] = max(told[replica], message.through)
        return told[replica]

    try:
        for member in members:  # replica 0's own member first, as its sidecar starts the coordinator
            member.join(published=-1, timeout_s=10)
        for replica in (1, 2, 0):
            members[replica].report_reach({replica: (3, {})})
        wait_for(lambda: heard(0) == 3, timeout=10, what="replica 0's member told that step 3 exists")
        assert dying.killed
        for replica in (1, 2):
            wait_for(lambda r=replica: heard(r) == 3, timeout=5,
                     what=f"replica {replica}'s member told step 3 exists before the coordinator died")
    finally:
        for member in members:
            member.close()
        thread.close()


def world_of(pods, job_manifest: dict[str, Any], replicas: int, **kwargs: Any) -> list:  # type: ignore[no-untyped-def]
    """Replica 0 a process (to be killed), the others threads, one coordinator address."""
    address = coordinator_address()
    first = pods("pod0", job_manifest, replicas=replicas, replica=0, coordinator=address, **kwargs).start_process()
    return [first] + [pods(f"pod{r}", job_manifest, replicas=replicas, replica=r, coordinator=address,
                           **kwargs).start_thread() for r in range(1, replicas)]


def restart(pod) -> None:  # type: ignore[no-untyped-def]
    pod.kill()  # SIGKILL by PID: no cleanup, its coordinator gone with it
    pod.start_process()


def restarting_coordinator(pod, at: int = KILL_AT):  # type: ignore[no-untyped-def]
    """A lockstep trainer body (global step -> ids) whose rank 0 restarts `pod` after step `at`."""
    killed = threading.Event()

    def body(client: StreamClient, barrier: threading.Barrier) -> dict[int, list[int]]:
        got = {}
        for batch in client:
            got[batch.global_step] = batch["id"].tolist()
            if client.rank == 0 and batch.global_step == at and not killed.is_set():
                killed.set()
                restart(pod)
            barrier.wait()
        barrier.wait()
        assert killed.is_set()
        return got

    return body


def test_an_ordinary_world_goes_on_exactly_after_its_coordinator_restarts(pods, table_uri):
    replicas = 2
    started = world_of(pods, manifest(table_uri), replicas)
    results = lockstep(replicas, [p.socket_dir for p in started], restarting_coordinator(started[0]))
    for rank, got in enumerate(results):
        expected = reference_batches(table_uri, {}, replicas, rank)
        assert got == dict(enumerate(expected)), f"rank {rank}"
    for pod in started:
        assert pod.wait() == 0


@pytest.mark.parametrize("at", ["mid-epoch", "by-the-end"])
def test_a_skip_world_goes_on_exactly_after_its_coordinator_restarts(pods, table_uri, plan, at):
    """The look-ahead watermark lives in the coordinator: the restarted one must learn every
    rank's reach and the epoch ends found before it started, or the world hangs (a member whose
    look-ahead is full has no news to report) or a rank publishes past an epoch's end. Killed
    mid-epoch 0, or two steps before epoch 1's end E, which rank 1's reader found before the
    kill (rank 0's own splits end later)."""
    replicas = 3
    kill_at = {"mid-epoch": KILL_AT, "by-the-end": plan["spe"] + plan["ends"][1] - 2}[at]
    own_end = len(lancedb_ids(plan["data"], epoch=1, rank=0, world=replicas, bad=plan["bad"])) // (G // replicas)
    assert own_end > plan["ends"][1]  # the restarted sidecar's own reader would not find E
    started = world_of(pods, job(table_uri, plan["bad"]), replicas)
    results = lockstep(replicas, [p.socket_dir for p in started], restarting_coordinator(started[0], kill_at))
    for rank, got in enumerate(results):
        assert got == expected_steps(plan, replicas, rank), f"rank {rank}"
    for pod in started:
        assert pod.wait() == 0


def test_a_drain_after_the_restart_agrees_on_one_step(pods, table_uri, tmp_path):
    """The restarted coordinator knows its members again and cuts the world at one step."""
    replicas, data = 2, {"epochs": 2}
    started = world_of(pods, manifest(table_uri, str(tmp_path / "ckpt"), **data), replicas)
    address = started[0].env["SPLITFEED_COORDINATOR"]
    request_at = KILL_AT + 3
    killed = threading.Event()

    def body(client: StreamClient, barrier: threading.Barrier) -> dict[str, Any]:
        out: dict[str, Any] = {"steps": {}, "saved": None}
        for batch in client:
            out["steps"][batch.global_step] = batch["id"].tolist()
            if client.rank == 0 and batch.global_step == KILL_AT and not killed.is_set():
                killed.set()
                restart(started[0])
            if client.rank == 0 and batch.global_step == request_at:
                assert request_drain(address, "rescale-w0", "rescale", timeout_s=10) is not None
            time.sleep(STEP_S)  # a model step: the world must not end before its members rejoin
            barrier.wait()
            if client.checkpoint_requested:
                out["saved"] = client.checkpoint()
                client.commit(out["saved"])
                if client.drained:
                    break
        out["drained"] = client.drained
        return out

    results = lockstep(replicas, [p.socket_dir for p in started], body)
    agreed = {r["saved"] for r in results}
    assert len(agreed) == 1 and None not in agreed, results
    (step,) = agreed
    assert step > request_at
    for rank, r in enumerate(results):
        assert r["drained"], f"rank {rank}"
        expected = reference_batches(table_uri, data, replicas, rank)
        assert r["steps"] == dict(list(enumerate(expected))[:step]), f"rank {rank} went past step {step - 1}"
    for pod in started:
        assert pod.wait() == 0


DRAIN_AT = KILL_AT + 10
"""The step a world is asked ahead to drain at, well past the restart at KILL_AT."""


def drained_at_one_step(pods_in_order: list, address: str, table_uri: str, data: dict[str, Any],
                        killed_rank: int) -> None:
    """Lockstep trainers of `pods_in_order`; the world commits to draining at DRAIN_AT, then the
    sidecar of `killed_rank` is SIGKILLed and restarted at KILL_AT. Every rank must checkpoint
    and drain exactly at DRAIN_AT, with lancedb's batches up to it: 0 steps redone."""
    replicas, killed = len(pods_in_order), threading.Event()

    def body(client: StreamClient, barrier: threading.Barrier) -> dict[str, Any]:
        out: dict[str, Any] = {"steps": {}, "saved": None}
        for batch in client:
            out["steps"][batch.global_step] = batch["id"].tolist()
            if client.rank == 0 and batch.global_step == 1:
                assert wait_for(lambda: request_drain(address, "rescale-w0", "rescale", timeout_s=2,
                                                      not_before=DRAIN_AT) == agreement.COMMITTED,
                                10, "the drain committed at DRAIN_AT")
            if client.rank == killed_rank and batch.global_step == KILL_AT and not killed.is_set():
                killed.set()
                restart(pods_in_order[killed_rank])
            time.sleep(STEP_S)
            barrier.wait()
            if client.checkpoint_requested:
                out["saved"] = client.checkpoint()
                client.commit(out["saved"])
                if client.drained:
                    break
        out["drained"] = client.drained
        return out

    results = lockstep(replicas, [p.socket_dir for p in pods_in_order], body)
    assert killed.is_set()
    assert [r["saved"] for r in results] == [DRAIN_AT] * replicas, results
    for rank, r in enumerate(results):
        assert r["drained"], f"rank {rank}"
        expected = reference_batches(table_uri, data, replicas, rank)
        assert r["steps"] == dict(list(enumerate(expected))[:DRAIN_AT]), f"rank {rank} went past {DRAIN_AT - 1}"
    for pod in pods_in_order:
        assert pod.wait() == 0


def test_a_coordinator_restarted_during_a_drain_still_drains_the_world_at_the_committed_step(
        pods, table_uri, tmp_path):
    """Issue 21, a drain that survives a dead sidecar: the world committed its drain step,
    then replica 0's sidecar, the coordinator, is SIGKILLed and restarted before the world gets
    there. Its successor knows no round; the member that acts on the step says so when it
    rejoins, and every rank still checkpoints and drains exactly there."""
    data = {"epochs": 2}
    started = world_of(pods, manifest(table_uri, str(tmp_path / "ckpt"), **data), 2)
    drained_at_one_step(started, started[0].env["SPLITFEED_COORDINATOR"], table_uri, data, killed_rank=0)


def test_a_member_restarted_during_a_drain_is_told_the_committed_step_and_the_world_drains_there(
        pods, table_uri, tmp_path):
    """The member's side of the same: replica 1's sidecar (a process here, replica 0's a thread
    of this process) is SIGKILLed and restarted after the world committed its drain step; its
    successor is told the step when it joins, and both ranks drain exactly there."""
    data = {"epochs": 2}
    address = coordinator_address()
    job = manifest(table_uri, str(tmp_path / "ckpt"), **data)
    first = pods("pod0", job, replicas=2, replica=0, coordinator=address).start_thread()
    member = pods("pod1", job, replicas=2, replica=1, coordinator=address).start_process()
    drained_at_one_step([first, member], address, table_uri, data, killed_rank=1)
