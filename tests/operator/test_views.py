"""Pods parsed once (operator/views.py): what the life cycle asks of a pod, from raw API objects."""

from __future__ import annotations

import datetime
import json

from splitfeed.operator import planning, views
from splitfeed.trainer_client import contract, specs
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
    pod = views.Pod.parse({"metadata": {"name": "x", "labels": {contract.LABEL_EPOCH: "not a number"}}})
    assert (pod.phase, pod.epoch, pod.restart_policy, pod.containers, pod.final_report) == (
        "Pending", None, "Always", (), None)


def test_a_nonzero_trainer_fails_a_never_restarting_pod_while_it_still_runs():
    p = built(containerStatuses=[terminated("trainer", 1), running(contract.SIDECAR_NAME)])
    assert views.Pod.parse(p).failed
    p["spec"]["restartPolicy"] = "OnFailure"
    assert not views.Pod.parse(p).failed
    init_only = built(initContainerStatuses=[terminated(contract.SIDECAR_NAME, 2)])
    assert not views.Pod.parse(init_only).failed, "a native sidecar's exit is not the pod's failure"


def test_the_report_is_pending_only_while_the_sidecar_runs_within_the_grace():
    p = views.Pod.parse(built(initContainerStatuses=[running(contract.SIDECAR_NAME)],
                              containerStatuses=[terminated("trainer", 1)]))
    assert p.report_pending(T0 + datetime.timedelta(seconds=14), 15.0)
    assert not p.report_pending(T0 + datetime.timedelta(seconds=15), 15.0)
    done = views.Pod.parse(built(initContainerStatuses=[terminated(contract.SIDECAR_NAME, 0)],
                                 containerStatuses=[terminated("trainer", 1)]))
    assert not done.report_pending(T0, 15.0)


def test_drained_disrupted_and_restart_counts_come_from_the_status():
    report = json.dumps({"drained": True, "agreedStep": 12, "drainReason": "preempt"})
    p = views.Pod.parse(built(
        "Succeeded", conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}],
        initContainerStatuses=[{**terminated(contract.SIDECAR_NAME, 0, message=report), "restartCount": 2}],
        containerStatuses=[terminated("trainer", 0)]))
    assert p.drained and p.final_report is not None and p.final_report.agreed_step == 12
    assert p.disruption is not None and p.disruption["reason"] == "PreemptionByScheduler"
    assert [(c.name, c.init, c.restart_count) for c in p.containers] == [
        (contract.SIDECAR_NAME, True, 2), ("trainer", False, 0)]
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
