"""spec.rescale inPlace, a member's pod fails: it is replaced alone, walked step by step against an
in-memory cluster (issue 22 item 3). The other pods are never deleted; world e's coordinator is
told to end the world without a drain; the new pod is created once the old one is gone, for world
e+1; the status follows world e+1's coordinator. Replica 0's pod, recreate, and anything that goes
wrong meanwhile replace the whole world as before."""

from __future__ import annotations

import datetime

from tests.support.builders import status_answer
from tests.support.memory_cluster import Cluster, env_of, in_place




def fail(c: Cluster, name: str, **status: object) -> None:
    c.pods[name]["status"].update(phase="Failed", **status)


def test_a_failed_member_pod_is_replaced_alone_and_the_others_go_on_in_the_next_world():
    c = in_place(4)
    kept = {n: c.pods[n] for n in ("resnet-r0", "resnet-r1", "resnet-r3")}
    fail(c, "resnet-r2")
    d = c.step()
    assert d.step == "ReplacingPod" and d.delete == ["resnet-r2"] and not d.create
    assert d.notify == ("tcp://10.0.0.1:29501", "replace-w0-r2", "replace")
    assert (d.notify_lost, d.notify_replicas) == ((2,), 4)
    assert (c.status["worldEpoch"], c.status["restarts"], c.status["drain"]["reason"]) == (0, 1, "Replace")
    (event,) = d.events
    assert event.reason == "PodReplacedInPlace" and "resnet-r2" in event.message and "restart 1 of" in event.message
    assert c.reason() == "ReplacingPod" and c.reason("Ready") == "ReplacingPod"
    d = c.step()  # the old pod is gone: its successor, for world 1
    assert [o["metadata"]["name"] for o in d.create] == ["resnet-r2"] and d.notify_lost == (2,)
    new = c.pods["resnet-r2"]
    assert new["metadata"]["labels"]["splitfeed.io/world-epoch"] == "1"
    sidecar, trainer = env_of(new, "splitfeed-sidecar"), env_of(new, "trainer")
    assert (trainer["WORLD_SIZE"], trainer["MASTER_PORT"], trainer["SPLITFEED_WORLD_EPOCH"]) == ("4", "29510", "1")
    assert sidecar["SPLITFEED_RESUME"] == "latest" and "SPLITFEED_RESUME_STEP" not in sidecar
    d = c.step()
    assert d.step == "ReplacingPod" and not d.create and not d.delete  # world 1 does not serve yet
    c.next_world = status_answer(world_epoch=1, replicas=4, reporting=0, resume_step=8)
    d = c.step()
    assert d.step == "Running" and not d.delete
    assert sorted(d.label) == ["resnet-r0", "resnet-r1", "resnet-r3"] and c.epochs() == {1}
    assert (c.status["worldEpoch"], c.status["replicas"], c.status["restarts"]) == (1, 4, 1)
    assert "drain" not in c.status and "resumeStep" not in c.status and c.reason() == "PodReplacedInPlace"
    assert [e.reason for e in d.events] == ["WorldResumedInPlace"] and "step 8" in d.events[0].message
    assert all(c.pods[n] is p for n, p in kept.items())  # the same objects: never deleted, never recreated
    c.next_world = None
    c.set_phase("Running", "resnet-r2")
    d = c.step()
    assert d.step == "Running" and not d.delete and not d.create and not d.label
    assert c.reason("Ready") == "AllPodsRunning"


def test_a_vanished_member_pod_is_created_again_at_once():
    c = in_place(3)
    c.pods.pop("resnet-r1")  # force-deleted: a lost node
    d = c.step()
    assert [o["metadata"]["name"] for o in d.create] == ["resnet-r1"] and not d.delete
    assert d.notify is not None and d.notify[1] == "replace-w0-r1" and c.status["restarts"] == 1
    assert c.pods["resnet-r1"]["metadata"]["labels"]["splitfeed.io/world-epoch"] == "1"


def test_a_disrupted_member_pod_is_replaced_alone_without_counting_it():
    c = in_place(2)
    fail(c, "resnet-r1", conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}])
    d = c.step()
    assert d.step == "ReplacingPod" and d.delete == ["resnet-r1"]
    assert c.status.get("restarts", 0) == 0 and "not counted" in d.events[0].message


def test_replica_0s_pod_failing_restarts_the_whole_world_as_recreate_does():
    c = in_place(3)
    fail(c, "resnet-r0")
    d = c.step(act=False)
    assert c.status["drain"]["reason"] == "Restart" and not c.status["drain"].get("inPlace")
    assert sorted(d.delete) == ["resnet-r0", "resnet-r1", "resnet-r2"] and d.notify is None


def test_recreate_restarts_the_whole_world_for_a_member_pod():
    c = Cluster(replicas=3)
    c.running()
    c.pods["resnet-w0-2"]["status"]["phase"] = "Failed"
    d = c.step(act=False)
    assert c.status["drain"]["reason"] == "Restart" and sorted(d.delete) == [f"resnet-w0-{i}" for i in range(3)]


def test_a_spent_restart_budget_fails_the_job_instead():
    c = in_place(2, maxRestarts=0)
    fail(c, "resnet-r1")
    c.step()
    assert c.status["phase"] == "Failed" and c.reason("Failed") == "RestartLimitExceeded"


def test_another_pod_failing_while_one_is_replaced_restarts_the_whole_world_and_the_new_pod_goes():
    c = in_place(3)
    fail(c, "resnet-r2")
    c.step()
    c.step()  # resnet-r2 of world 1 created
    fail(c, "resnet-r1")
    d = c.step(act=False)
    assert c.status["drain"]["reason"] == "Restart" and c.status["restarts"] == 2
    assert sorted(d.delete) == ["resnet-r0", "resnet-r1"]
    c.pods.pop("resnet-r0")
    c.pods.pop("resnet-r1")
    d = c.step(act=False)  # the new resnet-r2 of world 1 is stale now: deleted, and waited for
    assert d.delete == ["resnet-r2"] and not d.create and c.status["worldEpoch"] == 0


def test_no_next_world_in_time_replaces_the_whole_world():
    c = in_place(2)
    fail(c, "resnet-r1")
    c.step()
    c.step()
    c.now += datetime.timedelta(seconds=60 + 60)  # checkpoint.timeoutSeconds + the new pods' start
    d = c.step(act=False)
    assert [e.reason for e in d.events] == ["InPlaceFailed"] and c.status["drain"]["step"] == "RemovingOldWorld"
    assert sorted(d.delete) == ["resnet-r0", "resnet-r1"] and "inPlace" not in c.status["drain"]
