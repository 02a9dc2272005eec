"""Trainers that return before the job's last step (operator/lifecycle/endings.py, issue 21), step by step.

The pods are written as a kubelet reports them: the `trainer` container terminated with
exit 0 and a finishedAt, the sidecar still running (a plain container nobody stops, or a
native sidecar being stopped) or terminated with its report.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from splitfeed.operator.lifecycle import endings
from splitfeed.operator.cluster import live
from tests.support.memory_cluster import Cluster, ts

RUNNING = {"running": {"startedAt": "2026-01-01T11:00:00Z"}}


def exited(c: Cluster, code: int = 0, at: datetime.datetime | None = None) -> dict[str, Any]:
    return {"terminated": {"exitCode": code, "finishedAt": ts(at or c.now)}}


def report(step: int, *, spe: int = 20, drained: bool = False) -> str:
    return json.dumps({"globalStep": step, "epoch": 0, "step": step, "stepsPerEpoch": spe, "lastCheckpoint": None,
                       "drained": drained, "agreedStep": step if drained else None,
                       "drainReason": "preempt" if drained else None, "resumeStep": 0, "error": None,
                       "permanent": False})


def trainer_state(c: Cluster, pod: str, state: dict[str, Any], *, sidecar: dict[str, Any] = RUNNING,
                  phase: str = "Running") -> None:
    """The pod's trainer in `state`, its sidecar in `sidecar` (as a container: --sidecar-mode container)."""
    c.pods[pod]["status"] = {"phase": phase, "podIP": "10.0.0.1", "containerStatuses": [
        {"name": "trainer", "state": state, "restartCount": 0},
        {"name": "splitfeed-sidecar", "state": sidecar, "restartCount": 0}]}


def sidecar_done(c: Cluster, step: int, **kw: Any) -> dict[str, Any]:
    return {"terminated": {"exitCode": 0, "finishedAt": ts(c.now), "message": report(step, **kw)}}


def two() -> Cluster:
    return Cluster(replicas=2, checkpoint={"uri": "s3://bucket/ckpt", "timeoutSeconds": 30}).running()


def later(c: Cluster, seconds: float) -> None:
    c.now += datetime.timedelta(seconds=seconds)


def condition(c: Cluster, type_: str) -> dict[str, Any]:
    return next(x for x in c.status["conditions"] if x["type"] == type_)


def test_trainers_that_return_without_close_end_the_job_at_the_step_the_world_reached() -> None:
    """--sidecar-mode container: both trainers exited 0, both sidecars serve on (no `bye`)."""
    c = two()
    returned = c.now
    for pod in list(c.pods):
        trainer_state(c, pod, exited(c))
    d = c.step()
    assert d.step == endings.TRAINERS_STOPPED and not d.delete and c.status["phase"] == "Running"
    assert c.reason("Ready") == endings.TRAINERS_STOPPED
    assert endings.condition_waiting(c.status), "the live poller asks the world for its step meanwhile"
    assert live.Poller().due(("ns", "resnet"), {"status": c.status, "spec": {}})
    # A poll from before the return says nothing final; one after it does.
    c.status["progress"] = {"globalStep": 4, "stepsPerEpoch": 20, "updatedAt": ts(returned - datetime.timedelta(seconds=2))}
    later(c, endings.STOP_GRACE_S)
    assert c.step().step == endings.TRAINERS_STOPPED
    later(c, 1)
    c.status["progress"] = {"globalStep": 5, "stepsPerEpoch": 20, "updatedAt": ts(c.now)}
    d = c.step()
    assert c.status["phase"] == "Succeeded", c.status
    assert sorted(d.delete) == ["resnet-w0-0", "resnet-w0-1"], "the sidecars that still run are stopped"
    done = condition(c, "Complete")
    assert done["status"] == "True" and done["reason"] == endings.TRAINERS_STOPPED
    assert done["message"].startswith("trainers stopped at global step 5 of 20 (the world's live status"), done
    assert [e.message for e in d.events if e.reason == endings.TRAINERS_STOPPED] == [done["message"]]
    assert c.status.get("restarts", 0) == 0 and c.step().step == "Finished"


def test_sidecars_that_reported_end_the_job_at_once_with_their_step() -> None:
    """close() (the sidecar ends on `bye`), or native sidecars the kubelet stopped: reports say k."""
    c = two()
    for pod in list(c.pods):
        trainer_state(c, pod, exited(c), sidecar=sidecar_done(c, 5), phase="Succeeded")
    d = c.step()
    assert c.status["phase"] == "Succeeded" and not d.delete
    assert condition(c, "Complete")["message"].startswith(
        "trainers stopped at global step 5 of 20 (the sidecars' reports)")


def test_native_sidecars_stopped_by_the_kubelet_end_the_job_with_their_reports() -> None:
    """Native sidecars (the default): the kubelet stops them once the trainer exited; each writes
    its report (sidecar/serving/ending.py) into initContainerStatuses, and the pods succeed."""
    c = two()
    for pod in list(c.pods):
        c.pods[pod]["status"] = {"phase": "Succeeded", "containerStatuses": [
            {"name": "trainer", "state": exited(c), "restartCount": 0}], "initContainerStatuses": [
            {"name": "splitfeed-sidecar", "state": sidecar_done(c, 5), "restartCount": 0}]}
    c.step()
    assert c.status["phase"] == "Succeeded"
    assert condition(c, "Complete")["message"].startswith("trainers stopped at global step 5 of 20")


def test_native_sidecars_still_stopping_do_not_keep_the_job_running() -> None:
    """Native sidecars that wait out their grace period after the trainer exited (no report yet):
    the world's live status gives the step."""
    c = two()
    for pod in list(c.pods):
        c.pods[pod]["status"] = {"phase": "Running", "containerStatuses": [
            {"name": "trainer", "state": exited(c), "restartCount": 0}], "initContainerStatuses": [
            {"name": "splitfeed-sidecar", "state": RUNNING, "restartCount": 0}]}
    assert c.step().step == endings.TRAINERS_STOPPED
    later(c, endings.STOP_GRACE_S + 1)
    c.status["progress"] = {"globalStep": 5, "stepsPerEpoch": 20, "updatedAt": ts(c.now)}
    d = c.step()
    assert c.status["phase"] == "Succeeded" and len(d.delete) == 2


def test_a_normal_end_still_says_every_pod_succeeded() -> None:
    c = two()
    for pod in list(c.pods):
        trainer_state(c, pod, exited(c), sidecar=sidecar_done(c, 20), phase="Succeeded")
    c.step()
    assert c.status["phase"] == "Succeeded" and condition(c, "Complete")["reason"] == "AllPodsSucceeded"


def test_a_normal_end_whose_sidecars_linger_ends_without_waiting_for_them() -> None:
    """No close(): a sidecar answers for END_LINGER_S (30 s) after the last batch; the job ends sooner."""
    c = two()
    for pod in list(c.pods):
        trainer_state(c, pod, exited(c))
    c.step()
    later(c, endings.STOP_GRACE_S + 1)
    c.status["progress"] = {"globalStep": 20, "stepsPerEpoch": 20, "updatedAt": ts(c.now)}
    d = c.step()
    assert c.status["phase"] == "Succeeded" and len(d.delete) == 2
    assert "finished the job's last step (trainers stopped at global step 20 of 20" in \
        condition(c, "Complete")["message"]


def test_without_reports_or_a_live_status_the_job_still_ends_within_its_bound() -> None:
    c = two()
    c.status["progress"] = {"globalStep": 3, "stepsPerEpoch": 20, "updatedAt": ts(c.now - datetime.timedelta(minutes=1))}
    for pod in list(c.pods):
        trainer_state(c, pod, exited(c))
    later(c, endings.STOP_GRACE_S + endings.REPORT_WAIT_S - 1)
    assert c.step().step == endings.TRAINERS_STOPPED
    later(c, 1)
    d = c.step()
    assert c.status["phase"] == "Succeeded" and len(d.delete) == 2
    assert "trainers stopped at global step 3 of 20 (the world's live status" in condition(c, "Complete")["message"]
    assert "the last one seen" in condition(c, "Complete")["message"]


def test_sidecars_that_end_on_their_own_within_the_grace_are_not_cut_short() -> None:
    """A world that drains itself: the trainers exit 0 after the agreed step, the sidecars a moment
    later with drained reports. A live status seen in between must not end the job."""
    c = two()
    for pod in list(c.pods):
        trainer_state(c, pod, exited(c))
    later(c, 1)
    c.status["progress"] = {"globalStep": 7, "stepsPerEpoch": 20, "updatedAt": ts(c.now)}
    later(c, 1)
    assert c.step().step == endings.TRAINERS_STOPPED and c.status["phase"] == "Running"
    for pod in list(c.pods):
        trainer_state(c, pod, exited(c), sidecar=sidecar_done(c, 7, drained=True), phase="Succeeded")
    d = c.step()
    assert c.status["phase"] == "Rescaling" and any(e.reason == "WorldDrained" for e in d.events), d


def test_a_world_whose_pod_is_being_deleted_is_left_to_its_drain() -> None:
    """A preemption (`kubectl delete pod`, an eviction): the world drains itself and the trainers
    exit 0 after the agreed step; sidecars slow to exit on a loaded node must not end the job."""
    c = two()
    c.pods["resnet-w0-0"]["metadata"]["deletionTimestamp"] = ts(c.now)
    for pod in list(c.pods):
        trainer_state(c, pod, exited(c))
    later(c, endings.STOP_GRACE_S + 1)
    c.status["progress"] = {"globalStep": 9, "stepsPerEpoch": 20, "updatedAt": ts(c.now)}
    d = c.step()
    assert c.status["phase"] == "Running" and d.step != endings.TRAINERS_STOPPED and not d.delete, d


def test_a_rank_that_returns_while_its_peer_still_runs_fails_the_job_after_the_timeout() -> None:
    c = two()
    trainer_state(c, "resnet-w0-1", exited(c))
    trainer_state(c, "resnet-w0-0", RUNNING)
    assert c.step().step == "Running", "at a normal end the others return a moment later: nothing said yet"
    later(c, endings.STOP_GRACE_S)
    d = c.step()
    assert d.step == endings.RANKS_STOPPED_EARLY and c.status["phase"] == "Running" and not d.delete
    assert "fails at 2026-01-01T12:00:30Z" in condition(c, "Ready")["message"]
    later(c, 29 - endings.STOP_GRACE_S)
    assert c.step().step == endings.RANKS_STOPPED_EARLY
    later(c, 1)
    d = c.step()
    assert c.status["phase"] == "Failed" and sorted(d.delete) == ["resnet-w0-0", "resnet-w0-1"]
    failed = condition(c, "Failed")
    assert failed["reason"] == endings.RANKS_STOPPED_EARLY
    assert failed["message"].startswith("rank 1 (pod resnet-w0-1) of world 0 returned (exit 0) at "
                                        "2026-01-01T12:00:00Z while rank 0 (pod resnet-w0-0) still ran 30 s later")
    assert c.status.get("restarts", 0) == 0


def test_peers_that_fail_after_a_rank_returned_fail_the_job_at_once_uncounted() -> None:
    """gloo: rank 1 returns, rank 0's next all-reduce raises (its peer's connection closed)."""
    c = two()
    trainer_state(c, "resnet-w0-1", exited(c))
    later(c, 1)
    trainer_state(c, "resnet-w0-0", exited(c, 1))
    d = c.step()
    assert c.status["phase"] == "Failed" and c.status.get("restarts", 0) == 0, c.status
    assert condition(c, "Failed")["reason"] == endings.RANKS_STOPPED_EARLY
    assert "rank 1 (pod resnet-w0-1) of world 0 returned (exit 0)" in condition(c, "Failed")["message"]
    assert "while rank 0 (pod resnet-w0-0) still trained, and then failed" in condition(c, "Failed")["message"]
    # Both pods still run a sidecar: rank 1's (no close()) and rank 0's, a plain container waiting
    # for its dead trainer; a failed job stops them too.
    assert sorted(d.delete) == ["resnet-w0-0", "resnet-w0-1"]


def test_a_rank_that_failed_first_is_an_ordinary_world_failure() -> None:
    c = two()
    trainer_state(c, "resnet-w0-0", exited(c, 1))
    later(c, 1)
    trainer_state(c, "resnet-w0-1", exited(c))  # its peer's error made it return: not an early stop
    assert c.step().step == "AwaitingSidecarReport"  # as for any failure: the sidecar may say why
    later(c, 15)
    d = c.step()
    assert any(e.reason == "WorldFailed" for e in d.events) and c.status["restarts"] == 1


def test_a_failure_after_the_world_reached_its_end_is_an_ordinary_world_failure() -> None:
    c = two()
    trainer_state(c, "resnet-w0-1", exited(c), sidecar=sidecar_done(c, 20))
    later(c, 1)
    trainer_state(c, "resnet-w0-0", exited(c, 1))
    assert c.step().step == "AwaitingSidecarReport"
    later(c, 15)
    d = c.step()
    assert any(e.reason == "WorldFailed" for e in d.events), d


def test_ranks_are_named_by_replica_and_gpus() -> None:
    c = Cluster(replicas=2, gpusPerReplica=2).running()
    trainer_state(c, "resnet-w0-1", exited(c))
    trainer_state(c, "resnet-w0-0", RUNNING)
    later(c, endings.STOP_GRACE_S)
    c.step()
    assert "ranks 2-3 (pod resnet-w0-1) of world 0 returned" in condition(c, "Ready")["message"]
