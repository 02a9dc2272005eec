"""The job's NetworkPolicy (operator/objects/policies.py), read the way a CNI reads it.

`admitted` below evaluates a policy by the Kubernetes rules (a peer's podSelector alone
means the policy's namespace; an absent `from` or `ports` means every source or port)
rather than comparing the builder's output with itself, and the ports it is asked
about come from the pods and Service that planning builds, not from the policy module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import kubernetes_validate
import pytest

from splitfeed.operator import commands
from splitfeed.operator.objects import planning, policies
from splitfeed.trainer_client import cli
from splitfeed.trainer_client.contract import wellknown, errors, specs
from tests.support.builders import OWNER, manifest

OPERATOR_NS, OPERATOR_LABELS = "splitfeed-system", {"app.kubernetes.io/name": "splitfeed",
                                                    "app.kubernetes.io/component": "operator"}
OPERATOR_FROM = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": OPERATOR_NS}},
                  "podSelector": {"matchLabels": OPERATOR_LABELS}}]
MONITORING_FROM = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
SETTINGS = policies.parse(json.dumps(OPERATOR_FROM), json.dumps(MONITORING_FROM))
ENABLED = planning.Settings(network_policy=SETTINGS)


def ns_labels(name: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": name}


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """metav1.LabelSelector semantics; {} selects everything."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": present and value in e["values"], "NotIn": not present or value not in e["values"],
              "Exists": present, "DoesNotExist": not present}[e["operator"]]
        if not ok:
            return False
    return True


def peer_admits(peer: Mapping[str, Any], policy_ns: str, ns: str, labels: Mapping[str, str]) -> bool:
    if "ipBlock" in peer:
        return False  # the sources asked about here are pods
    ns_ok = selects(peer["namespaceSelector"], ns_labels(ns)) if "namespaceSelector" in peer else ns == policy_ns
    return ns_ok and selects(peer.get("podSelector") or {}, labels)


def admitted(policy: Mapping[str, Any], ns: str, labels: Mapping[str, str], port: int) -> bool:
    """May a pod in `ns` with `labels` connect to `port` of a pod the policy selects?"""
    spec, policy_ns = policy["spec"], policy["metadata"]["namespace"]
    for rule in spec.get("ingress") or []:
        sources = rule.get("from")
        ports = rule.get("ports")
        source_ok = not sources or any(peer_admits(p, policy_ns, ns, labels) for p in sources)
        port_ok = not ports or any(p.get("protocol", "TCP") == "TCP" and p["port"] == port for p in ports)
        if source_ok and port_ok:
            return True
    return False


def job(**spec: Any) -> specs.JobSpec:
    return specs.parse_job(manifest(**spec))


def the_policy(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    return found


def env_of(pod: Mapping[str, Any]) -> dict[str, str]:
    spec = pod["spec"]
    return {e["name"]: e.get("value") for c in spec.get("containers", []) + spec.get("initContainers", [])
            for e in c.get("env") or []}


def control_ports(objs: list[dict[str, Any]]) -> tuple[set[int], set[int], set[int]]:
    """(coordinator, rendezvous, metrics) ports as the world's pods and Service use them."""
    pods = [o for o in objs if o["kind"] == "Pod"]
    coordinator = {int(env_of(p)[wellknown.COORDINATOR_ENV].rsplit(":", 1)[1]) for p in pods}
    rendezvous = {int(env_of(p)[wellknown.MASTER_PORT_ENV]) for p in pods}
    service = next(o for o in objs if o["kind"] == "Service")
    coordinator |= {p["port"] for p in service["spec"]["ports"] if p["name"].startswith("coordinator")}
    rendezvous |= {p["port"] for p in service["spec"]["ports"] if p["name"].startswith("rendezvous")}
    metrics = {int(port["containerPort"]) for p in pods
               for c in p["spec"].get("containers", []) + p["spec"].get("initContainers", [])
               for port in c.get("ports") or [] if port.get("name") == "metrics"}
    metrics |= {int(env_of(p)[wellknown.METRICS_PORT_ENV]) for p in pods}
    return coordinator, rendezvous, metrics


WORLDS = [pytest.param("recreate", id="recreate"), pytest.param("inPlace", id="in-place")]


# --- the object ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["1.25.0", "1.30.0"])
@pytest.mark.parametrize("rescale", ["recreate", "inPlace"])
def test_the_policy_is_valid_for_kubernetes(version, rescale):
    kubernetes_validate.validate(the_policy(planning.world(job(rescale=rescale), 0, OWNER, ENABLED)),
                                 version, strict=True)


def test_a_world_gets_the_policy_before_its_pods_only_when_the_operator_is_told_to():
    kinds = [o["kind"] for o in planning.world(job(replicas=2), 0, OWNER, ENABLED)]
    assert kinds == ["ConfigMap", "Service", "PodDisruptionBudget", "NetworkPolicy", "Pod", "Pod"]
    assert "NetworkPolicy" not in [o["kind"] for o in planning.world(job(replicas=2), 0, OWNER, planning.Settings())]


def test_the_policy_is_the_jobs_own_and_allows_egress():
    policy = the_policy(planning.world(job(), 3, OWNER, ENABLED))
    assert policy["metadata"]["name"] == "resnet" and policy["metadata"]["namespace"] == "ns"
    assert policy["metadata"]["ownerReferences"] == [OWNER.reference()]
    assert policy["metadata"]["labels"] == {wellknown.LABEL_JOB: "resnet"}
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress: not restricted
    assert "egress" not in policy["spec"]


# --- whom it selects ----------------------------------------------------------------------


@pytest.mark.parametrize("rescale", WORLDS)
def test_it_selects_every_pod_of_every_world_of_the_job_and_no_other_jobs(rescale):
    j = job(rescale=rescale)
    policy = the_policy(planning.world(j, 0, OWNER, ENABLED))
    for epoch in range(4):
        for p in (o for o in planning.world(j, epoch, OWNER, ENABLED) if o["kind"] == "Pod"):
            assert selects(policy["spec"]["podSelector"], p["metadata"]["labels"]), p["metadata"]["name"]
    other = next(o for o in planning.world(specs.parse_job(manifest(name="other")), 0, OWNER, ENABLED)
                 if o["kind"] == "Pod")
    assert not selects(policy["spec"]["podSelector"], other["metadata"]["labels"])


def test_a_template_label_cannot_take_a_pod_out_of_the_policy():
    m = manifest()
    m["spec"]["trainer"]["template"]["metadata"]["labels"][wellknown.LABEL_JOB] = "elsewhere"
    objs = planning.world(specs.parse_job(m), 0, OWNER, ENABLED)
    policy = the_policy(objs)
    assert all(selects(policy["spec"]["podSelector"], o["metadata"]["labels"]) for o in objs if o["kind"] == "Pod")


# --- what it admits -----------------------------------------------------------------------


@pytest.mark.parametrize("rescale", WORLDS)
def test_the_jobs_own_pods_reach_every_control_port_of_every_world_and_torchs_own(rescale):
    j = job(rescale=rescale)
    policy = the_policy(planning.world(j, 0, OWNER, ENABLED))
    ports: set[int] = set()
    for epoch in range(4):
        coordinator, rendezvous, metrics = control_ports(planning.world(j, epoch, OWNER, ENABLED))
        ports |= coordinator | rendezvous | metrics
    assert len(ports) == (5 if rescale == "inPlace" else 3), ports  # the in-place worlds alternate two pairs
    member = {"team": "vision", wellknown.LABEL_JOB: "resnet", wellknown.LABEL_REPLICA: "1"}
    # 41234: a port gloo or NCCL picked for a collective between two pods of the job.
    for port in ports | {41234}:
        assert admitted(policy, "ns", member, port), port


@pytest.mark.parametrize("rescale", WORLDS)
def test_the_operator_reaches_every_worlds_coordinator_and_nothing_else(rescale):
    j = job(rescale=rescale)
    policy = the_policy(planning.world(j, 0, OWNER, ENABLED))
    reached, others = set(), set()
    for epoch in range(4):
        coordinator, rendezvous, metrics = control_ports(planning.world(j, epoch, OWNER, ENABLED))
        reached |= coordinator
        others |= rendezvous | metrics
    for port in reached:
        assert admitted(policy, OPERATOR_NS, OPERATOR_LABELS, port), port
    for port in others | {41234}:
        assert not admitted(policy, OPERATOR_NS, OPERATOR_LABELS, port), port
    # Its labels in another namespace, or another pod of its namespace, are not the operator.
    assert not any(admitted(policy, "ns", OPERATOR_LABELS, p) for p in reached)
    assert not any(admitted(policy, OPERATOR_NS, {"app": "debug"}, p) for p in reached)


@pytest.mark.parametrize("rescale", WORLDS)
def test_the_metrics_peers_reach_the_metrics_port_only(rescale):
    j = job(rescale=rescale)
    objs = planning.world(j, 1, OWNER, ENABLED)
    policy = the_policy(objs)
    coordinator, rendezvous, metrics = control_ports(objs)
    assert metrics == {wellknown.METRICS_PORT}
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    assert all(admitted(policy, "monitoring", prometheus, p) for p in metrics)
    assert not any(admitted(policy, "monitoring", prometheus, p) for p in coordinator | rendezvous)
    assert not any(admitted(policy, "default", prometheus, p) for p in metrics)


def test_a_pod_of_another_job_or_namespace_reaches_nothing():
    objs = planning.world(job(rescale="inPlace"), 0, OWNER, ENABLED)
    policy = the_policy(objs)
    stranger = {wellknown.LABEL_JOB: "other", "team": "vision"}
    ports = set().union(*control_ports(objs)) | {41234}
    assert not any(admitted(policy, "ns", stranger, p) for p in ports)
    assert not any(admitted(policy, "elsewhere", {wellknown.LABEL_JOB: "resnet"}, p) for p in ports)


def test_no_peers_admit_nobody_rather_than_everybody():
    """An ingress rule with an empty `from` admits every source: such a rule is never written."""
    no_metrics = the_policy(planning.world(job(), 0, OWNER, planning.Settings(
        network_policy=policies.parse(json.dumps(OPERATOR_FROM), "[]"))))
    no_operator = the_policy(planning.world(job(), 0, OWNER, planning.Settings(
        network_policy=policies.parse("[]", None))))
    for policy in (no_metrics, no_operator):
        assert all(rule.get("from") for rule in policy["spec"]["ingress"])
        assert not admitted(policy, "monitoring", {"app": "prometheus"}, wellknown.METRICS_PORT)
    assert admitted(no_metrics, OPERATOR_NS, OPERATOR_LABELS, wellknown.COORDINATOR_PORT)
    assert not admitted(no_operator, OPERATOR_NS, OPERATOR_LABELS, wellknown.COORDINATOR_PORT)


def test_a_templates_own_scrape_port_is_admitted_to_the_metrics_peers():
    m = manifest()
    m["spec"]["trainer"]["template"]["metadata"]["annotations"] = {"prometheus.io/port": "9400"}
    objs = planning.world(specs.parse_job(m), 0, OWNER, ENABLED)
    pod = next(o for o in objs if o["kind"] == "Pod")
    scraped = int(pod["metadata"]["annotations"]["prometheus.io/port"])
    assert scraped == 9400
    assert admitted(the_policy(objs), "monitoring", {}, scraped)
    assert admitted(the_policy(objs), "monitoring", {}, wellknown.METRICS_PORT)


# --- the operator's settings --------------------------------------------------------------


def config(*argv: str) -> Any:
    return commands.config_from_args(cli.build_parser().parse_args(["operator", *argv]))


def test_the_command_line_turns_it_on_with_its_peers_and_leaves_it_off_by_default():
    assert config().planning.network_policy is None
    c = config("--network-policy", "--network-policy-operator-from", json.dumps(OPERATOR_FROM),
               "--network-policy-metrics-from", json.dumps(MONITORING_FROM))
    assert c.planning.network_policy == policies.NetworkPolicy(tuple(OPERATOR_FROM), tuple(MONITORING_FROM))
    assert config("--network-policy", "--network-policy-operator-from", "[]").planning.network_policy == \
        policies.NetworkPolicy((), ())


def test_turning_it_on_without_naming_the_operators_pods_is_refused():
    with pytest.raises(errors.UserError, match="--network-policy needs --network-policy-operator-from"):
        config("--network-policy")


VALID_PEERS = [
    {"namespaceSelector": {}},
    {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
    {"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["ml", "ops"]},
                                                {"key": "frozen", "operator": "DoesNotExist"}]}},
    {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}},
    {"ipBlock": {"cidr": "fd00::/8"}},
]


def test_valid_peers_are_taken_as_given_and_make_a_valid_policy():
    settings = policies.parse("[]", json.dumps(VALID_PEERS))
    assert settings.metrics_from == tuple(VALID_PEERS)
    policy = planning.network_policy(job(), OWNER, settings)
    kubernetes_validate.validate(policy, "1.30.0", strict=True)


@pytest.mark.parametrize("text, said", [
    pytest.param("{oops", "not JSON", id="not-json"),
    pytest.param('{"namespaceSelector": {}}', "a JSON list of NetworkPolicyPeers, not dict", id="not-a-list"),
    pytest.param("[{}]", "[0]: a NetworkPolicyPeer has one or more of", id="empty-peer"),
    pytest.param('[{"namespaceSelector": {}}, {"namespace": "x"}]', "[1]: a NetworkPolicyPeer", id="unknown-key"),
    pytest.param('[{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]', "cannot be combined", id="ip-and-pods"),
    pytest.param('[{"podSelector": {"matchLabels": {"app": "no spaces"}}}]', "is not a label value", id="value"),
    pytest.param('[{"podSelector": {"matchLabels": {"-app": "x"}}}]', "is not a label key", id="key"),
    pytest.param('[{"podSelector": {"app": "x"}}]', "podSelector: a label selector has", id="bare-labels"),
    pytest.param('[{"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}]',
                 "matchExpressions[0]: key, operator", id="in-without-values"),
    pytest.param('[{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]}}]',
                 "matchExpressions[0]: key, operator", id="exists-with-values"),
    pytest.param('[{"ipBlock": {"cidr": "10.0.0.0/33"}}]', "ipBlock: ", id="bad-cidr"),
    pytest.param('[{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["192.168.0.0/16"]}}]',
                 "192.168.0.0/16 is not strictly inside 10.0.0.0/8", id="except-outside"),
])
def test_a_bad_peer_list_is_refused_naming_the_flag_and_the_peer(text, said):
    with pytest.raises(errors.UserError) as info:
        policies.parse("[]", text)
    assert str(info.value).startswith("--network-policy-metrics-from")
    assert said in str(info.value)
