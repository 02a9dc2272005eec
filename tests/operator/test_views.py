"""Pods, a StreamingJob and its status parsed once (operator/objects/views.py): what the life cycle asks, from raw API objects."""

from __future__ import annotations

import dataclasses
import datetime
import json

from splitfeed.operator.objects import planning, views
from splitfeed.trainer_client.contract import wellknown, specs
from tests.support.builders import OWNER, T0, manifest, pod_dict

NATIVE = planning.Settings()


def built(phase: str = "Running", **status):
    return pod_dict(planning.pod(specs.parse_job(manifest()), 3, 1, OWNER, NATIVE), phase, **status)


def terminated(name: str, code: int, finished: datetime.datetime = T0, message: str | None = None) -> dict:
    term = {"exitCode": code, "finishedAt": finished.strftime("%Y-%m-%dT%H:%M:%SZ")}
    if message is not None:
        term["message"] = message
    return {"name": name, "state": {"terminated": term}, "restartCount": 0}


def running(name: str, restarts: int = 0) -> dict:
    return {"name": name, "state": {"running": {}}, "restartCount": restarts}


def test_a_built_pod_reads_back_its_name_world_controller_and_policy():
    pod = views.Pod.parse(built())
    assert (pod.name, pod.epoch, pod.controller, pod.restart_policy) == ("resnet-w3-1", 3, OWNER.uid, "Never")
    assert pod.phase == "Running" and not pod.deleting and pod.drain_token is None and pod.pod_ip is None
    assert not pod.failed and not pod.terminated and pod.live


def test_absent_fields_take_the_apis_defaults():
    pod = views.Pod.parse({"metadata": {"name": "x", "labels": {wellknown.LABEL_EPOCH: "not a number"}}})
    assert (pod.phase, pod.epoch, pod.restart_policy, pod.containers, pod.final_report) == (
        "Pending", None, "Always", (), None)


def test_a_nonzero_trainer_fails_a_never_restarting_pod_while_it_still_runs():
    p = built(containerStatuses=[terminated("trainer", 1), running(wellknown.SIDECAR_NAME)])
    assert views.Pod.parse(p).failed
    p["spec"]["restartPolicy"] = "OnFailure"
    assert not views.Pod.parse(p).failed
    init_only = built(initContainerStatuses=[terminated(wellknown.SIDECAR_NAME, 2)])
    assert not views.Pod.parse(init_only).failed, "a native sidecar's exit is not the pod's failure"


def test_the_report_is_pending_only_while_the_sidecar_runs_within_the_grace():
    p = views.Pod.parse(built(initContainerStatuses=[running(wellknown.SIDECAR_NAME)],
                              containerStatuses=[terminated("trainer", 1)]))
    assert p.report_pending(T0 + datetime.timedelta(seconds=14), 15.0)
    assert not p.report_pending(T0 + datetime.timedelta(seconds=15), 15.0)
    done = views.Pod.parse(built(initContainerStatuses=[terminated(wellknown.SIDECAR_NAME, 0)],
                                 containerStatuses=[terminated("trainer", 1)]))
    assert not done.report_pending(T0, 15.0)


def test_drained_disrupted_and_restart_counts_come_from_the_status():
    report = json.dumps({"drained": True, "agreedStep": 12, "drainReason": "preempt"})
    p = views.Pod.parse(built(
        "Succeeded", conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}],
        initContainerStatuses=[{**terminated(wellknown.SIDECAR_NAME, 0, message=report), "restartCount": 2}],
        containerStatuses=[terminated("trainer", 0)]))
    assert p.drained and p.final_report is not None and p.final_report.agreed_step == 12
    assert p.disruption is not None and p.disruption["reason"] == "PreemptionByScheduler"
    assert [(c.name, c.init, c.restart_count) for c in p.containers] == [
        (wellknown.SIDECAR_NAME, True, 2), ("trainer", False, 0)]
    assert p.terminated and not p.live


def test_the_detail_names_what_keeps_a_pod_from_running():
    p = views.Pod.parse(built("Pending", conditions=[
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"}],
        containerStatuses=[{"name": "trainer", "state": {"waiting": {"reason": "ImagePullBackOff",
                                                                     "message": "no such image"}}}]))
    assert p.detail() == "resnet-w3-1: Pending, Unschedulable: 0/3 nodes, trainer ImagePullBackOff (no such image)"


def test_the_status_view_reads_what_it_finds():
    found = views.Status.parse({"phase": "Running", "worldEpoch": 2, "replicas": 4})
    assert (found.phase, found.world_epoch, found.replicas, found.restarts) == ("Running", 2, 4, 0)
    assert views.Status.parse({}).world_epoch is None


# --- status.drain, parsed once with the status -----------------------------------------------

DRAIN = {"reason": "Rescale", "step": "WaitingForCheckpoint", "token": "rescale-w2",
         "requestedAt": "2026-01-01T12:00:00Z", "targetReplicas": 3, "inPlace": True,
         "askedAt": "2026-01-01T12:00:30Z"}


def test_no_drain_is_under_way_when_status_drain_is_absent_empty_or_not_an_object():
    for status in ({}, {"drain": None}, {"drain": {}}, {"drain": "Rescale"}, {"drain": [DRAIN]}):
        assert views.Status.parse({"worldEpoch": 2, **status}).drain is None, status


def test_a_drain_reads_every_field_and_writes_back_exactly_what_it_read():
    drain = views.Status.parse({"worldEpoch": 2, "drain": DRAIN}).drain
    assert drain is not None
    assert (drain.reason, drain.step, drain.token, drain.target_replicas, drain.in_place) == (
        "Rescale", "WaitingForCheckpoint", "rescale-w2", 3, True)
    assert drain.requested_at == datetime.datetime(2026, 1, 1, 12, tzinfo=datetime.timezone.utc)
    assert drain.asked_at == datetime.datetime(2026, 1, 1, 12, 0, 30, tzinfo=datetime.timezone.utc)
    assert drain.patch() == DRAIN  # an unchanged drain is an unchanged status: no patch


def test_a_malformed_drain_field_reads_as_absent_and_the_token_is_the_worlds():
    raw = {"reason": "Suspend", "step": 7, "requestedAt": "yesterday", "targetReplicas": "3",
           "inPlace": "yes", "askedAt": "2026-01-01T12:00:00"}  # no zone: not a time the operator wrote
    drain = views.Status.parse({"worldEpoch": 4, "drain": raw}).drain
    assert drain is not None
    assert (drain.reason, drain.step, drain.token, drain.requested_at, drain.target_replicas, drain.in_place,
            drain.asked_at) == ("Suspend", None, "suspend-w4", None, None, False, None)
    assert views.Status.parse({"drain": {"targetReplicas": -1}}).drain.target_replicas is None
    assert views.Status.parse({"drain": {"targetReplicas": True}}).drain.target_replicas is None


def test_a_changed_drain_writes_its_fields_over_what_it_read():
    drain = views.Drain.parse({**DRAIN, "requestedAt": "yesterday"}, 2)
    assert drain is not None
    now = datetime.datetime(2026, 1, 2, 8, tzinfo=datetime.timezone.utc)
    changed = dataclasses.replace(drain, step="RemovingOldWorld", requested_at=now, target_replicas=5)
    assert changed.patch() == {**DRAIN, "step": "RemovingOldWorld", "requestedAt": "2026-01-02T08:00:00Z",
                               "targetReplicas": 5}
    fresh = views.Drain(reason="Rescale", step="CheckpointRequested", token="rescale-w0", requested_at=now,
                        target_replicas=2)
    assert fresh.patch() == {"reason": "Rescale", "step": "CheckpointRequested", "token": "rescale-w0",
                             "requestedAt": "2026-01-02T08:00:00Z", "targetReplicas": 2}


def test_the_live_progress_and_last_checkpoint_read_as_typed_values():
    found = views.Status.parse({"progress": {"globalStep": 41, "stepsPerEpoch": 20, "updatedAt": "2026-01-01T12:00:00Z",
                                             "filledRows": 3},
                                "lastCheckpoint": {"step": 40, "time": "2026-01-01T11:59:00Z"}})
    assert (found.progress.global_step, found.progress.steps_per_epoch) == (41, 20)
    assert found.progress.updated_at == datetime.datetime(2026, 1, 1, 12, tzinfo=datetime.timezone.utc)
    assert found.progress.raw["filledRows"] == 3
    assert found.saved_at == datetime.datetime(2026, 1, 1, 11, 59, tzinfo=datetime.timezone.utc)
    odd = views.Status.parse({"progress": {"globalStep": "41", "updatedAt": 5}, "lastCheckpoint": "x"})
    assert (odd.progress.global_step, odd.progress.steps_per_epoch, odd.progress.updated_at, odd.saved_at) == (
        None, 0, None, None)


def test_a_streamingjob_reads_as_who_it_is_and_its_status():
    job = views.Job.parse({"metadata": {"name": "resnet", "namespace": "ml", "uid": "u-1", "generation": 3,
                                        "resourceVersion": "41", "deletionTimestamp": "2026-01-01T12:00:00Z"},
                           "status": {"worldEpoch": 1, "drain": DRAIN}})
    assert (job.name, job.namespace, job.uid, job.generation, job.resource_version, job.deleting) == (
        "resnet", "ml", "u-1", 3, "41", True)
    assert job.status.world_epoch == 1 and job.status.drain is not None and job.status.drain.in_place
    bare = views.Job.parse({"metadata": {"name": "resnet"}})
    assert (bare.generation, bare.resource_version, bare.deleting, bare.status.drain) == (None, None, False, None)


def test_disruption_counted_restarts_pod_creation_and_back_off_read_as_typed_values():
    found = views.Status.parse({
        "lastDisruption": {"worldEpoch": 3, "pod": "j-w3-1", "reason": "EvictionByEvictionAPI", "time": "x"},
        "observedContainerRestarts": {"worldEpoch": 3, "count": 2},
        "podCreation": {"failures": 4, "retryAt": "2026-01-01T12:00:05Z"},
        "nextRestartAt": "2026-01-01T12:00:10Z"})
    assert found.disruption == views.Disruption(world_epoch=3, pod="j-w3-1", reason="EvictionByEvictionAPI")
    assert found.counted_restarts == views.CountedRestarts(world_epoch=3, count=2)
    assert found.pod_creation == views.PodCreation(
        failures=4, retry_at=datetime.datetime(2026, 1, 1, 12, 0, 5, tzinfo=datetime.timezone.utc))
    assert found.next_restart_at == datetime.datetime(2026, 1, 1, 12, 0, 10, tzinfo=datetime.timezone.utc)


def test_absent_or_malformed_disruption_restarts_and_creation_fields_read_as_nothing_recorded():
    empty = views.Status.parse({})
    assert (empty.disruption, empty.pod_creation, empty.next_restart_at) == (None, None, None)
    assert empty.counted_restarts == views.CountedRestarts()
    bad = views.Status.parse({"lastDisruption": "evicted", "observedContainerRestarts": {"worldEpoch": "3",
                              "count": -1}, "podCreation": {"failures": "many", "retryAt": "soon"},
                              "nextRestartAt": "2026-01-01T12:00:10"})  # no zone: not a time we wrote
    assert bad.disruption is None and bad.counted_restarts == views.CountedRestarts()
    assert bad.pod_creation == views.PodCreation(failures=0, retry_at=None) and bad.next_restart_at is None
