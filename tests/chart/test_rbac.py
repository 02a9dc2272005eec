"""The chart grants exactly what the operator uses: derived from the code, never pinned.

What the operator needs comes from three places, all read here:
- operator/cluster/kube.py, the only module of ours that calls the API: every client
  method it names (`self.core.create_namespaced_pod`, ...) is a (group,
  resource, verb), parsed from the source;
- Kopf's own requests (watching, finalizers, events, peering): recorded from
  the operator running against kmock through a job's life (create, rescale,
  failure, success), with peering on;
- planning's owner references: blockOwnerDeletion needs `update` on the
  owner's finalizers subresource.
The chart must grant the union (cluster-scoped kinds in the ClusterRole, the
Lease in the leader Role, subjectaccessreviews only with
webhook.checkPodPermission, kopf.dev only with peering, networkpolicies only with
networkPolicy.enabled, on by default) and nothing else.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from splitfeed.operator.cluster import handlers
from splitfeed.operator.objects import planning
from splitfeed.trainer_client.contract import wellknown, specs
from tests.support.builders import OWNER, manifest
from tests.support.chart import SCENARIOS, grants, objects
from tests.support.emulated import PODS, add_job, cluster, job_of, phase, pods_of, running_operator  # noqa: F401 (cluster: the fixture)
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[2]
Grant = tuple[str, str, str]
API_GROUPS = {"core": "", "policy": "policy", "authorization": "authorization.k8s.io",
              "coordination": "coordination.k8s.io", "networking": "networking.k8s.io", "custom": wellknown.GROUP}
VERBS = {"read": "get", "get": "get", "list": "list", "create": "create", "patch": "patch", "delete": "delete",
         "replace": "update"}
CLUSTER_SCOPED = {"customresourcedefinitions", "namespaces", "clusterkopfpeerings", "subjectaccessreviews"}


def client_calls(path: Path) -> set[Grant]:
    """(group, resource, verb) of every `self.<api>.<method>` the module names."""
    found: set[Grant] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"
                and node.value.attr in API_GROUPS):
            m = re.fullmatch(r"(read|get|list|create|patch|delete|replace)_(?:namespaced_)?(\w+?)(_status)?", node.attr)
            assert m, f"{path.name}: cannot tell the verb of {node.value.attr}.{node.attr}"
            kind = m[2]
            singular = kind.replace("_", "")
            plural = singular[:-1] + "ies" if singular.endswith("y") else singular + "s"  # networkpolicy
            resource = wellknown.PLURAL if kind == "custom_object" else plural
            found.add((API_GROUPS[node.value.attr], resource + ("/status" if m[3] else ""), VERBS[m[1]]))
    return found


def request_grant(method: str, path: str, params: Any) -> Grant | None:
    """What RBAC checks for one recorded HTTP request; None for discovery."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) > 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    if not rest:
        return None
    if rest[0] == "namespaces" and len(rest) >= 3:
        rest = rest[2:]
    resource, name = rest[0], (rest[1] if len(rest) > 1 else None)
    if len(rest) > 2:
        resource += "/" + rest[2]
    if method == "GET":
        verb = "get" if name else ("watch" if str(params.get("watch", "")).lower() in ("true", "1") else "list")
    else:
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]
    return group, resource, verb


_RECORDED: set[Grant] = set()
"""Filled once per test run by the first test that asks for `recorded`, whichever it is."""


async def _record(cluster: Any) -> set[Grant]:  # noqa: F811
    """Every (group, resource, verb) Kopf and the operator ask of the API through one job's
    life (create, rescale, a failed world, success), with peering on."""
    cluster.objects["kopf.dev/v1/clusterkopfpeerings", None, "splitfeed"] = {
        "apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
        "metadata": {"name": "splitfeed", "resourceVersion": "1"}}
    add_job(cluster, manifest(replicas=2, maxRestarts=2))
    async with running_operator(cluster, peering="splitfeed"):
        await until(lambda: len(pods_of(cluster)) == 2, what="world 0")
        cluster.objects["splitfeed.io/v1alpha1/streamingjobs", "ns", "resnet"].patch(
            {"spec": {"replicas": 1}, "metadata": {"resourceVersion": "2", "generation": 2}})
        await until(lambda: all(p["metadata"].get("annotations", {}).get("splitfeed.io/drain")
                                for p in pods_of(cluster).values()), what="drain annotations")
        for name in list(pods_of(cluster)):
            cluster.objects[PODS, "ns", name].patch({"status": {"phase": "Succeeded"}})
        await until(lambda: "resnet-w1-0" in pods_of(cluster), what="world 1")
        cluster.objects[PODS, "ns", "resnet-w1-0"].patch({"status": {"phase": "Failed"}})
        await until(lambda: "resnet-w2-0" in pods_of(cluster), what="world 2 after a failure")
        cluster.objects[PODS, "ns", "resnet-w2-0"].patch({"status": {"phase": "Succeeded"}})
        await until(lambda: phase(cluster) == "Succeeded", what="Succeeded")
    found: set[Grant] = set()
    for request in cluster:
        grant = request_grant(str(request.method.value if hasattr(request.method, "value") else request.method),
                              request.url.path, request.params)
        if grant is not None:
            found.add(grant)
    return found


@pytest_asyncio.fixture()
async def recorded(cluster: Any) -> set[Grant]:  # noqa: F811
    """The recording (`_record`), made by the first test of the run that needs it: no test
    depends on another having run first."""
    if not _RECORDED:
        _RECORDED.update(await _record(cluster))
    return _RECORDED


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_the_recording_holds_kopfs_watch_and_the_operators_pod_deletes(recorded):
    assert ("splitfeed.io", "streamingjobs", "watch") in recorded  # Kopf's
    assert ("", "pods", "delete") in recorded  # ours


def needed(recorded: set[Grant]) -> set[Grant]:
    found = client_calls(ROOT / "operator" / "cluster" / "kube.py") | recorded
    owner_ref = next(o for o in planning.world(specs.parse_job(manifest()), 0, OWNER, planning.Settings())
                     if o["kind"] == "Pod")["metadata"]["ownerReferences"][0]
    if owner_ref.get("blockOwnerDeletion"):
        found.add((wellknown.GROUP, f"{wellknown.PLURAL}/finalizers", "update"))
    return found


def split(found: set[Grant], *, peering: bool, sar: bool, cluster_mode: bool = True, netpol: bool = True,
          ) -> tuple[set[Grant], set[Grant], set[Grant]]:
    """(namespaced, cluster-scoped, leader Lease) grants for the chart's values.

    Kopf peers through ClusterKopfPeerings when it serves every namespace (as
    recorded) and through KopfPeerings in its namespaces otherwise, with the same verbs.
    """
    wanted = {g for g in found if (peering or g[0] != "kopf.dev") and (sar or g[1] != "subjectaccessreviews")
              and (netpol or g[1] != "networkpolicies")}
    if not cluster_mode:
        wanted = {("kopf.dev", "kopfpeerings", g[2]) if g[1] == "clusterkopfpeerings" else g for g in wanted}
    lease = {g for g in wanted if g[1] == "leases"}
    cluster_scoped = {g for g in wanted if g[1] in CLUSTER_SCOPED}
    return wanted - lease - cluster_scoped, cluster_scoped, lease


def roles(objs: list[dict[str, Any]]) -> dict[tuple[str, str | None], set[Grant]]:
    return {(o["kind"], o["metadata"]["name"].rsplit("-", 1)[-1] if o["kind"] == "Role" else None): grants(o["rules"])
            for o in objs if o["kind"] in ("Role", "ClusterRole")}


@pytest.mark.timeout(90)
def test_cluster_mode_grants_exactly_what_the_code_uses(recorded):
    namespaced, cluster_scoped, lease = split(needed(recorded), peering=False, sar=False)
    objs = objects()
    assert roles(objs) == {("ClusterRole", None): namespaced | cluster_scoped, ("Role", "leader"): lease}


@pytest.mark.timeout(90)
def test_peering_and_the_permission_check_add_exactly_their_grants(recorded):
    namespaced, cluster_scoped, lease = split(needed(recorded), peering=True, sar=True)
    values = {**SCENARIOS["hardened-webhook"], "leaderElection": {"enabled": True}}
    assert roles(objects(values)) == {("ClusterRole", None): namespaced | cluster_scoped, ("Role", "leader"): lease}


@pytest.mark.parametrize("peering", [False, True])
@pytest.mark.timeout(90)
def test_namespace_mode_grants_the_namespaced_part_in_each_namespace(recorded, peering):
    namespaced, cluster_scoped, lease = split(needed(recorded), peering=peering, sar=False, cluster_mode=False)
    objs = objects({**SCENARIOS["namespace-list"], "peering": {"enabled": peering, "name": "splitfeed"}})
    by_ns = {o["metadata"]["namespace"]: grants(o["rules"]) for o in objs
             if o["kind"] == "Role" and not o["metadata"]["name"].endswith("-leader")}
    assert by_ns == {"team-a": namespaced, "team-b": namespaced}
    (cluster_role,) = [o for o in objs if o["kind"] == "ClusterRole"]
    assert grants(cluster_role["rules"]) == cluster_scoped


@pytest.mark.parametrize("cluster_mode", [True, False])
@pytest.mark.timeout(90)
def test_without_network_policies_the_chart_grants_nothing_on_them(recorded, cluster_mode):
    namespaced, cluster_scoped, lease = split(needed(recorded), peering=False, sar=False, cluster_mode=cluster_mode,
                                              netpol=False)
    values = {"networkPolicy": {"enabled": False}, **({} if cluster_mode else SCENARIOS["namespace-list"])}
    objs = objects(values)
    if cluster_mode:
        assert roles(objs) == {("ClusterRole", None): namespaced | cluster_scoped, ("Role", "leader"): lease}
    else:
        by_ns = {o["metadata"]["namespace"]: grants(o["rules"]) for o in objs
                 if o["kind"] == "Role" and not o["metadata"]["name"].endswith("-leader")}
        assert by_ns == {"team-a": namespaced, "team-b": namespaced}


def test_the_static_reading_of_kube_py_sees_every_call():
    calls = client_calls(ROOT / "operator" / "cluster" / "kube.py")
    assert ("", "pods", "create") in calls and (wellknown.GROUP, "streamingjobs/status", "patch") in calls
    assert ("coordination.k8s.io", "leases", "update") in calls
    assert ("authorization.k8s.io", "subjectaccessreviews", "create") in calls
    assert {("networking.k8s.io", "networkpolicies", v) for v in ("get", "create", "patch")} <= calls
