"""The world life cycle as a pure function, walked step by step against an in-memory cluster."""

from __future__ import annotations

import copy
import datetime
import json

import pytest

from splitfeed.operator.lifecycle import deciding
from splitfeed.operator.objects import planning
from splitfeed.trainer_client.contract import wellknown, specs
from tests.support.builders import OWNER, T0, manifest
from tests.support.memory_cluster import SETTINGS, STATUS_SCHEMA, Cluster, assert_declared, merge, ts


# --- starting -----------------------------------------------------------------------------


def test_first_world_is_epoch_zero_with_all_objects():
    c = Cluster()
    d = c.step()
    assert d.step == "StartingNewWorld"
    assert c.status["phase"] == "Running" and c.status["worldEpoch"] == 0
    assert (c.status["replicas"], c.status["worldSize"]) == (4, 4)
    assert sorted(c.pods) == [f"resnet-w0-{i}" for i in range(4)]
    assert set(c.others) == {"ConfigMap/resnet-data", "Service/resnet", "PodDisruptionBudget/resnet"}
    assert c.status["allowedReplicas"] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    assert c.status["selector"] == "splitfeed.io/job=resnet"
    assert c.reason("Validated") == "Valid"


def test_ready_follows_the_pods_and_steady_state_patches_nothing():
    c = Cluster()
    c.step()
    assert c.reason("Ready") == "PodsStarting"
    c.step()
    assert c.reason("Ready") == "PodsPending"
    c.set_phase("Running")
    c.step()
    assert c.reason("Ready") == "AllPodsRunning"
    d = c.step()
    assert d.status == {} and not d.create and not d.delete and not d.events and d.requeue_s is None


def test_a_crash_after_the_status_write_recreates_the_missing_pods():
    c = Cluster()
    c.step(act=False)  # status says world 0 runs; no pod was created
    assert c.pods == {}
    d = c.step()
    assert sorted(o["metadata"]["name"] for o in d.create if o["kind"] == "Pod") == [
        f"resnet-w0-{i}" for i in range(4)]
    assert c.status["worldEpoch"] == 0


def test_an_invalid_new_job_fails_permanently_without_pods():
    c = Cluster(replicas=5)
    d = c.step()
    assert d.permanent_error and "Valid replica counts" in d.permanent_error
    assert c.status["phase"] == "Failed" and c.reason("Validated") == "InvalidSpec"
    assert c.pods == {}
    assert [e.reason for e in d.events] == ["InvalidSpec"]
    assert not c.step().events  # no repeated warning for the same message


def test_fixing_an_invalid_spec_starts_the_job():
    c = Cluster(replicas=5)
    c.step()
    assert not deciding.is_terminal(c.status)
    c.scale(6)
    c.step()
    assert c.status["phase"] == "Running" and c.status["replicas"] == 6 and len(c.pods) == 6


# --- rescale --------------------------------------------------------------------------------

def walk_rescale(c: Cluster, target: int) -> list[str]:
    c.scale(target)
    steps = [c.step().step]
    assert all(p["metadata"]["annotations"]["splitfeed.io/drain"] == "rescale-w0" for p in c.pods.values())
    steps.append(c.step().step)
    c.set_phase("Succeeded")  # the trainers checkpointed and exited 0
    steps += [c.step().step, c.step().step, c.step().step]
    return steps


def test_rescale_walks_every_phase_to_a_new_world():
    c = Cluster().running()
    steps = walk_rescale(c, 8)
    assert steps == ["CheckpointRequested", "WaitingForCheckpoint", "RemovingOldWorld",
                     "StartingNewWorld", "Running"]
    assert c.status["phase"] == "Running" and c.status["worldEpoch"] == 1
    assert c.status["replicas"] == 8 and c.status["worldSize"] == 8
    assert c.epochs() == {1} and len(c.pods) == 8
    assert "drain" not in c.status and c.reason() == "RescaleComplete"
    reasons = [e.reason for d in c.log for e in d.events]
    assert reasons[-5:] == ["CheckpointRequested", "Drained", "ResumeFromLatest", "StartingNewWorld",
                            "RescaleComplete"]  # these pods report nothing, so no step was agreed


def test_the_status_shows_each_step_as_the_rescaling_reason():
    c = Cluster().running()
    c.scale(2)
    seen = []
    for _ in range(2):
        c.step()
        seen.append((c.status["phase"], c.reason()))
    c.set_phase("Succeeded")
    for _ in range(3):
        c.step()
        seen.append((c.status["phase"], c.reason()))
    assert seen == [("Rescaling", "CheckpointRequested"), ("Rescaling", "WaitingForCheckpoint"),
                    ("Rescaling", "RemovingOldWorld"), ("Rescaling", "StartingNewWorld"),
                    ("Running", "RescaleComplete")]


def test_waiting_requeues_and_does_not_reannotate():
    c = Cluster().running()
    c.scale(8)
    c.step()
    d = c.step()
    assert d.step == "WaitingForCheckpoint" and d.annotate == {} and 0 < d.requeue_s <= 2
    c.set_phase("Succeeded", "resnet-w0-0")
    c.step()
    assert "1/4 pods" in [x for x in c.status["conditions"] if x["type"] == "Rescaling"][0]["message"]


def test_checkpoint_timeout_removes_the_world_with_a_warning():
    c = Cluster().running()
    c.scale(8)
    c.step()
    c.now += datetime.timedelta(seconds=59)
    assert c.step().step == "WaitingForCheckpoint"
    c.now += datetime.timedelta(seconds=1)
    d = c.step()
    assert d.step == "RemovingOldWorld" and [e.reason for e in d.events] == ["CheckpointTimeout"]
    assert d.events[0].type == "Warning" and not c.pods
    c.step(), c.step()
    assert c.status["worldEpoch"] == 1 and c.status["replicas"] == 8


def test_a_failed_pod_during_a_drain_counts_as_drained():
    c = Cluster().running()
    c.scale(2)
    c.step()
    c.set_phase("Succeeded")
    c.set_phase("Failed", "resnet-w0-3")
    assert c.step().step == "RemovingOldWorld"
    assert c.status.get("restarts") is None


def test_scaling_again_during_a_drain_starts_the_latest_count():
    c = Cluster().running()
    c.scale(8)
    c.step()
    c.scale(12)
    c.set_phase("Succeeded")
    for _ in range(3):
        c.step()
    assert c.status["replicas"] == 12 and len(c.pods) == 12


def test_an_invalid_scale_keeps_the_world_running_and_says_why():
    c = Cluster().running()
    c.scale(5)
    d = c.step()
    assert d.step == "Running" and not d.annotate
    assert c.status["phase"] == "Running" and c.reason("Validated") == "InvalidSpec"
    assert "[1, 2, 3, 4, 6, 8, 12, 16, 24, 48]" in d.events[0].message
    c.scale(4)
    c.step()
    assert c.reason("Validated") == "Valid"


def test_an_invalid_count_during_a_drain_falls_back_to_the_requested_one():
    c = Cluster().running()
    c.scale(8)
    c.step()
    c.scale(5)
    c.set_phase("Succeeded")
    for _ in range(3):
        c.step()
    assert c.status["replicas"] == 8


# --- idempotency: an operator restarted at any point finishes the job ------------------------

@pytest.mark.parametrize("crash_at", range(5))
def test_a_crash_between_status_and_actions_at_any_step_still_finishes(crash_at):
    c = Cluster().running()
    c.scale(8)
    for i in range(8):
        c.step(act=i != crash_at)
        if c.status.get("drain", {}).get("step") == "WaitingForCheckpoint":
            c.set_phase("Succeeded", *[n for n in c.pods if n.startswith("resnet-w0")])
    for _ in range(3):
        c.step()
    assert c.status["phase"] == "Running" and c.status["worldEpoch"] == 1
    assert c.epochs() == {1} and len(c.pods) == 8 and "drain" not in c.status


@pytest.mark.parametrize("repeat_at", range(5))
def test_running_a_step_twice_changes_nothing_more(repeat_at):
    c = Cluster().running()
    c.scale(8)
    c.step()
    c.set_phase("Succeeded")
    for i in range(5):
        c.step()
        if i == repeat_at:
            c.step()
    assert c.status["worldEpoch"] == 1 and c.status["phase"] == "Running" and len(c.pods) == 8


def test_old_world_pods_that_survive_are_removed():
    c = Cluster().running()
    stray = copy.deepcopy(c.pods["resnet-w0-0"])
    stray["metadata"]["name"] = "resnet-w9-0"
    stray["metadata"]["labels"]["splitfeed.io/world-epoch"] = "9"
    c.pods["resnet-w9-0"] = stray
    assert c.step().delete == ["resnet-w9-0"]


# --- suspend ---------------------------------------------------------------------------------

def test_suspend_drains_and_stops_then_resume_starts_a_new_world():
    c = Cluster().running()
    c.manifest["spec"]["suspend"] = True
    assert c.step().annotate["resnet-w0-0"] == {"splitfeed.io/drain": "suspend-w0"}
    c.set_phase("Succeeded")
    c.step(), c.step()
    assert c.status["phase"] == "Suspended" and not c.pods and c.status["replicas"] == 0
    assert c.step().status == {}
    c.manifest["spec"]["suspend"] = False
    c.step()
    assert c.status["phase"] == "Running" and c.status["worldEpoch"] == 1 and len(c.pods) == 4
    assert c.reason() == "Resumed"


def test_a_job_created_suspended_starts_no_world():
    c = Cluster(suspend=True)
    c.step()
    assert c.status["phase"] == "Suspended" and not c.pods and "worldEpoch" not in c.status
    c.manifest["spec"]["suspend"] = False
    c.step()
    assert c.status["worldEpoch"] == 0 and len(c.pods) == 4


# --- failures and completion ----------------------------------------------------------------

def test_a_failed_pod_restarts_the_whole_world_and_counts_it():
    c = Cluster(maxRestarts=2).running()
    c.set_phase("Failed", "resnet-w0-2")
    d = c.step()
    assert d.step == "RemovingOldWorld" and c.status["restarts"] == 1
    assert d.events[0].type == "Warning" and "resnet-w0-2 failed" in d.events[0].message
    assert not c.pods
    assert c.step().step == "BackingOff" and c.reason() == "BackingOff"
    assert c.status["nextRestartAt"] == "2026-01-01T12:00:10Z" and "not before 2026-01-01T12:00:10Z" in d.events[0].message
    c.past_backoff()
    c.step(), c.step()
    assert c.status["worldEpoch"] == 1 and c.status["phase"] == "Running" and len(c.pods) == 4
    assert c.reason() == "WorldRestarted" and "nextRestartAt" not in c.status


def test_a_vanished_pod_of_a_started_world_is_a_failure():
    c = Cluster().running()
    del c.pods["resnet-w0-1"]
    c.step()
    assert c.status["restarts"] == 1


def test_a_trainer_that_exited_non_zero_fails_its_pod_while_a_plain_sidecar_still_runs():
    """--sidecar-mode container, restartPolicy Never: nothing restarts the trainer, the pod stays Running."""
    c = Cluster().running()
    exited = T0 - datetime.timedelta(seconds=deciding.REPORT_GRACE_S)
    c.pods["resnet-w0-1"]["status"] = {"phase": "Running", "containerStatuses": [
        {"name": "trainer", "state": {"terminated": {"exitCode": 137, "finishedAt": ts(exited)}}},
        {"name": "splitfeed-sidecar", "state": {"running": {}}}]}
    d = c.step()
    assert d.step == "RemovingOldWorld" and c.status["restarts"] == 1
    assert "resnet-w0-1 failed" in d.events[0].message


def trainer_exited_sidecar_running(c: Cluster, pod: str) -> None:
    c.pods[pod]["status"] = {"phase": "Running", "containerStatuses": [
        {"name": "trainer", "state": {"terminated": {"exitCode": 1, "finishedAt": ts(c.now)}}},
        {"name": "splitfeed-sidecar", "state": {"running": {}}}]}


def test_a_data_error_reported_just_after_the_trainer_exits_still_spends_no_restart():
    """The sidecar tells its trainer first and writes its report a moment later (the race CI once hit)."""
    c = Cluster(maxRestarts=3).running()
    trainer_exited_sidecar_running(c, "resnet-w0-2")
    c.now += datetime.timedelta(seconds=1)
    d = c.step()
    assert d.step == "AwaitingSidecarReport" and d.delete == [] and d.requeue_s
    assert c.status.get("restarts") is None and c.reason("Ready") == "AwaitingSidecarReport"
    report = {"globalStep": 0, "error": "table spec.data.table='nope' does not exist", "permanent": True}
    c.pods["resnet-w0-2"]["status"]["containerStatuses"][1]["state"] = {
        "terminated": {"exitCode": 2, "message": json.dumps(report), "finishedAt": ts(c.now)}}
    c.now += datetime.timedelta(seconds=2)
    c.step()
    assert c.status["phase"] == "Failed" and c.reason("Failed") == "DataError"
    assert c.status.get("restarts") is None


def test_a_sidecar_that_never_reports_delays_the_restart_by_the_grace_only():
    c = Cluster(maxRestarts=3).running()
    trainer_exited_sidecar_running(c, "resnet-w0-0")
    c.now += datetime.timedelta(seconds=deciding.REPORT_GRACE_S - 1)
    assert c.step().step == "AwaitingSidecarReport"
    c.now += datetime.timedelta(seconds=1)
    assert c.step().step == "RemovingOldWorld" and c.status["restarts"] == 1


def test_a_lost_pod_restarts_at_once_even_while_another_awaits_its_report():
    c = Cluster(maxRestarts=3).running()
    trainer_exited_sidecar_running(c, "resnet-w0-0")
    c.set_phase("Running", "resnet-w0-1")
    del c.pods["resnet-w0-3"]
    assert c.step().step == "RemovingOldWorld" and c.status["restarts"] == 1


def test_a_permanent_data_error_fails_the_job_without_spending_the_restart_budget():
    c = Cluster(maxRestarts=3).running()
    report = {"globalStep": 0, "epoch": 0, "step": 0, "lastCheckpoint": None, "drained": False,
              "error": "table spec.data.table='nope' does not exist", "permanent": True}
    c.pods["resnet-w0-2"]["status"] = {"phase": "Running", "containerStatuses": [
        {"name": "trainer", "state": {"running": {}}},
        {"name": "splitfeed-sidecar", "state": {"terminated": {"exitCode": 2, "message": json.dumps(report)}}}]}
    d = c.step()
    assert c.status["phase"] == "Failed" and c.reason("Failed") == "DataError"
    assert c.status.get("restarts") is None
    assert "'nope' does not exist" in d.events[0].message and d.events[0].reason == "DataError"
    assert deciding.is_terminal(c.status)


def test_the_restart_budget_ends_in_failed_with_the_reason():
    c = Cluster(maxRestarts=1).running()
    c.set_phase("Failed", "resnet-w0-0")
    c.step(), c.step()
    c.past_backoff().step(), c.step()
    c.set_phase("Running")
    report = {"globalStep": 7, "epoch": 0, "step": 7, "lastCheckpoint": None, "drained": False,
              "error": "table has 10 rows < numSplits 48"}
    c.pods["resnet-w1-3"]["status"] = {"phase": "Failed", "initContainerStatuses": [
        {"name": "splitfeed-sidecar", "state": {"terminated": {"exitCode": 1, "message": json.dumps(report)}}}]}
    d = c.step()
    assert c.status["phase"] == "Failed" and c.reason("Failed") == "RestartLimitExceeded"
    msg = [x for x in c.status["conditions"] if x["type"] == "Failed"][0]["message"]
    assert "table has 10 rows" in msg and "1/1 restarts" in msg
    assert sorted(d.delete) == [f"resnet-w1-{i}" for i in range(3)]
    assert deciding.is_terminal(c.status)
    assert c.step().status == {}


def test_all_pods_succeeded_without_a_drain_is_success():
    c = Cluster().running()
    c.set_phase("Succeeded")
    d = c.step()
    assert c.status["phase"] == "Succeeded" and c.reason("Complete") == "AllPodsSucceeded"
    assert [e.reason for e in d.events] == ["Succeeded"]
    assert deciding.is_terminal(c.status)
    c.scale(8)
    assert c.step().annotate == {}


def test_sidecar_reports_become_progress_and_last_checkpoint():
    c = Cluster().running()
    for i, (step, ck) in enumerate([(120, 100), (121, 100), (119, 90), (121, 100)]):
        report = {"globalStep": step, "epoch": 0, "step": step, "drained": True, "error": None,
                  "lastCheckpoint": {"step": ck, "epoch": 0, "worldSize": 4}}
        c.pods[f"resnet-w0-{i}"]["status"] = {"phase": "Succeeded", "initContainerStatuses": [
            {"name": "splitfeed-sidecar", "state": {"terminated": {
                "exitCode": 0, "message": json.dumps(report), "finishedAt": "2026-01-01T12:00:05Z"}}}]}
    c.step()
    assert c.status["progress"] == {"globalStep": 121, "epoch": 0, "step": 121}
    assert c.status["lastCheckpoint"] == {"step": 100, "epoch": 0, "worldSize": 4, "time": "2026-01-01T12:00:05Z"}


def test_conditions_keep_their_transition_time_while_unchanged():
    c = Cluster().running()
    before = {x["type"]: x["lastTransitionTime"] for x in c.status["conditions"]}
    c.now += datetime.timedelta(minutes=5)
    c.step()
    after = {x["type"]: x["lastTransitionTime"] for x in c.status["conditions"]}
    assert before == after


def test_an_unparseable_spec_fails_a_new_job_but_spares_a_running_world():
    from splitfeed.operator.objects import admission
    problem = admission.Rejected("field spec.data.table", "spec.data.table: is required")
    d = deciding.rejected({}, problem, now=T0)
    assert d.status["phase"] == "Failed" and d.permanent_error and d.events[0].reason == "InvalidSpec"
    running = Cluster().running()
    d = deciding.rejected(running.status, problem, now=T0)
    assert "phase" not in d.status and d.status["conditions"][0]["reason"] == "InvalidSpec"
    again = deciding.rejected(merge(running.status, d.status), problem, now=T0)
    assert again.status == {} and again.events == []


@pytest.mark.parametrize("suspend", [False, True], ids=["rescale", "suspend"])
def test_without_status_drain_in_the_schema_the_conditions_carry_the_drain(suspend):
    c = Cluster(prune=True).running()
    if suspend:
        c.manifest["spec"]["suspend"] = True
    else:
        c.scale(8)
    c.step()
    assert c.status["phase"] == "Rescaling" and "drain" not in c.status
    assert c.step().step == "WaitingForCheckpoint"
    c.now += datetime.timedelta(seconds=61)  # the timeout counts from the condition's transition
    assert c.step().step == "RemovingOldWorld"
    for _ in range(3):
        c.step()
    if suspend:
        assert c.status["phase"] == "Suspended" and not c.pods
    else:
        assert (c.status["phase"], c.status["worldEpoch"], len(c.pods)) == ("Running", 1, 8)


@pytest.mark.parametrize("lost", [None, "yesterday", "2026-01-01T12:00:00"], ids=["absent", "garbage", "no-zone"])
def test_a_drain_whose_request_time_and_token_were_lost_times_out_from_when_it_was_seen(lost):
    c = Cluster().running()
    c.scale(8)
    c.step()
    c.status["drain"].pop("token")
    if lost is None:
        c.status["drain"].pop("requestedAt")
    else:
        c.status["drain"]["requestedAt"] = lost
    c.now += datetime.timedelta(seconds=30)
    seen = c.now
    d = c.step()
    assert d.step == "WaitingForCheckpoint"
    assert c.status["drain"]["requestedAt"] == ts(seen)  # written back: the deadline stays put
    assert c.status["drain"]["token"] == "rescale-w0" and d.annotate == {}  # the token the pods carry
    c.now = seen + datetime.timedelta(seconds=59)
    assert c.step().step == "WaitingForCheckpoint"
    c.now = seen + datetime.timedelta(seconds=60)
    d = c.step()
    assert d.step == "RemovingOldWorld" and [e.reason for e in d.events] == ["CheckpointTimeout"]
    c.step(), c.step()
    assert (c.status["phase"], c.status["worldEpoch"], c.status["replicas"]) == ("Running", 1, 8)


def test_an_invalid_count_during_a_drain_whose_target_was_lost_keeps_the_worlds_count():
    c = draining(8)
    c.status["drain"]["targetReplicas"] = "eight"
    c.scale(5)
    c.set_phase("Succeeded")
    assert [c.step().step for _ in range(3)] == ["RemovingOldWorld", "StartingNewWorld", "Running"]
    assert (c.status["worldEpoch"], c.status["replicas"], len(c.pods)) == (1, 4, 4)


# --- the agreed step: where the next world resumes (docs/agreement.md) ----------------------

def drained_report(c: Cluster, pod: str, *, agreed: int | None = 7, drained: bool = True,
                   reason: str = "rescale", phase: str = "Succeeded") -> None:
    """The pod stopped; its sidecar's termination report says where its ranks committed."""
    report = {"globalStep": agreed or 0, "epoch": 0, "step": agreed or 0, "stepsPerEpoch": 100,
              "lastCheckpoint": None, "drained": drained, "agreedStep": agreed, "drainReason": reason,
              "resumeStep": 0, "error": None, "permanent": False}
    done = {"terminated": {"exitCode": 0, "finishedAt": ts(c.now)}}
    c.pods[pod]["status"] = {"phase": phase, "containerStatuses": [{"name": "trainer", "state": done}],
                             "initContainerStatuses": [{"name": "splitfeed-sidecar", "state": {"terminated": {
                                 "exitCode": 0, "message": json.dumps(report), "finishedAt": ts(c.now)}}}]}


def sidecar_env(pod: dict) -> dict[str, str]:
    (side,) = [x for x in pod["spec"]["initContainers"] if x["name"] == "splitfeed-sidecar"]
    return {e["name"]: e["value"] for e in side["env"]}


def events(d: deciding.Decision, reason: str) -> list[deciding.Event]:
    return [e for e in d.events if e.reason == reason]


def draining(target: int = 8) -> Cluster:
    """World 0 (4 pods) asked to drain for a rescale to `target`; waiting for its pods."""
    c = Cluster().running()
    c.scale(target)
    c.step()
    assert c.step().step == "WaitingForCheckpoint"
    return c


def test_every_pod_drained_at_one_step_is_recorded_before_the_next_world_starts_there():
    c = draining()
    for name in list(c.pods):
        drained_report(c, name, agreed=7)
    d = c.step()
    assert d.step == "RemovingOldWorld" and len(d.delete) == 4
    assert d.status["resumeStep"] == 7  # in the patch written before the pods (and reports) go
    (chosen,) = events(d, "ResumeStepChosen")
    assert chosen.type == "Normal"
    assert "world 0" in chosen.message and "world 1" in chosen.message and "step 7" in chosen.message
    d = c.step()
    assert d.step == "StartingNewWorld" and c.status["resumeStep"] == 7
    new = [o for o in d.create if o["kind"] == "Pod"]
    assert len(new) == 8
    for pod in new:
        env = sidecar_env(pod)
        assert env["SPLITFEED_RESUME_STEP"] == "7" and "SPLITFEED_RESUME" not in env
        assert env["SPLITFEED_COORDINATOR"] == "tcp://resnet-w1-0.resnet:29501"
    assert "resuming at step 7" in events(d, "StartingNewWorld")[0].message
    c.step()
    assert (c.status["phase"], c.status["worldEpoch"], c.status["resumeStep"]) == ("Running", 1, 7)


def test_the_resume_step_is_read_once_a_crash_before_the_deletes_does_not_reread_it():
    c = draining()
    for name in list(c.pods):
        drained_report(c, name, agreed=7)
    c.step(act=False)  # status written, pods not deleted
    drained_report(c, "resnet-w0-3", agreed=9)  # whatever the pods say now was not what was decided on
    d = c.step()
    assert d.step == "RemovingOldWorld" and "resumeStep" not in d.status and not d.events
    c.step(), c.step()
    assert c.status["resumeStep"] == 7
    assert {sidecar_env(p)["SPLITFEED_RESUME_STEP"] for p in c.pods.values()} == {"7"}


@pytest.mark.parametrize("odd", ["disagrees", "not-drained", "no-report", "gone"])
def test_one_pod_that_does_not_confirm_the_step_means_resume_from_latest(odd):
    c = draining()
    c.status["resumeStep"] = 3  # from an earlier rescale: must not survive into the next world
    for name in list(c.pods):
        drained_report(c, name, agreed=7)
    if odd == "disagrees":
        drained_report(c, "resnet-w0-2", agreed=8)
    elif odd == "not-drained":
        drained_report(c, "resnet-w0-2", agreed=None, drained=False, phase="Failed")
    elif odd == "no-report":
        c.pods["resnet-w0-2"]["status"] = {"phase": "Succeeded"}
    else:
        del c.pods["resnet-w0-2"]
    d = c.step()
    assert d.step == "RemovingOldWorld"
    assert "resumeStep" in d.status and d.status["resumeStep"] is None  # the merge patch deletes it
    (latest,) = events(d, "ResumeFromLatest")
    assert latest.type == "Warning" and "newest complete checkpoint" in latest.message
    assert {"disagrees": "disagree", "not-drained": "resnet-w0-2 did not drain",
            "no-report": "resnet-w0-2 left no sidecar report", "gone": "resnet-w0-2 is gone"}[odd] \
        in latest.message
    assert not events(d, "ResumeStepChosen")
    c.step()
    assert "resumeStep" not in c.status
    for pod in c.pods.values():
        env = sidecar_env(pod)
        assert env["SPLITFEED_RESUME"] == "latest" and "SPLITFEED_RESUME_STEP" not in env


def test_a_drain_that_times_out_clears_the_resume_step():
    c = draining()
    c.status["resumeStep"] = 3
    for name in ["resnet-w0-0", "resnet-w0-1", "resnet-w0-2"]:
        drained_report(c, name, agreed=7)
    c.now += datetime.timedelta(seconds=60)
    d = c.step()
    assert d.step == "RemovingOldWorld" and [e.reason for e in d.events] == ["CheckpointTimeout"]
    assert d.status["resumeStep"] is None and "no status.resumeStep" in d.events[0].message
    c.step()
    assert {sidecar_env(p)["SPLITFEED_RESUME"] for p in c.pods.values()} == {"latest"}


def test_a_suspend_keeps_the_agreed_step_for_the_world_that_resumes():
    c = Cluster().running()
    c.manifest["spec"]["suspend"] = True
    c.step()
    for name in list(c.pods):
        drained_report(c, name, agreed=11, reason="suspend")
    c.step(), c.step()
    assert c.status["phase"] == "Suspended" and c.status["resumeStep"] == 11
    c.manifest["spec"]["suspend"] = False
    c.step()
    assert c.status["worldEpoch"] == 1
    assert {sidecar_env(p)["SPLITFEED_RESUME_STEP"] for p in c.pods.values()} == {"11"}


def test_a_world_failure_clears_the_resume_step():
    c = draining()
    for name in list(c.pods):
        drained_report(c, name, agreed=7)
    for _ in range(3):
        c.step()
    assert c.status["resumeStep"] == 7 and c.status["worldEpoch"] == 1
    c.set_phase("Running")
    c.set_phase("Failed", "resnet-w1-5")
    d = c.step()
    assert d.step == "RemovingOldWorld" and c.status["restarts"] == 1
    assert d.status["resumeStep"] is None and "resumeStep" not in c.status
    c.past_backoff().step()
    assert c.status["worldEpoch"] == 2
    assert {sidecar_env(p)["SPLITFEED_RESUME"] for p in c.pods.values()} == {"latest"}
    assert not any("SPLITFEED_RESUME_STEP" in sidecar_env(p) for p in c.pods.values())


# --- a world that drained itself (SIGTERM: preemption, eviction) ---------------------------

def test_a_world_that_drained_itself_resumes_at_its_step_without_counting_a_restart():
    c = Cluster(maxRestarts=0).running()
    for name in list(c.pods):
        drained_report(c, name, agreed=12, reason="preempt")
    d = c.step()
    assert d.step == "RemovingOldWorld" and d.delete == [f"resnet-w0-{i}" for i in range(4)]
    assert d.status["resumeStep"] == 12 and "restarts" not in c.status
    (drained,) = events(d, "WorldDrained")
    assert drained.type == "Normal" and "preempt" in drained.message and "world 0" in drained.message
    assert len(events(d, "ResumeStepChosen")) == 1 and not events(d, "WorldFailed")
    assert c.status["phase"] == "Rescaling" and not c.pods
    c.step(), c.step()
    assert (c.status["phase"], c.status["worldEpoch"], len(c.pods)) == ("Running", 1, 4)
    assert c.reason() == "WorldReplaced" and "restarts" not in c.status
    assert {sidecar_env(p)["SPLITFEED_RESUME_STEP"] for p in c.pods.values()} == {"12"}


def test_a_self_drain_waits_for_every_pod_and_an_evicted_pod_that_vanished_is_no_failure():
    c = Cluster().running()
    c.status["resumeStep"] = 3  # where this world started: must not be reused
    drained_report(c, "resnet-w0-0", agreed=12, reason="preempt")
    d = c.step()
    assert d.step == "WorldDraining" and not d.delete and c.status["phase"] == "Running"
    assert c.reason("Ready") == "WorldDraining" and 0 < d.requeue_s <= 2
    del c.pods["resnet-w0-3"]  # the evicted pod: removed from the API once it stopped
    assert c.step().step == "WorldDraining"
    for name in ["resnet-w0-1", "resnet-w0-2"]:
        drained_report(c, name, agreed=12, reason="preempt")
    d = c.step()
    assert d.step == "RemovingOldWorld" and "restarts" not in c.status
    assert d.status["resumeStep"] is None  # resnet-w0-3's ranks are unconfirmed
    assert "resnet-w0-3 is gone" in events(d, "ResumeFromLatest")[0].message
    c.step(), c.step()
    assert c.status["worldEpoch"] == 1 and len(c.pods) == 4


def test_a_self_drain_whose_other_pods_never_stop_is_replaced_after_the_timeout():
    c = Cluster().running()
    c.status["resumeStep"] = 3
    drained_report(c, "resnet-w0-0", agreed=12, reason="preempt")
    c.now += datetime.timedelta(seconds=59)
    assert c.step().step == "WorldDraining"
    c.now += datetime.timedelta(seconds=1)
    d = c.step()
    assert d.step == "RemovingOldWorld" and len(d.delete) == 4
    assert d.status["resumeStep"] is None and "restarts" not in c.status


def test_a_real_failure_during_a_self_drain_is_still_a_failure():
    c = Cluster().running()
    drained_report(c, "resnet-w0-0", agreed=12, reason="preempt")
    c.set_phase("Failed", "resnet-w0-1")
    d = c.step()
    assert d.step == "RemovingOldWorld" and c.status["restarts"] == 1
    assert "resnet-w0-1 failed" in events(d, "WorldFailed")[0].message


def test_a_pod_failed_by_a_cluster_disruption_restarts_the_world_without_counting():
    c = Cluster(maxRestarts=0).running()
    c.status["resumeStep"] = 3
    c.set_phase("Failed", "resnet-w0-1")
    c.pods["resnet-w0-1"]["status"]["conditions"] = [
        {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]
    d = c.step()
    assert d.step == "RemovingOldWorld" and "restarts" not in c.status
    assert [e.reason for e in d.events] == ["WorldDisrupted"] and d.status["resumeStep"] is None
    c.step(), c.step()
    assert (c.status["phase"], c.status["worldEpoch"]) == ("Running", 1) and "resumeStep" not in c.status


# --- the fast path: the drain sent straight to the coordinator ------------------------------

def with_ip(c: Cluster, pod: str, ip: str) -> None:
    c.pods[pod]["status"]["podIP"] = ip


def test_notify_names_replica_zeros_coordinator_only_while_a_drain_waits():
    c = Cluster().running()
    with_ip(c, "resnet-w0-0", "10.1.2.3")
    with_ip(c, "resnet-w0-1", "10.1.2.4")
    assert c.step().notify is None  # nothing to drain
    c.scale(8)
    d = c.step()
    assert d.step == "CheckpointRequested" and d.notify == ("tcp://10.1.2.3:29501", "rescale-w0", "rescale")
    d = c.step()
    assert d.step == "WaitingForCheckpoint" and d.notify == ("tcp://10.1.2.3:29501", "rescale-w0", "rescale")
    drained_report(c, "resnet-w0-0", agreed=7)  # replica 0 stopped: its coordinator is gone
    with_ip(c, "resnet-w0-0", "10.1.2.3")  # a terminated pod may still show its IP
    d = c.step()
    assert d.step == "WaitingForCheckpoint" and d.notify is None
    for name in list(c.pods):
        drained_report(c, name, agreed=7)
    assert c.step().notify is None  # RemovingOldWorld
    assert all(x.notify is None for x in [c.step(), c.step()])


def test_notify_waits_for_replica_zeros_ip_and_brackets_ipv6():
    c = Cluster().running()
    with_ip(c, "resnet-w0-1", "10.1.2.4")
    c.manifest["spec"]["suspend"] = True
    assert c.step().notify is None  # replica 0 has no IP yet: the annotation alone
    with_ip(c, "resnet-w0-0", "fd00::5")
    assert c.step().notify == ("tcp://[fd00::5]:29501", "suspend-w0", "suspend")


# --- failure policy: back-off, disruptions, in-place restarts (issue #9) ----------------------

def fail_and_restart(c: Cluster, pod: str) -> deciding.Decision:
    c.set_phase("Running")
    c.set_phase("Failed", pod)
    d = c.step()
    assert d.step == "RemovingOldWorld"
    return d


def test_each_counted_restart_doubles_the_back_off_up_to_the_cap():
    c = Cluster(maxRestarts=10)
    c.manifest["spec"]["maxRestarts"] = 10
    c.running()
    waits = []
    for world in range(6):
        fail_and_restart(c, f"resnet-w{world}-0")
        at = datetime.datetime.fromisoformat(c.status["nextRestartAt"].replace("Z", "+00:00"))
        waits.append((at - c.now).total_seconds())
        assert c.step().step == "BackingOff"
        c.now = at - datetime.timedelta(seconds=1)
        assert c.step().step == "BackingOff" and not c.pods  # nothing starts early
        c.past_backoff()
        c.step(), c.step()
        assert c.status["worldEpoch"] == world + 1 and "nextRestartAt" not in c.status
    assert waits == [10, 20, 40, 80, 160, 320]
    assert planning.Settings().backoff_s(7) == 360 and planning.Settings(restart_backoff_s=0).backoff_s(3) == 0


def test_a_suspend_during_the_back_off_suspends_at_once():
    c = Cluster().running()
    fail_and_restart(c, "resnet-w0-1")
    assert c.step().step == "BackingOff"
    c.manifest["spec"]["suspend"] = True
    c.step()
    assert c.status["phase"] == "Suspended" and not c.pods


def disrupt(c: Cluster, pod: str, reason: str = "EvictionByEvictionAPI") -> None:
    c.pods[pod]["status"].setdefault("conditions", []).append(
        {"type": "DisruptionTarget", "status": "True", "reason": reason})


def test_one_disrupted_pod_makes_the_whole_world_failure_uncounted_and_undelayed():
    """One lost rank takes its DDP peers down: the peers fail without the condition."""
    c = Cluster(maxRestarts=0).running()
    c.set_phase("Failed", "resnet-w0-1", "resnet-w0-2")
    disrupt(c, "resnet-w0-1", "PreemptionByScheduler")
    d = c.step()
    assert d.step == "RemovingOldWorld" and "restarts" not in c.status and "nextRestartAt" not in c.status
    assert [e.reason for e in d.events] == ["WorldDisrupted"] and "PreemptionByScheduler" in d.events[0].message
    c.step(), c.step()
    assert (c.status["phase"], c.status["worldEpoch"]) == ("Running", 1)


def test_a_disruption_seen_while_the_pod_runs_covers_the_pod_vanishing_later():
    c = Cluster(maxRestarts=0).running()
    disrupt(c, "resnet-w0-3", "TerminationByKubelet")  # being evicted: still running, then gone
    d = c.step()
    assert d.status["lastDisruption"] == {"worldEpoch": 0, "pod": "resnet-w0-3", "reason": "TerminationByKubelet",
                                          "time": "2026-01-01T12:00:00Z"}
    assert c.step().status == {}  # recorded once
    del c.pods["resnet-w0-3"]
    d = c.step()
    assert d.step == "RemovingOldWorld" and "restarts" not in c.status
    assert "disrupted by the cluster (resnet-w0-3: TerminationByKubelet)" in d.events[0].message
    c.step(), c.step()
    assert c.status["worldEpoch"] == 1
    c.set_phase("Running")
    del c.pods["resnet-w1-0"]  # the record is world 0's: a loss in world 1 counts
    c.step()
    assert c.status["phase"] == "Failed" and c.reason("Failed") == "RestartLimitExceeded"


def restart_in_place(c: Cluster, pod: str, container: str = "trainer", count: int = 1) -> None:
    statuses = c.pods[pod]["status"].setdefault("containerStatuses", [])
    for cs in statuses:
        if cs["name"] == container:
            cs["restartCount"] = count
            return
    statuses.append({"name": container, "restartCount": count, "state": {"running": {}}})


def test_in_place_container_restarts_spend_the_budget_once_each_and_then_fail_the_job():
    c = Cluster(maxRestarts=2).running()
    restart_in_place(c, "resnet-w0-1")
    d = c.step()
    assert c.status["containerRestarts"] == 1 and "restarts" not in c.status
    assert c.status["observedContainerRestarts"] == {"worldEpoch": 0, "count": 1}
    assert [e.reason for e in d.events] == ["ContainerRestarted"] and "resnet-w0-1/trainer (1)" in d.events[0].message
    assert c.step().status == {}  # the same restartCount is not counted twice
    restart_in_place(c, "resnet-w0-3", "splitfeed-sidecar")
    c.step()
    assert c.status["containerRestarts"] == 2 and c.status["phase"] == "Running"
    restart_in_place(c, "resnet-w0-1", count=2)
    d = c.step()
    assert c.status["phase"] == "Failed" and c.reason("Failed") == "RestartLimitExceeded"
    assert "3/2 restarts, 3 of them in-place container restarts" in d.events[0].message
    assert sorted(d.delete) == [f"resnet-w0-{i}" for i in range(4)]


def test_in_place_restarts_and_world_restarts_share_one_budget():
    c = Cluster(maxRestarts=2).running()
    restart_in_place(c, "resnet-w0-0")
    c.step()
    fail_and_restart(c, "resnet-w0-2")
    assert (c.status["restarts"], c.status["containerRestarts"]) == (1, 1)
    c.step()
    c.past_backoff().step(), c.step()
    c.set_phase("Running")
    c.step()
    assert c.status["worldEpoch"] == 1 and c.status["phase"] == "Running"  # new world: restartCounts from 0
    c.set_phase("Failed", "resnet-w1-0")
    c.step()
    assert c.status["phase"] == "Failed" and "2/2 restarts" in c.status["conditions"][-1]["message"]


# --- objects the apiserver refuses to create --------------------------------------------------

def refused(c: Cluster, status: int, reason: str, message: str, kind: str = "Pod",
            name: str = "resnet-w0-2") -> deciding.Decision:
    d = deciding.creation_failed(c.job, c.status, deciding.CreationFailure(kind, name, status, reason, message),
                                  settings=SETTINGS, now=c.now, generation=1)
    assert_declared(d.status, STATUS_SCHEMA)
    c.status = merge(c.status, d.status)
    return d


def test_a_refused_pod_is_a_condition_with_the_apis_message_and_a_back_off():
    c = Cluster()
    c.step(act=False)  # status says world 0; the creation is refused by quota
    d = refused(c, 403, "Forbidden", 'pods "resnet-w0-2" is forbidden: exceeded quota: gpu')
    assert c.reason("PodCreationFailed") == "Forbidden" and c.reason("Ready") == "PodCreationFailed"
    msg = [x for x in c.status["conditions"] if x["type"] == "PodCreationFailed"][0]["message"]
    assert "exceeded quota: gpu" in msg and "retrying at 2026-01-01T12:00:10Z" in msg
    assert [e.reason for e in d.events] == ["PodCreationFailed"] and c.status["podCreation"]["failures"] == 1
    assert c.step().create == []  # nothing is created before retryAt
    c.now += datetime.timedelta(seconds=10)
    assert len([o for o in c.step(act=False).create if o["kind"] == "Pod"]) == 4  # retried: refused again
    refused(c, 403, "Forbidden", "exceeded quota")
    assert "back-off 20s" in [x for x in c.status["conditions"] if x["type"] == "PodCreationFailed"][0]["message"]
    c.now += datetime.timedelta(seconds=19)
    assert c.step().create == []
    c.now += datetime.timedelta(seconds=1)
    c.step()
    assert len(c.pods) == 4 and c.reason("PodCreationFailed") == "Forbidden"
    c.step()
    assert c.reason("PodCreationFailed") == "Created" and "podCreation" not in c.status


def test_a_pod_the_apiserver_calls_invalid_fails_the_job_and_removes_the_world():
    c = Cluster().running()
    c.scale(8)
    c.step()
    c.set_phase("Succeeded")
    c.step(), c.step(act=False)  # world 1 recorded; its pods are refused
    d = refused(c, 422, "Invalid", 'Pod "resnet-w1-0" is invalid: spec.containers[0].image: Required value',
                name="resnet-w1-0")
    assert c.status["phase"] == "Failed" and c.reason("Failed") == "InvalidPodTemplate"
    assert "spec.containers[0].image: Required value" in d.events[0].message
    assert deciding.is_terminal(c.status)
    c.pods["resnet-w1-3"] = merge(planning.pod(c.job, 1, 3, OWNER, SETTINGS), {"status": {"phase": "Pending"}})
    assert c.step().delete == ["resnet-w1-3"]  # whatever was created goes


def test_a_same_named_object_of_another_owner_is_reported_never_adopted():
    c = Cluster()
    c.step(act=False)
    refused(c, 409, "NotOwned", "controller uid other-uid", kind="ConfigMap", name="resnet-data")
    msg = [x for x in c.status["conditions"] if x["type"] == "PodCreationFailed"][0]["message"]
    assert c.reason("PodCreationFailed") == "NotOwned"
    assert "ConfigMap ns/resnet-data exists and is not controlled by this StreamingJob" in msg
    assert "never overwrites, adopts or deletes it" in msg


def test_pods_of_another_controller_are_never_deleted_or_counted():
    c = Cluster().running()
    stranger = copy.deepcopy(c.pods["resnet-w0-0"])
    stranger["metadata"]["name"] = "resnet-w9-0"
    stranger["metadata"]["labels"]["splitfeed.io/world-epoch"] = "9"
    stranger["metadata"]["ownerReferences"][0]["uid"] = "someone-else"
    c.pods["resnet-w9-0"] = stranger
    c.pods["resnet-w0-1"]["metadata"]["ownerReferences"] = []  # orphaned: not ours any more
    d = c.step()
    assert "resnet-w9-0" not in d.delete
    assert d.step == "RemovingOldWorld" and "pod resnet-w0-1 disappeared" in d.events[0].message


# --- stalled worlds ----------------------------------------------------------------------

def test_a_world_whose_pods_do_not_run_for_the_stall_timeout_is_stalled_naming_why():
    c = Cluster()
    c.step()
    c.set_phase("Running", "resnet-w0-0", "resnet-w0-1", "resnet-w0-2")
    c.pods["resnet-w0-3"]["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}
    c.now += datetime.timedelta(seconds=SETTINGS.stall_timeout_s - 1)
    assert c.reason("Stalled") is None and c.step().events == []
    c.now += datetime.timedelta(seconds=1)
    d = c.step()
    assert c.reason("Stalled") == "PodsNotRunning" and [e.reason for e in d.events] == ["Stalled"]
    msg = d.events[0].message
    assert "3/4 pods of world 0" in msg and "Insufficient nvidia.com/gpu" in msg and "resnet-w0-3" in msg
    assert c.step().events == []  # one warning, not one per look
    c.set_phase("Running")
    c.step()
    assert c.reason("Stalled") == "Progressing"
    assert [x for x in c.status["conditions"] if x["type"] == "Stalled"][0]["status"] == "False"


def test_a_crash_looping_container_is_named_in_the_stall():
    c = Cluster()
    c.step()
    c.pods["resnet-w0-0"]["status"] = {"phase": "Pending", "containerStatuses": [
        {"name": "trainer", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}}]}
    c.now += datetime.timedelta(seconds=SETTINGS.stall_timeout_s)
    c.step()
    msg = [x for x in c.status["conditions"] if x["type"] == "Stalled"][0]["message"]
    assert "resnet-w0-0: Pending, trainer ImagePullBackOff (Back-off pulling image)" in msg


# --- credentials in URIs never reach events or conditions ---------------------------------------

def test_a_sidecar_error_with_a_signed_uri_is_redacted_in_events_and_conditions():
    c = Cluster(maxRestarts=0).running()
    report = {"globalStep": 0, "error": "cannot open s3://AKIA:s3cr3t@bucket/db?X-Amz-Signature=abc", "permanent": True}
    c.pods["resnet-w0-2"]["status"] = {"phase": "Failed", "initContainerStatuses": [
        {"name": "splitfeed-sidecar", "state": {"terminated": {"exitCode": 2, "message": json.dumps(report)}}}]}
    d = c.step()
    blob = json.dumps(d.status) + json.dumps([e.message for e in d.events])
    assert "s3cr3t" not in blob and "AKIA" not in blob and "abc" not in blob
    assert "s3://***@bucket/db?X-Amz-Signature=***" in blob


def test_the_pinned_table_version_is_recorded_once_and_given_to_the_next_world():
    """status.data.tableVersion from a sidecar's report; the next world's sidecars get it."""
    from splitfeed.operator.objects import conditions as conds

    pod = {"status": {"initContainerStatuses": [{"name": wellknown.SIDECAR_NAME, "state": {"terminated": {
        "exitCode": 0, "finishedAt": "2026-12-03T00:00:00Z",
        "message": json.dumps({"globalStep": 3, "tableVersion": 7})}}}]}}
    reports = conds.sidecar_reports(pod)
    assert conds.progress(reports, {})["data"] == {"tableVersion": 7}
    assert "data" not in conds.progress(reports, {"data": {"tableVersion": 5}})  # pinned once
    job = specs.parse_job(manifest(replicas=2), check_replicas=False)
    owner = planning.Owner("resnet", "uid-1")
    pods = [o for o in planning.world(job, 3, owner, planning.Settings(), 12, 7) if o["kind"] == "Pod"]
    for p in pods:
        env = {e["name"]: e.get("value") for c in p["spec"]["initContainers"] for e in c.get("env", [])}
        assert env["SPLITFEED_TABLE_VERSION"] == "7" and env["SPLITFEED_JOB_UID"] == "uid-1"
        assert env["SPLITFEED_RESUME_STEP"] == "12"


def ended(step: int, spe: int = 20) -> dict:
    """A sidecar container that exited after its ranks took global step `step - 1` (no drain)."""
    return {"name": "splitfeed-sidecar", "state": {"terminated": {"exitCode": 0, "finishedAt": "2026-01-01T12:00:00Z",
            "message": json.dumps({"globalStep": step, "epoch": 0, "step": step, "stepsPerEpoch": spe,
                                   "lastCheckpoint": None, "drained": False, "agreedStep": None,
                                   "error": None, "permanent": False})}}}


@pytest.mark.parametrize("reached, finished", [(20, True), (7, False)])
def test_a_world_that_ran_to_the_end_before_its_drain_ends_the_job(reached, finished):
    """The drain came too late (or the operator that asked died before any pod heard of it):
    every pod ran the job to its last step. The job is complete, not a world to replace: the
    next one would train it all again from the newest checkpoint. A world that stopped short
    of the end without draining is replaced as before."""
    c = Cluster(replicas=2).running()
    c.scale(1)
    assert c.step().step == "CheckpointRequested"
    for pod in c.pods.values():
        pod["status"] = {"phase": "Succeeded", "containerStatuses": [ended(reached)]}
    d = c.step()
    if finished:
        assert d.step == "Succeeded" and d.create == [] and d.delete == []
        assert c.status["phase"] == "Succeeded" and "drain" not in c.status
        assert c.reason("Complete") == "AllPodsSucceeded" and c.reason() == "JobFinished"
    else:
        assert d.step == "RemovingOldWorld" and c.status["phase"] == "Rescaling"
