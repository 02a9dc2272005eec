"""The job's NetworkPolicy (networking.k8s.io/v1): who may open connections to its pods.

Pure: the job's spec and the operator's `NetworkPolicy` settings in, a plain dict out.
`planning.world` puts it among a world's objects (before the pods) when the operator runs
with --network-policy (the Helm chart's networkPolicy.enabled). Defence in depth beside the
job's CURVE keypair (docs/security.md, "Network policy"): the coordinator already refuses
what is not the job, and torch's rendezvous and collectives are not authenticated at all.

A policy that selects a pod denies it every connection no rule admits, so the rules are
the whole list of who talks to a job's pods:

- the job's own pods, on every port: the coordinator and the rendezvous, and also torch's
  collectives (gloo's pairs, NCCL's bootstrap and socket transport), which listen on ports
  the system picks and that no policy could name;
- the operator's pods, on the coordinator's ports only (its drain and status requests);
- the peers the chart names (`--network-policy-metrics-from`), on the metrics ports only.

The kubelet's probes come from the node, which a NetworkPolicy always admits. Egress is
left open: the pods read their table and write checkpoints to stores the operator cannot
know.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from splitfeed.trainer_client.contract import wellknown, errors, layout, specs

API_VERSION = "networking.k8s.io/v1"
KIND = "NetworkPolicy"
SCRAPE_PORT_ANNOTATION = "prometheus.io/port"
"""A template may point its pods' scrape annotations at a trainer's own metrics port
(planning.SCRAPE_ANNOTATIONS): that port is then admitted to the metrics peers as well."""

Peer = Mapping[str, Any]
"""A NetworkPolicyPeer as the API writes it: podSelector, namespaceSelector and/or ipBlock."""


@dataclasses.dataclass(frozen=True)
class NetworkPolicy:
    """The operator-wide half of every job's policy: who besides the job's own pods gets in."""

    operator_from: tuple[Peer, ...]
    """Where the operator's requests to a coordinator come from (the chart: its own pods, by
    namespace and pod labels). Empty: nowhere, and drains go by the pod annotation only."""
    metrics_from: tuple[Peer, ...] = ()
    """Who may scrape the metrics ports (the chart's networkPolicy.metrics.from). Empty: nobody;
    never "everybody", which an empty `from` would mean to the API."""


def parse(operator_from: str | None, metrics_from: str | None) -> NetworkPolicy:
    """Settings from the two flags' JSON lists; a UserError naming the flag when one is bad."""
    if operator_from is None:
        raise errors.UserError(
            "--network-policy needs --network-policy-operator-from: a JSON list of NetworkPolicyPeers "
            "matching the operator's pods (the Helm chart passes its namespace and pod labels), or [] "
            "to admit none (then drains go by the pod annotation only)")
    return NetworkPolicy(operator_from=peers_of(operator_from, "--network-policy-operator-from"),
                         metrics_from=peers_of(metrics_from or "[]", "--network-policy-metrics-from"))


def peers_of(text: str, field: str) -> tuple[Peer, ...]:
    """A JSON list of NetworkPolicyPeers, checked as the apiserver would check them: a peer it
    refused would fail every job's world (HTTP 422), so a bad one stops the operator instead."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise errors.UserError(f"{field}: not JSON ({exc}); give a list such as "
                               '[{"namespaceSelector": {"matchLabels": {"team": "ml"}}}]') from exc
    if not isinstance(raw, list):
        raise errors.UserError(f"{field}: a JSON list of NetworkPolicyPeers, not {type(raw).__name__}")
    return tuple(_peer(p, f"{field}[{i}]") for i, p in enumerate(raw))


def _peer(raw: Any, field: str) -> dict[str, Any]:
    known = {"podSelector", "namespaceSelector", "ipBlock"}
    if not isinstance(raw, dict) or not raw or set(raw) - known:
        raise errors.UserError(f"{field}: a NetworkPolicyPeer has one or more of {sorted(known)} and nothing "
                               f"else, got {json.dumps(raw)}")
    if "ipBlock" in raw and len(raw) > 1:
        raise errors.UserError(f"{field}: ipBlock cannot be combined with a selector; make them two peers")
    for key in ("podSelector", "namespaceSelector"):
        if key in raw:
            _selector(raw[key], f"{field}.{key}")
    if "ipBlock" in raw:
        _ip_block(raw["ipBlock"], f"{field}.ipBlock")
    return dict(raw)


_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_VALUE = re.compile(rf"({_NAME})?")
_LABEL_KEY = re.compile(rf"([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_NAME}")
_OPERATORS = {"In": True, "NotIn": True, "Exists": False, "DoesNotExist": False}
"""A matchExpressions operator, and whether it takes values."""


def _selector(raw: Any, field: str) -> None:
    if not isinstance(raw, dict) or set(raw) - {"matchLabels", "matchExpressions"}:
        raise errors.UserError(f"{field}: a label selector has matchLabels and/or matchExpressions, "
                               f"got {json.dumps(raw)}")
    labels = raw.get("matchLabels") or {}
    if not isinstance(labels, dict):
        raise errors.UserError(f"{field}.matchLabels: a map of label keys to values")
    for key, value in labels.items():
        _label(key, value, f"{field}.matchLabels")
    expressions = raw.get("matchExpressions") or []
    if not isinstance(expressions, list):
        raise errors.UserError(f"{field}.matchExpressions: a list of {{key, operator, values}}")
    for i, e in enumerate(expressions):
        where = f"{field}.matchExpressions[{i}]"
        takes = _OPERATORS.get(str(e.get("operator"))) if isinstance(e, dict) else None
        values = e.get("values") or [] if isinstance(e, dict) else []
        if takes is None or set(e) - {"key", "operator", "values"} or not isinstance(values, list) \
                or bool(values) != takes:
            raise errors.UserError(f"{where}: key, operator ({', '.join(_OPERATORS)}) and values (for In and "
                                   f"NotIn only, at least one), got {json.dumps(e)}")
        for v in values:
            _label(e.get("key"), v, where)


def _label(key: Any, value: Any, field: str) -> None:
    if not (isinstance(key, str) and len(key) <= 317 and _LABEL_KEY.fullmatch(key)):
        raise errors.UserError(f"{field}: {json.dumps(key)} is not a label key (a name of up to 63 characters, "
                               "with an optional DNS prefix and /)")
    if not (isinstance(value, str) and _LABEL_VALUE.fullmatch(value)):
        raise errors.UserError(f"{field}: {json.dumps(value)} is not a label value for {key} (a string of up "
                               "to 63 letters, digits, -, _ and ., beginning and ending alphanumeric)")


def _ip_block(raw: Any, field: str) -> None:
    if not isinstance(raw, dict) or "cidr" not in raw or set(raw) - {"cidr", "except"}:
        raise errors.UserError(f"{field}: cidr and an optional except list, got {json.dumps(raw)}")
    try:
        cidr = ipaddress.ip_network(str(raw["cidr"]), strict=False)
        excepted = [ipaddress.ip_network(str(e), strict=False) for e in raw.get("except") or []]
    except ValueError as exc:
        raise errors.UserError(f"{field}: {exc}") from exc
    for e in excepted:
        if e.version != cidr.version or not e.subnet_of(cidr) or e == cidr:  # type: ignore[arg-type]
            raise errors.UserError(f"{field}.except: {e} is not strictly inside {cidr}")


def coordinator_ports(job: specs.JobSpec) -> list[int]:
    """Every port a world of the job may bind its coordinator on: one, or the two that in-place
    worlds alternate between (layout.WorldLayout.alternating)."""
    first = layout.WorldLayout.at(0, in_place=job.in_place)
    return sorted({w.coordinator_port for w in first.alternating() if w.coordinator_port is not None})


def metrics_ports(job: specs.JobSpec) -> list[int]:
    """The sidecar's metrics port, and the one the template's scrape annotation names, if any."""
    annotations = (job.trainer.template.get("metadata") or {}).get("annotations") or {}
    named = str(annotations.get(SCRAPE_PORT_ANNOTATION, ""))
    extra = {int(named)} if named.isdigit() and 0 < int(named) < 65536 else set()
    return sorted({wellknown.METRICS_PORT} | extra)


def _ports(ports: Sequence[int]) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": p} for p in ports]


def network_policy(job: specs.JobSpec, metadata: Mapping[str, Any], settings: NetworkPolicy) -> dict[str, Any]:
    """The job's policy: selects every pod of every world (the job label the pods carry) and
    admits what the module docstring lists. `metadata`: name, namespace, labels, owner."""
    own = {"matchLabels": {wellknown.LABEL_JOB: job.name}}
    rules: list[dict[str, Any]] = [{"from": [{"podSelector": own}]}]
    # An empty `from` admits every source: a rule without peers is left out, never written empty.
    if settings.operator_from:
        rules.append({"from": [dict(p) for p in settings.operator_from], "ports": _ports(coordinator_ports(job))})
    if settings.metrics_from:
        rules.append({"from": [dict(p) for p in settings.metrics_from], "ports": _ports(metrics_ports(job))})
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": dict(metadata),
        "spec": {"podSelector": own, "policyTypes": ["Ingress"], "ingress": rules},
    }
