"""A drain whose member pod lost its sidecar for good (issue 21 item 2), walked against the in-memory
cluster: `--sidecar-mode container`, restartPolicy Never, replica 2's sidecar exited 137 during
WaitingForCheckpoint and left no report while its trainer still runs. The operator waits for that
trainer (up to checkpoint.timeoutSeconds); when replica 0's report says the world's coordinator
counted the drain step committed by every member (`completeStep`), the next world resumes exactly
there and an event names the pod (0 steps redone); otherwise from the newest complete checkpoint."""

from __future__ import annotations

import datetime
import json

from splitfeed.operator.lifecycle import deciding, rescaling
from tests.support.memory_cluster import Cluster, ts

DRAIN = 7
LOST = "resnet-w0-2"


def report(step: int, *, complete: int | None = None) -> str:
    found = {"globalStep": step, "epoch": 0, "step": step, "stepsPerEpoch": 100, "lastCheckpoint": None,
             "drained": True, "agreedStep": step, "drainReason": "rescale", "resumeStep": 0, "error": None,
             "permanent": False}
    return json.dumps(found if complete is None else {**found, "completeStep": complete})


def stopped(c: Cluster, pod: str, message: str) -> None:
    """Both containers exited 0; the sidecar (a plain container) left `message`."""
    done = {"terminated": {"exitCode": 0, "finishedAt": ts(c.now)}}
    c.pods[pod]["status"] = {"phase": "Succeeded", "containerStatuses": [
        {"name": "trainer", "state": done},
        {"name": "splitfeed-sidecar", "state": {"terminated": {"exitCode": 0, "message": message,
                                                               "finishedAt": ts(c.now)}}}]}


def sidecar_killed(c: Cluster, pod: str, trainer: dict) -> None:
    """The sidecar SIGKILLed (137, no report); the trainer in `trainer` state."""
    c.pods[pod]["status"] = {"phase": "Running" if "running" in trainer else "Failed", "containerStatuses": [
        {"name": "trainer", "state": trainer},
        {"name": "splitfeed-sidecar", "state": {"terminated": {"exitCode": 137, "finishedAt": ts(c.now)}}}]}


def draining(complete: int | None) -> Cluster:
    """World 0 (4 pods) drains for a rescale to 2 at DRAIN; every pod but LOST drained there,
    replica 0's report saying `complete`; LOST's sidecar is dead and its trainer still runs."""
    c = Cluster().running()
    c.scale(2)
    c.step()
    assert c.step().step == "WaitingForCheckpoint"
    for name in c.pods:
        if name != LOST:
            stopped(c, name, report(DRAIN, complete=complete if name.endswith("-0") else None))
    sidecar_killed(c, LOST, {"running": {}})
    return c


def events(d: deciding.Decision, reason: str) -> list[deciding.Event]:
    return [e for e in d.events if e.reason == reason]


def resume_env(c: Cluster) -> set[tuple[str | None, str | None]]:
    found = set()
    for pod in c.pods.values():
        env = {e["name"]: e.get("value") for x in pod["spec"]["initContainers"] + pod["spec"]["containers"]
               if x["name"] == "splitfeed-sidecar" for e in x["env"]}
        found.add((env.get("SPLITFEED_RESUME_STEP"), env.get("SPLITFEED_RESUME")))
    return found


def test_the_drain_waits_for_the_trainer_of_a_pod_whose_sidecar_died():
    c = draining(complete=DRAIN)
    d = c.step()
    assert d.step == "WaitingForCheckpoint" and not d.delete, d.events
    (rescaling_,) = [x for x in c.status["conditions"] if x["type"] == "Rescaling"]
    assert rescaling_["reason"] == "WaitingForCheckpoint" and "3/4 pods" in rescaling_["message"]


def test_the_next_world_resumes_at_the_drain_step_its_trainers_committed_through_the_coordinator():
    c = draining(complete=DRAIN)
    c.step()
    sidecar_killed(c, LOST, {"terminated": {"exitCode": 0, "finishedAt": ts(c.now)}})
    d = c.step()
    assert d.step == "RemovingOldWorld" and len(d.delete) == 4
    assert d.status["resumeStep"] == DRAIN
    (lost,) = events(d, rescaling.SIDECAR_LOST)
    assert lost.type == "Warning" and LOST in lost.message and f"step {DRAIN}" in lost.message
    assert "0 steps redone" in lost.message
    assert events(d, "ResumeStepChosen") and not events(d, "ResumeFromLatest")
    c.step(), c.step()
    assert c.status["worldEpoch"] == 1 and c.status.get("restarts") is None
    assert resume_env(c) == {(str(DRAIN), None)}


def test_without_the_coordinators_count_the_next_world_resumes_from_the_newest_complete_checkpoint():
    c = draining(complete=None)  # replica 0's report does not say every member committed
    c.step()
    sidecar_killed(c, LOST, {"terminated": {"exitCode": 0, "finishedAt": ts(c.now)}})
    d = c.step()
    assert d.step == "RemovingOldWorld" and d.status.get("resumeStep") is None
    (latest,) = events(d, "ResumeFromLatest")
    assert LOST in latest.message and not events(d, rescaling.SIDECAR_LOST)
    c.step(), c.step()
    assert resume_env(c) == {(None, "latest")}


def test_a_trainer_that_never_ends_is_given_up_on_after_the_checkpoint_timeout():
    c = draining(complete=DRAIN)
    c.step()
    c.now += datetime.timedelta(seconds=61)  # checkpoint.timeoutSeconds: 60
    d = c.step()
    assert d.step == "RemovingOldWorld" and d.status.get("resumeStep") is None
    (timeout,) = events(d, "CheckpointTimeout")
    assert not events(d, rescaling.SIDECAR_LOST)
    assert f"not finished: {LOST}" in timeout.message and f"the sidecar of {LOST} died" in timeout.message, timeout
