"""A suspend during a scale-up in place that had not asked the world yet (issue 21 item 3, issue 22
item 5), walked against the in-memory cluster: `kubectl scale` 2 -> 4 in place creates the new
replicas' pods and waits for their trainers before it asks world 0 to change; `spec.suspend` then
must not wait with it (the world would train on, unasked, for up to READY_WAIT_S, to the job's end
if it is near: seen end to end). The change becomes the suspend's drain, one drain, the pods created
ahead go, and the resumed world has the newest count."""

from __future__ import annotations

import json

from splitfeed.operator.lifecycle import deciding
from tests.support.memory_cluster import Cluster, in_place, ts

DRAIN = 9



def drained(c: Cluster, pod: str, reason: str) -> None:
    """The pod's trainer and sidecar ended after the drain at DRAIN."""
    report = {"globalStep": DRAIN, "epoch": 0, "step": DRAIN, "stepsPerEpoch": 100, "lastCheckpoint": None,
              "drained": True, "agreedStep": DRAIN, "drainReason": reason, "resumeStep": 0, "error": None,
              "permanent": False}
    done = {"terminated": {"exitCode": 0, "finishedAt": ts(c.now)}}
    c.pods[pod]["status"] = {"phase": "Succeeded", "containerStatuses": [{"name": "trainer", "state": done}],
                             "initContainerStatuses": [{"name": "splitfeed-sidecar", "state": {"terminated": {
                                 "exitCode": 0, "message": json.dumps(report), "finishedAt": ts(c.now)}}}]}


def reasons(d: deciding.Decision) -> list[str]:
    return [e.reason for e in d.events]


def test_a_suspend_before_the_scale_up_asked_the_world_becomes_one_suspend_drain() -> None:
    c = in_place(2)
    c.scale(4)
    d = c.step()
    assert d.step == "CheckpointRequested" and d.notify is None and sorted(c.pods) == [
        f"resnet-r{i}" for i in range(4)]  # the new pods' trainers still import: world 0 not asked
    c.manifest["spec"]["suspend"] = True
    d = c.step()
    assert d.step == "CheckpointRequested" and d.notify is not None and d.notify[1:] == ("suspend-w0", "suspend")
    assert d.notify_replicas == 0  # a drain that stops the world, not a change in place
    assert sorted(d.annotate) == ["resnet-r0", "resnet-r1"] and sorted(d.delete) == ["resnet-r2", "resnet-r3"]
    assert c.status["drain"]["reason"] == "Suspend" and not c.status["drain"].get("inPlace")
    for name in ("resnet-r0", "resnet-r1"):
        drained(c, name, "suspend")
    d = c.step()
    assert d.step == "RemovingOldWorld" and c.status["resumeStep"] == DRAIN
    d = c.step()
    assert d.step == "Suspended" and not c.pods and c.status["replicas"] == 0
    assert c.status.get("restarts") is None
    c.manifest["spec"]["suspend"] = False
    d = c.step()
    assert c.status["worldEpoch"] == 1 and c.status["replicas"] == 4, reasons(d)
    assert sorted(o["metadata"]["name"] for o in d.create if o["kind"] == "Pod") == [f"resnet-r{i}" for i in range(4)]
