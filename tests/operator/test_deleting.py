"""A deleted StreamingJob's pods are stopped at once (issue 22 item 5): the pure choice
(operator/cluster/deleting.py), and the handler in the operator in process (real Kopf) against kmock,
which has no garbage collector: a pod that goes was deleted by the operator."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from splitfeed.operator.cluster import deleting, handlers
from tests.support.builders import manifest
from tests.support.emulated import (  # noqa: F401 (cluster: the fixture)
    JOBS,
    PODS,
    add_job,
    cluster,
    pods_of,
    running_operator,
)
from tests.support.waiting import until

JOB_UID = "uid-1"


def job(**meta: Any) -> dict[str, Any]:
    m = manifest()
    m["metadata"].update(meta)
    return m


def pod(name: str, *, owner: str | None = JOB_UID, phase: str = "Running", **meta: Any) -> dict[str, Any]:
    refs = [{"kind": "StreamingJob", "name": "resnet", "uid": owner, "controller": True}] if owner else []
    return {"metadata": {"name": name, "uid": f"pod-{name}", "ownerReferences": refs, **meta},
            "status": {"phase": phase}}


@pytest.mark.parametrize("event, meta, deleted", [
    pytest.param("DELETED", {}, True, id="gone"),
    pytest.param("MODIFIED", {"deletionTimestamp": "2026-01-01T12:00:00Z"}, True, id="held-by-a-finalizer"),
    pytest.param("MODIFIED", {}, False, id="live"),
    pytest.param(None, {}, False, id="no-event-type"),
])
def test_a_job_counts_as_deleted_once_it_is_gone_or_has_a_deletion_timestamp(
        event: str | None, meta: dict[str, Any], deleted: bool) -> None:
    assert deleting.is_deleted(event, job(**meta)) is deleted


def test_the_running_pods_the_job_controls_are_stopped_by_uid() -> None:
    pods = [pod("resnet-r0"), pod("resnet-r1", phase="Pending")]
    assert deleting.pods_to_stop(job(), pods) == {"resnet-r0": "pod-resnet-r0", "resnet-r1": "pod-resnet-r1"}


def test_pods_of_another_owner_ended_or_already_going_are_left_alone() -> None:
    pods = [pod("resnet-r0", owner="uid-of-a-successor"), pod("resnet-r1", owner=None),
            pod("resnet-r2", phase="Succeeded"), pod("resnet-r3", phase="Failed"),
            pod("resnet-r4", deletionTimestamp="2026-01-01T12:00:00Z"), pod("resnet-r5")]
    assert deleting.pods_to_stop(job(), pods) == {"resnet-r5": "pod-resnet-r5"}


def test_a_deletion_that_orphans_the_pods_stops_none() -> None:
    """`kubectl delete --cascade=orphan`: the user keeps the pods, as the garbage collector does."""
    assert deleting.pods_to_stop(job(finalizers=["orphan"]), [pod("resnet-r0")]) == {}


def test_a_job_without_a_uid_stops_nothing() -> None:
    m = job()
    del m["metadata"]["uid"]
    assert deleting.pods_to_stop(m, [pod("resnet-r0")]) == {}


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_deleting_a_running_job_deletes_its_pods_at_once(cluster: Any) -> None:
    add_job(cluster, manifest(replicas=2, rescale="inPlace"))
    async with running_operator(cluster):
        await until(lambda: len(pods_of(cluster)) == 2, what="the job's 2 pods")
        for name in pods_of(cluster):
            cluster.objects[PODS, "ns", name].patch({"status": {"phase": "Running"}})
        url = f"{str(cluster.url).rstrip('/')}/apis/{JOBS.rsplit('/', 1)[0]}/namespaces/ns/streamingjobs/resnet"
        async with aiohttp.ClientSession() as http, http.delete(url) as resp:
            assert resp.status in (200, 202), await resp.text()
        await until(lambda: not pods_of(cluster), what="the deleted job's pods deleted by the operator")
