"""spec.rescale inPlace, walked step by step against an in-memory cluster: the pods that stay
are never deleted, the new replicas' pods are created ahead, the status follows the next
world's coordinator, and everything that goes wrong falls back to replacing the world."""

from __future__ import annotations

import datetime
import json

from splitfeed.operator.lifecycle import deciding
from splitfeed.operator.objects import planning
from splitfeed.trainer_client.contract import messages
from tests.support.builders import OWNER, status_answer
from tests.support.memory_cluster import SETTINGS, Cluster, env_of, in_place, ts




def left(c: Cluster, pod: str, agreed: int) -> None:
    """A pod of a replica the next world has no room for: drained, and ended with 0."""
    report = {"globalStep": agreed, "epoch": 0, "step": agreed, "stepsPerEpoch": 100, "lastCheckpoint": None,
              "drained": True, "agreedStep": agreed, "drainReason": "rescale", "resumeStep": 0, "error": None,
              "permanent": False}
    done = {"terminated": {"exitCode": 0, "finishedAt": ts(c.now)}}
    c.pods[pod]["status"] = {"phase": "Succeeded", "containerStatuses": [{"name": "trainer", "state": done}],
                             "initContainerStatuses": [{"name": "splitfeed-sidecar", "state": {"terminated": {
                                 "exitCode": 0, "message": json.dumps(report), "finishedAt": ts(c.now)}}}]}


def serves(epoch: int, replicas: int, resume: int) -> messages.Status:
    """The next world's coordinator's `status` answer before any rank took a batch (worlds.request_status)."""
    return status_answer(world_epoch=epoch, replicas=replicas, reporting=0, resume_step=resume)


def test_pods_are_named_by_replica_and_odd_worlds_use_the_other_ports():
    job = Cluster(replicas=2, rescale="inPlace").job
    pod = planning.pod(job, 3, 1, OWNER, SETTINGS)
    assert pod["metadata"]["name"] == pod["spec"]["hostname"] == "resnet-r1"
    sidecar, trainer = env_of(pod, "splitfeed-sidecar"), env_of(pod, "trainer")
    assert sidecar["SPLITFEED_COORDINATOR"] == "tcp://resnet-r0.resnet:29511"
    assert (trainer["MASTER_ADDR"], trainer["MASTER_PORT"], trainer["SPLITFEED_WORLD_EPOCH"]) == (
        "resnet-r0.resnet", "29510", "3")
    even = env_of(planning.pod(job, 4, 1, OWNER, SETTINGS), "splitfeed-sidecar")
    assert (even["SPLITFEED_COORDINATOR"], even["MASTER_PORT"]) == ("tcp://resnet-r0.resnet:29501", "29500")
    ports = {p["name"]: p["port"] for p in planning.service(job, OWNER)["spec"]["ports"]}
    assert ports == {"rendezvous": 29500, "coordinator": 29501, "rendezvous-odd": 29510, "coordinator-odd": 29511}


def test_the_sidecar_is_ready_once_every_local_ranks_trainer_said_hello():
    one = planning.pod(Cluster(replicas=2, rescale="inPlace").job, 0, 0, OWNER, SETTINGS)
    two = planning.pod(Cluster(replicas=2, gpusPerReplica=2, rescale="inPlace").job, 0, 0, OWNER, SETTINGS)
    probes = [next(c for c in p["spec"]["initContainers"] if c["name"] == "splitfeed-sidecar")["readinessProbe"]
              for p in (one, two)]
    assert probes[0]["exec"]["command"] == ["test", "-e", "/var/run/splitfeed/trainer-0.waiting"]
    assert probes[1]["exec"]["command"] == ["test", "-e", "/var/run/splitfeed/trainer-0.waiting", "-a",
                                            "-e", "/var/run/splitfeed/trainer-1.waiting"]


def test_a_scale_down_keeps_the_staying_pods_and_deletes_those_that_left_once_the_next_world_serves():
    c = in_place(4)
    kept = {n: c.pods[n] for n in ("resnet-r0", "resnet-r1")}
    c.scale(2)
    d = c.step()
    assert d.step == "WaitingForCheckpoint" and not d.delete and not d.create
    assert c.status["drain"]["inPlace"] is True and c.status["drain"]["askedAt"]
    assert d.notify == ("tcp://10.0.0.1:29501", "rescale-w0", "rescale") and d.notify_replicas == 2
    assert {n: a["splitfeed.io/drain-replicas"] for n, a in d.annotate.items()} == {
        f"resnet-r{i}": "2" for i in range(4)}
    left(c, "resnet-r2", 37)
    left(c, "resnet-r3", 37)
    d = c.step()
    assert d.step == "WaitingForCheckpoint" and not d.delete  # world 1 does not serve yet
    c.next_world = serves(1, 2, 37)
    d = c.step()
    assert d.step == "Running" and sorted(d.delete) == ["resnet-r2", "resnet-r3"]
    assert (c.status["worldEpoch"], c.status["replicas"], c.status["worldSize"], c.status["resumeStep"]) == (
        1, 2, 2, 37)
    assert "drain" not in c.status and c.reason() == "RescaledInPlace"
    assert sorted(c.pods) == ["resnet-r0", "resnet-r1"]
    assert all(c.pods[n] is p for n, p in kept.items())  # the same objects: never deleted, never recreated
    assert c.epochs() == {1}
    c.next_world = None
    d = c.step()
    assert not d.delete and not d.create and not d.label


def test_a_scale_up_creates_the_new_pods_ahead_and_asks_only_once_their_trainers_are_ready():
    c = in_place(2)
    c.scale(4)
    d = c.step()
    assert d.step == "CheckpointRequested" and d.notify is None and not d.annotate
    assert sorted(o["metadata"]["name"] for o in d.create) == ["resnet-r2", "resnet-r3"]
    new = c.pods["resnet-r3"]
    assert new["metadata"]["labels"]["splitfeed.io/world-epoch"] == "1"
    assert env_of(new, "trainer")["WORLD_SIZE"] == "4" and env_of(new, "trainer")["MASTER_PORT"] == "29510"
    d = c.step()
    assert d.step == "CheckpointRequested" and not d.delete  # pods ahead of their world are not stale
    c.set_phase("Running", "resnet-r2", "resnet-r3")
    d = c.step()
    assert d.step == "CheckpointRequested" and d.notify is None  # running, but their trainers still import
    for name in ("resnet-r2", "resnet-r3"):
        c.pods[name]["status"]["conditions"] = [{"type": "Ready", "status": "True"}]  # the sidecar's probe passed
    d = c.step()
    assert d.step == "WaitingForCheckpoint" and d.notify_replicas == 4 and d.notify is not None
    assert sorted(d.annotate) == ["resnet-r0", "resnet-r1"]
    c.next_world = serves(1, 4, 12)
    d = c.step()
    assert d.step == "Running" and not d.delete
    assert sorted(d.label) == ["resnet-r0", "resnet-r1"]
    assert (c.status["worldEpoch"], c.status["replicas"], c.status["resumeStep"]) == (1, 4, 12)
    assert sorted(c.pods) == [f"resnet-r{i}" for i in range(4)] and c.epochs() == {1}


def test_a_scale_up_asks_anyway_when_the_new_pods_do_not_start_in_time():
    c = in_place(2)
    c.scale(3)
    c.step()
    c.now += datetime.timedelta(seconds=59)
    assert c.step().notify is None
    c.now += datetime.timedelta(seconds=2)
    assert c.step().notify_replicas == 3


def test_a_second_scale_during_the_change_asks_for_the_newest_count_and_the_coordinator_decides():
    c = in_place(4)
    c.scale(2)
    c.step()
    c.scale(3)
    d = c.step()
    assert d.notify_replicas == 3 and c.status["drain"]["targetReplicas"] == 3
    assert {a["splitfeed.io/drain-replicas"] for a in d.annotate.values()} == {"3"}
    left(c, "resnet-r3", 20)
    c.next_world = serves(1, 3, 20)
    d = c.step()
    assert d.delete == ["resnet-r3"] and c.status["replicas"] == 3
    assert sorted(c.pods) == ["resnet-r0", "resnet-r1", "resnet-r2"]


def test_a_change_whose_target_and_request_time_were_lost_keeps_the_worlds_count_and_still_times_out():
    c = in_place(4)
    c.scale(2)
    c.step()
    c.scale(5)  # an invalid count: the change goes on with the one it has, here none
    del c.status["drain"]["targetReplicas"]
    c.status["drain"]["requestedAt"] = "garbage"
    seen = c.now
    d = c.step()
    assert d.step == "WaitingForCheckpoint" and c.status["drain"]["requestedAt"] == ts(seen)
    assert d.notify_replicas == 4 and c.status["drain"]["targetReplicas"] == 4
    c.now = seen + datetime.timedelta(seconds=60 + 60)  # checkpoint.timeoutSeconds + the new pods' time
    d = c.step()
    assert d.step == "RemovingOldWorld" and [e.reason for e in d.events] == ["InPlaceFailed"]
    assert "inPlace" not in c.status["drain"] and c.status["drain"]["requestedAt"] == ts(seen)


def test_the_coordinators_count_wins_over_the_spec_when_the_drain_was_committed_first():
    c = in_place(4)
    c.scale(2)
    c.step()
    c.scale(3)  # too late: world 1 already runs 2 replicas
    left(c, "resnet-r2", 9)
    left(c, "resnet-r3", 9)
    c.next_world = serves(1, 2, 9)
    c.step()
    assert (c.status["worldEpoch"], c.status["replicas"]) == (1, 2)
    c.next_world = None
    d = c.step()  # and then the next change, from 2 to 3, in place again
    assert c.status["drain"]["inPlace"] is True and c.status["drain"]["targetReplicas"] == 3
    assert [o["metadata"]["name"] for o in d.create] == ["resnet-r2"]
    assert c.pods["resnet-r2"]["metadata"]["labels"]["splitfeed.io/world-epoch"] == "2"


def test_an_operator_that_died_before_moving_the_labels_keeps_the_pods_and_moves_them_later():
    c = in_place(2)
    c.scale(2)
    c.status.update(worldEpoch=1)  # the status was written; the label patch never was
    d = c.step()
    assert not d.delete and d.label == {f"resnet-r{i}": {"splitfeed.io/world-epoch": "1"} for i in range(2)}
    assert c.epochs() == {1}


def test_a_pod_that_fails_during_the_change_restarts_the_world_and_the_next_waits_for_every_old_pod():
    c = in_place(2)
    c.scale(3)
    c.step()
    c.pods["resnet-r1"]["status"]["phase"] = "Failed"
    d = c.step(act=False)
    assert c.status["drain"]["reason"] == "Restart" and c.status["restarts"] == 1
    assert sorted(d.delete) == ["resnet-r0", "resnet-r1"]
    c.pods.pop("resnet-r0")
    c.pods.pop("resnet-r1")
    d = c.step(act=False)  # resnet-r2, created ahead, is stale now: deleted, and waited for
    assert d.delete == ["resnet-r2"] and not d.create and c.status["worldEpoch"] == 0
    c.pods.pop("resnet-r2")
    c.past_backoff()
    d = c.step()
    assert c.status["worldEpoch"] == 1 and sorted(o["metadata"]["name"] for o in d.create if o["kind"] == "Pod") == [
        "resnet-r0", "resnet-r1", "resnet-r2"]
    assert "SPLITFEED_RESUME" in env_of(c.pods["resnet-r0"], "splitfeed-sidecar")


def test_no_next_world_in_time_replaces_the_world_from_the_newest_checkpoint():
    c = in_place(4)
    c.scale(2)
    c.step()
    c.now += datetime.timedelta(seconds=60 + 60)  # checkpoint.timeoutSeconds + the new pods' start
    d = c.step()
    assert [e.reason for e in d.events] == ["InPlaceFailed"]
    assert c.status["drain"]["step"] == "RemovingOldWorld" and "inPlace" not in c.status["drain"]
    assert sorted(d.delete) == [f"resnet-r{i}" for i in range(4)] and "resumeStep" not in c.status


def test_recreate_stays_the_default_and_names_pods_by_world():
    c = Cluster(replicas=2)
    c.running()
    c.scale(3)
    d = c.step()
    assert d.step == "CheckpointRequested" and not d.create and d.notify_replicas == 0
    assert sorted(c.pods) == ["resnet-w0-0", "resnet-w0-1"]
    assert isinstance(d, deciding.Decision)


def test_a_job_that_ends_while_its_new_pods_start_succeeds_and_the_new_pods_go():
    c = in_place(2)
    c.scale(3)
    c.step()
    for name in ("resnet-r0", "resnet-r1"):
        report = {"globalStep": 200, "stepsPerEpoch": 100, "drained": False, "agreedStep": None, "error": None}
        c.pods[name]["status"] = {"phase": "Succeeded", "containerStatuses": [], "initContainerStatuses": [
            {"name": "splitfeed-sidecar", "state": {"terminated": {"exitCode": 0, "message": json.dumps(report),
                                                                  "finishedAt": ts(c.now)}}}]}
    d = c.step()
    assert c.status["phase"] == "Succeeded" and d.delete == ["resnet-r2"] and "drain" not in c.status
    assert c.reason("Complete") == "AllPodsSucceeded"


def test_a_job_whose_world_drains_at_its_last_step_for_a_scale_up_succeeds_and_the_new_pods_go():
    """The drain for a scale-up came so late that the agreement cut at the job's end (seen end to
    end under load): the kept pods end drained at the last step, no next world follows, and the
    new replica's pod, still waiting for one, must not fail the job into a restart."""
    c = in_place(2)
    c.scale(3)
    c.step()
    for name in ("resnet-r0", "resnet-r1"):
        left(c, name, 200)  # 100 steps an epoch, 2 epochs: drained at step 200, the end
    d = c.step()
    assert c.status["phase"] == "Succeeded" and d.delete == ["resnet-r2"] and "drain" not in c.status
    assert c.status.get("restarts", 0) == 0 and c.reason("Complete") == "AllPodsSucceeded"


def test_a_new_replica_whose_name_an_earlier_pod_still_holds_is_waited_for_before_the_world_is_asked():
    c = in_place(4)
    c.scale(2)
    c.step()
    left(c, "resnet-r2", 30)
    left(c, "resnet-r3", 30)
    c.next_world = serves(1, 2, 30)
    c.step(act=False)  # the leaving pods are deleted, but the kubelet has not removed them yet
    c.next_world = None
    c.pods["resnet-r2"]["metadata"]["deletionTimestamp"] = ts(c.now)
    c.scale(3)
    d = c.step()
    assert not d.create and d.notify is None and not d.annotate  # resnet-r2 of world 0 is still there
    assert "resnet-r3" not in c.pods  # not in any world: deleted
    c.pods.pop("resnet-r2")  # the kubelet removed it
    d = c.step()
    assert [o["metadata"]["name"] for o in d.create] == ["resnet-r2"] and d.notify is None
    assert c.pods["resnet-r2"]["metadata"]["labels"]["splitfeed.io/world-epoch"] == "2"
