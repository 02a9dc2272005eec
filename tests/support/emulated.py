"""The operator in process (real Kopf, real handlers) against kmock's Kubernetes emulator:
the `cluster` fixture, a running operator, jobs and pods in the emulated API, and
AdmissionReviews posted to Kopf's webhook server. tests/operator and tests/chart share it.

kmock notes (docs/testing.md): Kopf only starts watching once CRDs, namespaces, events
and kopfpeerings are listable; objects need a resourceVersion; kmock replays every
object as ADDED on each watch, so a create handler may run twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import kopf
from kopf._cogs.structs.credentials import Vault  # not exported; operator(vault=...) is public
import kubernetes
import pytest_asyncio

from splitfeed.operator.cluster import configs, kube, reconciling
from splitfeed.operator.objects import planning
from tests.support import waiting

JOBS = "splitfeed.io/v1alpha1/streamingjobs"
PODS = "v1/pods"


@pytest_asyncio.fixture()
async def cluster(kmock: Any) -> AsyncIterator[Any]:
    kmock.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = {
        "namespaced": False, "kind": "CustomResourceDefinition"}
    kmock.resources["v1/namespaces"] = {"namespaced": False, "kind": "Namespace"}
    kmock.resources["v1/events"] = {"namespaced": True, "kind": "Event"}
    kmock.resources["kopf.dev/v1/clusterkopfpeerings"] = {"namespaced": False, "kind": "ClusterKopfPeering"}
    kmock.resources["kopf.dev/v1/kopfpeerings"] = {"namespaced": True, "kind": "KopfPeering"}
    for plural, kind in [("pods", "Pod"), ("services", "Service"), ("configmaps", "ConfigMap"),
                         ("secrets", "Secret")]:
        kmock.resources[f"v1/{plural}"] = {"namespaced": True, "kind": kind}
    kmock.resources["policy/v1/poddisruptionbudgets"] = {"namespaced": True, "kind": "PodDisruptionBudget"}
    kmock.resources[JOBS] = {"namespaced": True, "kind": "StreamingJob", "singular": "streamingjob",
                             "subresources": ["status", "scale"], "verbs": [
                                 "get", "list", "watch", "create", "update", "patch", "delete"]}
    yield kmock


@contextlib.asynccontextmanager
async def running_operator(kmock: Any, settings: kopf.OperatorSettings | None = None,
                           registry: kopf.OperatorRegistry | None = None, *,
                           peering: str | None = None) -> AsyncIterator[kopf.Memo]:
    """The operator on `kmock` until the block ends: standalone, or with Kopf's peering under
    the name `peering` (what the chart's RBAC must then allow)."""
    config = kubernetes.client.Configuration(host=str(kmock.url).rstrip("/"))
    client = kube.Kube(kubernetes.client.ApiClient(config))
    stop = asyncio.Event()
    vault = Vault({"kmock": kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"))})
    memo = kopf.Memo(config=configs.OperatorConfig(peering=peering, planning=planning.Settings(restart_backoff_s=0.2)),
                     kube=client)
    if registry is not None:  # no startup handler there to build the context
        memo["ctx"] = reconciling.Context(kube=client, settings=memo["config"].planning)
    task = asyncio.create_task(kopf.operator(
        clusterwide=True, standalone=peering is None, peering_name=peering, vault=vault, stop_flag=stop,
        settings=settings, registry=registry, memo=memo))
    try:
        yield memo
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, timeout=10)
        finally:
            client.close()


def add_job(kmock: Any, m: dict[str, Any]) -> None:
    m = {**m, "metadata": {**m["metadata"], "resourceVersion": "1", "generation": 1}}
    kmock.objects[JOBS, m["metadata"]["namespace"], m["metadata"]["name"]] = m


def job_of(kmock: Any, name: str = "resnet") -> dict[str, Any]:
    return kmock.objects[JOBS, "ns", name].raw


def pods_of(kmock: Any) -> dict[str, dict[str, Any]]:
    out = {}
    for (res, ns, name), obj in list(kmock.objects.items()):
        if res.plural == "pods" and not obj.deleted:
            out[name] = obj.raw
    return out


def phase(kmock: Any) -> str | None:
    return (job_of(kmock).get("status") or {}).get("phase")


def review(obj: dict[str, Any], *, operation: str, old: dict[str, Any] | None = None,
           sub_resource: str | None = None) -> dict[str, Any]:
    """An AdmissionReview as the kube-apiserver sends it (admission.k8s.io/v1)."""
    meta = obj["metadata"]
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "review-1", "operation": operation, "name": meta["name"], "namespace": meta["namespace"],
        "kind": {"group": "splitfeed.io", "version": "v1alpha1", "kind": "StreamingJob"},
        "resource": {"group": "splitfeed.io", "version": "v1alpha1", "resource": "streamingjobs"},
        "subResource": sub_resource, "object": obj, "oldObject": old, "dryRun": False,
        "userInfo": {"username": "alice", "groups": ["system:authenticated"]}}}


async def post_review(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      timeout: float = 20.0) -> dict[str, Any]:
    """POST an AdmissionReview to Kopf's webhook server and return its `response`; retried
    while the server is not listening yet or answers 404 (Kopf has not discovered the CRD)."""
    async def answer() -> dict[str, Any] | None:
        try:
            async with http.post(url, json=body) as resp:
                if resp.status == 404:
                    return None
                assert resp.status == 200, await resp.text()
                response: dict[str, Any] = (await resp.json())["response"]
                return response
        except aiohttp.ClientConnectionError:  # not listening yet
            return None
    found: dict[str, Any] = await waiting.until(answer, timeout, f"an answer from {url}", interval=0.2)
    return found
