"""A change in place whose member lost its sidecar for good (issues 21 item 2, 22 item 5), walked
against the in-memory cluster: `--sidecar-mode container`, restartPolicy Never, `kubectl scale`
2 -> 1 in place, and replica 1's sidecar SIGKILLed (137, no report) after world 0 was asked to
drain while its trainer still runs. As in a recreate drain (tests/operator/test_stranded.py) the
pod is waited for: its trainers may commit the drain step through the world's coordinator, which
then starts the next world at that step; the operator says so, and counts no restart. Replica 0's
sidecar (the coordinator), or a trainer that fails, still fails the world at once."""

from __future__ import annotations

from typing import Any

from splitfeed.operator.lifecycle import deciding, rescaling
from splitfeed.trainer_client.contract import messages
from tests.support.builders import status_answer
from tests.support.memory_cluster import Cluster, in_place, ts

DRAIN = 7
MEMBER = "resnet-r1"



def serves(epoch: int, replicas: int, resume: int, **fields: Any) -> messages.Status:
    """The next world's coordinator's `status` answer (worlds.request_status)."""
    return status_answer(world_epoch=epoch, replicas=replicas, reporting=0, resume_step=resume, **fields)


def sidecar_killed(c: Cluster, pod: str, trainer: dict[str, Any]) -> None:
    """The pod's plain sidecar container SIGKILLed (137, no report); its trainer in state `trainer`."""
    c.pods[pod]["status"] = {"phase": "Running", "podIP": c.pods[pod]["status"].get("podIP"), "containerStatuses": [
        {"name": "trainer", "state": trainer},
        {"name": "splitfeed-sidecar", "state": {"terminated": {"exitCode": 137, "finishedAt": ts(c.now)}}}]}


def events(d: deciding.Decision, reason: str) -> list[deciding.Event]:
    return [e for e in d.events if e.reason == reason]


def asked() -> Cluster:
    c = in_place(2)
    c.scale(1)
    assert c.step().step == "WaitingForCheckpoint" and c.status["drain"]["askedAt"]
    return c


def test_a_member_whose_sidecar_died_during_the_change_is_waited_for_and_the_next_world_announced() -> None:
    c = asked()
    sidecar_killed(c, MEMBER, {"running": {}})
    d = c.step()
    assert d.step == "WaitingForCheckpoint" and not d.delete, d.events
    assert c.status.get("restarts") is None and c.status["drain"]["reason"] == "Rescale"
    sidecar_killed(c, MEMBER, {"terminated": {"exitCode": 0, "finishedAt": ts(c.now)}})  # it committed and ended
    d = c.step()
    assert d.step == "WaitingForCheckpoint" and not d.delete, d.events
    c.next_world = serves(1, 1, DRAIN)  # replica 0 counted every member committed DRAIN
    d = c.step()
    assert d.step == "Running" and d.delete == [MEMBER]
    assert (c.status["worldEpoch"], c.status["replicas"], c.status["resumeStep"]) == (1, 1, DRAIN)
    assert c.status.get("restarts") is None
    (lost,) = events(d, rescaling.SIDECAR_LOST)
    assert lost.type == "Warning" and MEMBER in lost.message and f"step {DRAIN}" in lost.message
    assert "0 steps redone" in lost.message


def test_a_dead_sidecar_the_next_worlds_coordinator_names_is_announced_once_though_its_pod_looks_fine() -> None:
    """The next world served before the member pod's status showed its dead sidecar (as end to
    end, issue 22 item 5): the coordinator's `status` answer names the replica it stood in for."""
    c = asked()
    c.next_world = serves(1, 1, DRAIN, stood_in=[1])
    d = c.step()
    assert d.step == "Running" and d.delete == [MEMBER]
    (lost,) = events(d, rescaling.SIDECAR_LOST)
    assert lost.type == "Warning" and MEMBER in lost.message and f"step {DRAIN}" in lost.message
    assert c.status.get("restarts") is None
    assert not events(c.step(), rescaling.SIDECAR_LOST)  # once per drain: world 1 runs now


def test_a_dead_sidecar_seen_and_named_is_announced_once() -> None:
    c = asked()
    sidecar_killed(c, MEMBER, {"terminated": {"exitCode": 0, "finishedAt": ts(c.now)}})
    c.step()
    c.next_world = serves(1, 1, DRAIN, stood_in=[1])
    d = c.step()
    (lost,) = events(d, rescaling.SIDECAR_LOST)
    assert lost.message.count(MEMBER) == 1, lost.message


def test_a_next_world_without_a_dead_sidecar_says_nothing_of_one() -> None:
    c = asked()
    c.next_world = serves(1, 1, DRAIN)
    d = c.step()
    assert d.step == "Running" and not events(d, rescaling.SIDECAR_LOST)


def test_the_coordinators_sidecar_killed_during_the_change_still_fails_the_world() -> None:
    c = asked()
    sidecar_killed(c, "resnet-r0", {"running": {}})
    c.step(act=False)
    assert c.status["drain"]["reason"] == "Restart" and c.status["restarts"] == 1


def test_a_member_whose_trainer_fails_after_its_sidecar_died_fails_the_world() -> None:
    c = asked()
    sidecar_killed(c, MEMBER, {"running": {}})
    c.step()
    sidecar_killed(c, MEMBER, {"terminated": {"exitCode": 1, "finishedAt": ts(c.now)}})
    c.step(act=False)
    assert c.status["drain"]["reason"] == "Restart" and c.status["restarts"] == 1


def test_a_member_whose_sidecar_died_before_the_world_was_asked_fails_it() -> None:
    """A scale-up waits for its new pods before it asks: a sidecar dead then took no drain step."""
    c = in_place(2)
    c.scale(4)
    assert c.step().step == "CheckpointRequested" and not c.status["drain"].get("askedAt")
    sidecar_killed(c, MEMBER, {"running": {}})
    c.step(act=False)
    assert c.status["drain"]["reason"] == "Restart" and c.status["restarts"] == 1
