"""The operator in-process (real Kopf, real handlers) against kmock's Kubernetes emulator.

Fast tier: no apiserver. kmock cannot call webhooks, so the admission test posts
AdmissionReviews to Kopf's own webhook server itself. Pod phases are set
by the test, as a kubelet would. The emulated cluster and its helpers are
tests/support/emulated.py's; kmock replays every object as ADDED on each watch, so
the create handler may run twice (a free idempotency check).
"""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

from splitfeed.operator.cluster import handlers, webhooks
from tests.support.builders import manifest, status_answer
from tests.support.emulated import (  # noqa: F401 (cluster: the fixture)
    JOBS,
    PODS,
    add_job,
    cluster,
    job_of,
    phase,
    pods_of,
    post_review,
    review,
    running_operator,
)
from tests.support.ports import free_port
from tests.support.waiting import until


@pytest.fixture()
def posted_events(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Events as the handlers hand them to Kopf (which then posts them)."""
    posted: list[dict[str, Any]] = []
    real_event = kopf.event

    def recording_event(objs: Any, *, type: str, reason: str, message: str = "") -> None:
        posted.append({"type": type, "reason": reason, "message": message})
        real_event(objs, type=type, reason=reason, message=message)

    monkeypatch.setattr(kopf, "event", recording_event)
    return posted


def reason(kmock: Any, type_: str = "Rescaling") -> str | None:
    for c in (job_of(kmock).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c["reason"]
    return None


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_job_gets_its_world_and_a_scale_walks_to_a_new_epoch(cluster, posted_events):
    add_job(cluster, manifest(replicas=2))
    async with running_operator(cluster):
        await until(lambda: len(pods_of(cluster)) == 2, what="2 pods of world 0")
        assert sorted(pods_of(cluster)) == ["resnet-w0-0", "resnet-w0-1"]
        assert not cluster.objects["v1/configmaps", "ns", "resnet-data"].deleted
        assert not cluster.objects["v1/services", "ns", "resnet"].deleted
        budget = cluster.objects["policy/v1/poddisruptionbudgets", "ns", "resnet"].raw
        assert budget["spec"]["minAvailable"] == 1
        status = job_of(cluster)["status"]
        assert status["phase"] == "Running" and status["worldEpoch"] == 0
        assert status["selector"] == "splitfeed.io/job=resnet"

        cluster.objects[JOBS, "ns", "resnet"].patch({"spec": {"replicas": 4},
                                                     "metadata": {"resourceVersion": "2", "generation": 2}})
        await until(lambda: all(p["metadata"].get("annotations", {}).get("splitfeed.io/drain") == "rescale-w0"
                                for p in pods_of(cluster).values()), what="drain annotations")
        assert phase(cluster) == "Rescaling"
        for name in list(pods_of(cluster)):
            cluster.objects[PODS, "ns", name].patch({"status": {"phase": "Succeeded"}})
        await until(lambda: (job_of(cluster)["status"].get("worldEpoch"), phase(cluster)) == (1, "Running"),
                    what="world 1 running")
        assert sorted(pods_of(cluster)) == [f"resnet-w1-{i}" for i in range(4)]
        assert reason(cluster) == "RescaleComplete"
        # kmock ignores generateName (one event is stored, later ones conflict), so the
        # events are checked where the handlers hand them to Kopf.
        # (handed over after the steps of one reconcile, so possibly just after the status)
        wanted = {"CheckpointRequested", "Drained", "StartingNewWorld", "RescaleComplete"}
        await until(lambda: wanted <= {e["reason"] for e in posted_events}, what=f"events {wanted}")


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_an_invalid_job_fails_with_a_condition_and_no_pods(cluster):
    add_job(cluster, manifest(replicas=5))
    async with running_operator(cluster):
        await until(lambda: phase(cluster) == "Failed", what="phase Failed")
        await asyncio.sleep(1.0)
        assert pods_of(cluster) == {}
        (validated,) = [c for c in job_of(cluster)["status"]["conditions"] if c["type"] == "Validated"]
        assert validated["status"] == "False"
        assert "Valid replica counts for this job: [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]" in validated["message"]


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_failed_pod_restarts_the_world_then_success_is_terminal(cluster):
    add_job(cluster, manifest(replicas=1, maxRestarts=1))
    async with running_operator(cluster):
        await until(lambda: "resnet-w0-0" in pods_of(cluster), what="world 0")
        cluster.objects[PODS, "ns", "resnet-w0-0"].patch({"status": {"phase": "Failed"}})
        await until(lambda: "resnet-w1-0" in pods_of(cluster), what="world 1 after a failure")
        assert job_of(cluster)["status"]["restarts"] == 1
        cluster.objects[PODS, "ns", "resnet-w1-0"].patch({"status": {"phase": "Succeeded"}})
        await until(lambda: phase(cluster) == "Succeeded", what="Succeeded")
        assert reason(cluster, "Complete") == "AllPodsSucceeded"


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_an_operator_restarted_mid_rescale_finishes_it(cluster):
    add_job(cluster, manifest(replicas=2))
    async with running_operator(cluster):
        await until(lambda: len(pods_of(cluster)) == 2, what="world 0")
        cluster.objects[JOBS, "ns", "resnet"].patch({"spec": {"replicas": 1},
                                                     "metadata": {"resourceVersion": "2", "generation": 2}})
        await until(lambda: reason(cluster) == "WaitingForCheckpoint", what="WaitingForCheckpoint")
    # The first operator is gone; the trainers finish their checkpoint meanwhile.
    for name in list(pods_of(cluster)):
        cluster.objects[PODS, "ns", name].patch({"status": {"phase": "Succeeded"}})
    async with running_operator(cluster):
        await until(lambda: (job_of(cluster)["status"].get("worldEpoch"), phase(cluster)) == (1, "Running"),
                    what="world 1 running after the restart")
        assert sorted(pods_of(cluster)) == ["resnet-w1-0"]


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_rescale_the_status_timer_never_saw_is_still_timed(cluster, monkeypatch):
    """A drain agreed and a new world started between two timer passes (seconds, with quick
    trainers; found end to end: status.lastRescale never came): the reconciler's own reads
    of the status start the rescale's timeline. The timer is kept from asking here."""
    from splitfeed.operator.cluster import live

    monkeypatch.setattr(live.Poller, "due", lambda self, key, body: False)
    add_job(cluster, manifest(replicas=2))
    async with running_operator(cluster) as memo:
        await until(lambda: len(pods_of(cluster)) == 2, what="world 0")
        cluster.objects[JOBS, "ns", "resnet"].patch({"spec": {"replicas": 1},
                                                     "metadata": {"resourceVersion": "2", "generation": 2}})
        await until(lambda: reason(cluster) == "WaitingForCheckpoint", what="WaitingForCheckpoint")
        for name in list(pods_of(cluster)):
            cluster.objects[PODS, "ns", name].patch({"status": {"phase": "Succeeded"}})
        await until(lambda: (job_of(cluster)["status"].get("worldEpoch"), phase(cluster)) == (1, "Running"),
                    what="world 1 running")
        timeline = memo["live"].rescales[("ns", "resnet")]
        assert (timeline.from_replicas, timeline.to_replicas, timeline.old_epoch) == (2, 1, 0)
        # (the old world's end is marked by the next read, after the pass that started world 1)
        await until(lambda: timeline.gone_at is not None, what="the old world's end on the timeline")
        assert timeline.gone_at >= timeline.requested_at
        # The new world's first batch (the coordinator's answer) completes the report.
        patch, events = memo["live"].observe(("ns", "resnet"), job_of(cluster)["status"],
                                             status_answer(global_step=4, resume_step=3), timeline.gone_at)
        assert patch["lastRescale"]["fromReplicas"] == 2 and [e.reason for e in events] == [live.RESCALE_REPORT]


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_the_webhooks_answer_admission_reviews_with_the_rule_and_the_valid_counts(cluster):
    import aiohttp

    port = free_port()
    settings = kopf.OperatorSettings()
    settings.admission.server = kopf.WebhookServer(addr="127.0.0.1", port=port, insecure=True)
    registry = kopf.OperatorRegistry()  # only the webhooks: the other tests run without a server
    webhooks.register(registry)
    add_job(cluster, manifest(replicas=4))
    valid_counts = [n for n in range(1, 49) if 48 % n == 0 and 960 % n == 0]  # numSplits 48, batch 960

    async with running_operator(cluster, settings, registry), aiohttp.ClientSession() as http:
        async def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
            answer = await post_review(http, f"http://127.0.0.1:{port}/{path}", body)
            assert answer["uid"] == "review-1"
            return answer

        assert (await post("streamingjob", review(manifest(replicas=6), operation="CREATE")))["allowed"]

        denied = await post("streamingjob", review(manifest(replicas=5), operation="CREATE"))
        assert not denied["allowed"] and denied["status"]["code"] == 422
        assert "5" in denied["status"]["message"]
        assert f"Valid replica counts for this job: {valid_counts}" in denied["status"]["message"]

        unknown = manifest(replicas=4)
        unknown["spec"]["data"]["numSplit"] = 24
        denied = await post("streamingjob", review(unknown, operation="CREATE"))
        assert not denied["allowed"] and "spec.data.numSplit" in denied["status"]["message"]

        # Kopf's own writes (status, annotations) to a job admitted before a rule changed pass.
        bad = manifest(replicas=5)
        assert (await post("streamingjob", review(bad, operation="UPDATE", old=bad)))["allowed"]

        def scale(replicas: int) -> dict[str, Any]:
            return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                    "metadata": {"name": "resnet", "namespace": "ns"}, "spec": {"replicas": replicas}}

        denied = await post("scale", review(scale(5), operation="UPDATE", old=scale(4), sub_resource="scale"))
        assert not denied["allowed"]
        assert f"Valid replica counts for this job: {valid_counts}" in denied["status"]["message"]
        assert (await post("scale", review(scale(8), operation="UPDATE", old=scale(4),
                                           sub_resource="scale")))["allowed"]
