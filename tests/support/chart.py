"""The Helm chart rendered offline by Helm's own engine (helm-python-sdk), the values
scenarios the chart tests render, and RBAC rules as (group, resource, verb) grants:
shared by tests/chart/test_chart.py and test_rbac.py."""

from __future__ import annotations

import base64
import copy
import pathlib
from typing import Any

import helm_python
import yaml

CHART = pathlib.Path(__file__).resolve().parents[2] / "charts" / "splitfeed"
RELEASE, NAMESPACE = "sf", "ml"
CA_BUNDLE = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n").decode()

SCENARIOS: dict[str, dict[str, Any]] = {
    "default": {},
    "single-namespace": {"watch": {"allNamespaces": False, "namespace": "ml-team"}},
    "single-namespace-release": {"watch": {"allNamespaces": False}},
    "namespace-list": {"watch": {"allNamespaces": False, "namespaces": ["team-a", "team-b"]}},
    "hardened-webhook": {"webhook": {"enabled": True, "caBundle": CA_BUNDLE, "certSecretName": "tls",
                                     "checkPodPermission": True, "dryRunPods": False},
                         "peering": {"enabled": True, "name": "splitfeed"}, "leaderElection": {"enabled": False},
                         "failure": {"restartBackoffSeconds": 1, "restartBackoffMaxSeconds": 5, "stallTimeoutSeconds": 60}},
    "webhook": {"webhook": {"enabled": True, "caBundle": CA_BUNDLE, "certSecretName": "splitfeed-webhook-tls"}},
    "webhook-cert-manager": {"webhook": {"enabled": True, "certManager": {"enabled": True}}},
    "webhook-cert-manager-issuer": {
        "webhook": {"enabled": True, "certManager": {"enabled": True, "issuerRef": {"kind": "ClusterIssuer", "name": "corp-ca"}}}
    },
    "crds-disabled": {"crds": {"enabled": False}},
    "network-policy-off": {"networkPolicy": {"enabled": False}},
    "custom-sidecar": {
        "sidecar": {"image": "registry.example.com/splitfeed:0.2.0", "mode": "container", "shmSize": "8Gi", "prefetchBatches": 8}
    },
    "everything": {
        "image": {"repository": "registry.example.com/splitfeed", "tag": "0.1.0-rc1", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "crds": {"enabled": False},
        "watch": {"allNamespaces": False, "namespace": "ml-team"},
        "sidecar": {"image": "registry.example.com/splitfeed-sidecar:0.1.0", "mode": "container", "shmSize": "4Gi", "prefetchBatches": 2},
        "serviceAccount": {"create": False, "name": "existing-sa"},
        "podAnnotations": {"prometheus.io/scrape": "false"},
        "podLabels": {"team": "ml"},
        "priorityClassName": "system-cluster-critical",
        "resources": {"requests": {"cpu": "200m", "memory": "300Mi"}, "limits": {"memory": "1Gi"}},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
        "webhook": {"enabled": True, "port": 10443, "failurePolicy": "Ignore", "caBundle": CA_BUNDLE, "certSecretName": "tls"},
        "networkPolicy": {"metrics": {"from": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
             "podSelector": {"matchExpressions": [{"key": "app.kubernetes.io/name", "operator": "In",
                                                   "values": ["prometheus"]}]}},
            {"ipBlock": {"cidr": "10.20.0.0/16", "except": ["10.20.1.0/24"]}}]}},
    },
}


def rendered(values: dict[str, Any] | None = None, *, name: str = RELEASE, namespace: str = NAMESPACE) -> dict[str, str]:
    chart = helm_python.Chart.load(CHART)
    try:
        return chart.render(copy.deepcopy(values or {}), name=name, namespace=namespace)
    finally:
        chart.close()


def objects(values: dict[str, Any] | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    docs = []
    for path, text in sorted(rendered(values, **kwargs).items()):
        if path.endswith(".yaml"):
            docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule["verbs"]
    }
