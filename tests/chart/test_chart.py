"""The Helm chart: rendered offline with helm-python-sdk (Helm's own engine),
linted strictly, and every object checked against Kubernetes 1.30's schemas.

Besides validity, the tests pin what the operator relies on (its command line
and environment), least-privilege RBAC in both watch modes, the webhook
wiring, and that the chart's CRD is the one in crds/ and its sidecar defaults
are the config model's.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import pathlib
from collections.abc import Iterator
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from splitfeed.trainer_client.contract import specs
from tests.support.chart import CA_BUNDLE, CHART, NAMESPACE, RELEASE, SCENARIOS, grants, objects, rendered

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCENARIO_PARAMS = [pytest.param(values, id=name) for name, values in SCENARIOS.items()]


def of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = of_kind(objs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


# --- validity ---------------------------------------------------------------------


class TestValidity:
    def test_lint_passes_strictly_with_default_values(self):
        report = helm_python.lint(CHART, strict=True)
        assert report["errors"] == []
        assert [m for m in report["messages"] if m["severity"] >= 2] == []

    @pytest.mark.parametrize("values", SCENARIO_PARAMS)
    def test_lint_passes_strictly_with_every_scenario(self, values):
        report = helm_python.lint(CHART, copy.deepcopy(values), strict=True, namespace=NAMESPACE)
        assert report["errors"] == []
        assert [m for m in report["messages"] if m["severity"] >= 2] == []

    @pytest.mark.parametrize("values", SCENARIO_PARAMS)
    def test_every_object_validates_against_kubernetes_1_30(self, values):
        # kubernetes-validate ships the apiextensions.k8s.io/v1 schema, so the
        # CustomResourceDefinition is validated like everything else. It has
        # no schema for cert-manager's kinds (not part of Kubernetes): those
        # are checked against CERT_MANAGER below, and we assert it still lacks
        # them so that this exception is revisited if it ever gains them.
        objs = objects(values)
        assert objs
        for obj in objs:
            if obj["apiVersion"].startswith("cert-manager.io/"):
                with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                    kubernetes_validate.validate(obj, "1.30.0", strict=True)
                jsonschema.validate(obj, CERT_MANAGER[obj["kind"]])
            else:
                kubernetes_validate.validate(obj, "1.30.0", strict=True)

    @pytest.mark.parametrize("values", SCENARIO_PARAMS)
    def test_namespaced_objects_land_in_the_release_or_watched_namespace(self, values):
        watch = values.get("watch", {})
        watched = set(watch.get("namespaces") or [watch.get("namespace") or NAMESPACE])
        for obj in objects(values):
            namespace = obj["metadata"].get("namespace")
            if obj["kind"] in {"Role", "RoleBinding"} and not obj["metadata"]["name"].endswith("-leader"):
                assert namespace in watched
            elif obj["kind"] in CLUSTER_SCOPED:
                assert namespace is None
            else:
                assert namespace == NAMESPACE, obj["kind"]

    def test_two_releases_in_two_namespaces_do_not_share_cluster_scoped_names(self):
        values = SCENARIOS["webhook"]
        names = [
            {(o["kind"], o["metadata"]["name"]) for o in objects(values, namespace=ns)
             if o["kind"] in CLUSTER_SCOPED - {"CustomResourceDefinition"}}
            for ns in ("team-a", "team-b")
        ]
        assert names[0] and not names[0] & names[1]

    def test_the_chart_metadata(self):
        chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
        assert (chart["apiVersion"], chart["name"], chart["version"], chart["appVersion"]) == (
            "v2", "splitfeed", "0.1.0", "0.1.0")


CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "ValidatingWebhookConfiguration", "CustomResourceDefinition"}

# The parts of cert-manager's v1 API this chart uses (cert-manager.io/v1
# Certificate and Issuer); kubernetes-validate has no schemas for them.
_META = {"type": "object", "required": ["name", "namespace"],
         "properties": {"name": {"type": "string", "minLength": 1}, "namespace": {"type": "string"}}}
CERT_MANAGER = {
    "Certificate": {
        "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "cert-manager.io/v1"}, "kind": {"const": "Certificate"}, "metadata": _META,
            "spec": {
                "type": "object", "additionalProperties": False, "required": ["secretName", "issuerRef", "dnsNames"],
                "properties": {
                    "secretName": {"type": "string", "minLength": 1},
                    "duration": {"type": "string", "pattern": "^[0-9]+(h|m|s)$"},
                    "renewBefore": {"type": "string", "pattern": "^[0-9]+(h|m|s)$"},
                    "dnsNames": {"type": "array", "minItems": 1, "items": {"type": "string"}},
                    "privateKey": {"type": "object", "additionalProperties": False, "properties": {
                        "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]}, "size": {"type": "integer"},
                        "rotationPolicy": {"enum": ["Never", "Always"]}}},
                    "issuerRef": {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
                        "name": {"type": "string", "minLength": 1}, "kind": {"enum": ["Issuer", "ClusterIssuer"]},
                        "group": {"type": "string"}}},
                },
            },
        },
    },
    "Issuer": {
        "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "cert-manager.io/v1"}, "kind": {"const": "Issuer"}, "metadata": _META,
            "spec": {"type": "object", "minProperties": 1, "maxProperties": 1,
                     "properties": {"selfSigned": {"type": "object"}}, "additionalProperties": False},
        },
    },
}


# --- the operator Deployment ---------------------------------------------------------


class TestDeployment:
    def test_one_replica_recreated_never_rolled(self):
        deployment = one(objects(), "Deployment")
        assert deployment["spec"]["replicas"] == 1
        assert deployment["spec"]["strategy"] == {"type": "Recreate"}

    def test_cluster_mode_watches_all_namespaces(self):
        c = container(objects())
        assert c["command"] == ["splitfeed", "operator"]
        assert c["args"] == [
            "--liveness=http://0.0.0.0:8080/healthz", "--all-namespaces", "--sidecar-mode", "native",
            "--standalone", "--leader-elect", "--leader-election-lease", "splitfeed-operator",
            "--restart-backoff", "10", "--restart-backoff-max", "360", "--stall-timeout", "900",
            "--metrics-port", "8090", "--network-policy",
            "--network-policy-operator-from", json.dumps([{
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator",
                                                "app.kubernetes.io/instance": RELEASE,
                                                "app.kubernetes.io/name": "splitfeed"}}}], separators=(",", ":")),
            "--network-policy-metrics-from", '[{"namespaceSelector":{}}]',
        ]
        assert c["image"] == "splitfeed:0.1.0"

    @pytest.mark.parametrize(
        "values,namespace",
        [
            pytest.param(SCENARIOS["single-namespace"], "ml-team", id="named"),
            pytest.param(SCENARIOS["single-namespace-release"], NAMESPACE, id="release"),
        ],
    )
    def test_single_namespace_mode_watches_one_namespace(self, values, namespace):
        args = container(objects(values))["args"]
        assert "--all-namespaces" not in args
        assert args[args.index("--namespace") + 1] == namespace

    def test_a_list_of_namespaces_is_watched_each_through_its_own_role(self):
        objs = objects(SCENARIOS["namespace-list"])
        args = container(objs)["args"]
        assert [args[i + 1] for i, a in enumerate(args) if a == "--namespace"] == ["team-a", "team-b"]
        roles = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in of_kind(objs, "Role")}
        assert roles == {("team-a", f"{RELEASE}-splitfeed"), ("team-b", f"{RELEASE}-splitfeed"),
                         (NAMESPACE, f"{RELEASE}-splitfeed-leader")}
        for binding in of_kind(objs, "RoleBinding"):
            assert binding["roleRef"]["name"] in {name for _, name in roles}
            assert binding["subjects"][0]["namespace"] == NAMESPACE
        assert "team-a, team-b" in rendered(SCENARIOS["namespace-list"])["splitfeed/templates/NOTES.txt"]

    def test_exactly_one_operator_is_active_through_a_lease_by_default(self):
        args = container(objects())["args"]
        assert "--leader-elect" in args
        env = {e["name"]: e for e in container(objects())["env"]}
        # commands.py takes the Lease's namespace from here: the release's.
        assert env["SPLITFEED_OPERATOR_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
        role = next(o for o in of_kind(objects(), "Role") if o["metadata"]["name"].endswith("-leader"))
        assert role["metadata"]["namespace"] == NAMESPACE
        assert "--leader-elect" not in container(objects({"leaderElection": {"enabled": False}}))["args"]
        assert not [o for o in of_kind(objects({"leaderElection": {"enabled": False}}), "Role")]

    def test_failure_policy_values_reach_the_operator(self):
        args = container(objects(SCENARIOS["hardened-webhook"]))["args"]
        assert [args[args.index(f) + 1] for f in ("--restart-backoff", "--restart-backoff-max", "--stall-timeout")] \
            == ["1", "5", "60"]
        assert "--webhook-check-pod-permission" in args and "--no-webhook-dry-run" in args
        default = container(objects(SCENARIOS["webhook"]))["args"]
        assert "--webhook-check-pod-permission" not in default and "--no-webhook-dry-run" not in default

    @pytest.mark.parametrize("scenario, port", [("default", "healthz"), ("webhook", "webhook")])
    def test_the_readiness_probe_is_the_webhook_port_when_there_is_one(self, scenario, port):
        c = container(objects(SCENARIOS[scenario]))
        probe = c["readinessProbe"]
        assert (probe.get("tcpSocket") or probe.get("httpGet"))["port"] == port
        assert any(p["name"] == port for p in c["ports"])

    def test_peering_is_opt_in(self):
        # One replica + Recreate never runs two operators; Kopf peering needs
        # Kopf's own CRDs, and with them missing a peering operator stays paused.
        args = container(objects({"peering": {"enabled": True, "name": "team-a"}}))["args"]
        assert "--standalone" not in args and args[args.index("--peering") + 1] == "team-a"

    def test_the_command_line_is_one_the_operator_accepts(self):
        # The contract with operator/commands.py: every scenario's argv parses.
        from splitfeed.trainer_client import cli

        for name, values in SCENARIOS.items():
            c = container(objects(values))
            args = cli.build_parser().parse_args([*c["command"][1:], *c["args"]])
            assert args.command == "operator", name

    def test_the_liveness_probe_hits_kopfs_endpoint(self):
        c = container(objects())
        assert "--liveness=http://0.0.0.0:8080/healthz" in c["args"]
        probe = c["livenessProbe"]["httpGet"]
        port = next(p for p in c["ports"] if p["name"] == probe["port"])
        assert (probe["path"], port["containerPort"]) == ("/healthz", 8080)

    def test_sidecar_defaults_reach_the_operator(self):
        c = container(objects(SCENARIOS["custom-sidecar"]))
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["SPLITFEED_SIDECAR_IMAGE"] == "registry.example.com/splitfeed:0.2.0"
        assert env["SPLITFEED_SIDECAR_SHM_SIZE"] == "8Gi"
        assert env["SPLITFEED_SIDECAR_PREFETCH_BATCHES"] == "8"
        assert c["args"][c["args"].index("--sidecar-mode") + 1] == "container"

    def test_the_sidecar_image_defaults_to_the_operator_image(self):
        values = {"image": {"repository": "registry.example.com/splitfeed", "tag": "1.2.3"}}
        c = container(objects(values))
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert c["image"] == env["SPLITFEED_SIDECAR_IMAGE"] == "registry.example.com/splitfeed:1.2.3"

    def test_chart_sidecar_defaults_are_the_config_models(self):
        # The CRD leaves these three undefaulted so that the operator fills
        # them from here; a job that sets none of them must get what
        # `splitfeed local` gives it (specs.SidecarSpec).
        env = {e["name"]: e.get("value") for e in container(objects())["env"]}
        model = specs.SidecarSpec()
        assert env["SPLITFEED_SIDECAR_IMAGE"] == model.image
        assert env["SPLITFEED_SIDECAR_SHM_SIZE"] == model.shm_size
        assert env["SPLITFEED_SIDECAR_PREFETCH_BATCHES"] == str(model.prefetch_batches)

    def test_scheduling_and_resources_come_from_values(self):
        values = SCENARIOS["everything"]
        pod = one(objects(values), "Deployment")["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == values["nodeSelector"]
        assert pod["tolerations"] == values["tolerations"]
        assert pod["affinity"] == values["affinity"]
        assert pod["containers"][0]["resources"] == values["resources"]
        assert pod["serviceAccountName"] == "existing-sa"
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]

    def test_the_operator_runs_unprivileged(self):
        pod = one(objects(), "Deployment")["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        sc = pod["containers"][0]["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]


# --- RBAC ------------------------------------------------------------------------


def expand(group: str, resources: list[str], verbs: list[str]) -> set[tuple[str, str, str]]:
    return {(group, r, v) for r in resources for v in verbs}


def rbac(objs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    return (o for o in objs if o["kind"] in {"Role", "ClusterRole"})


class TestRBAC:
    # What is granted is derived from the code in tests/chart/test_rbac.py; here, how.
    def test_cluster_mode_binds_one_cluster_role(self):
        objs = objects()
        assert [o["metadata"]["name"] for o in of_kind(objs, "Role")] == [f"{RELEASE}-splitfeed-leader"]
        role = one(objs, "ClusterRole")
        binding = one(objs, "ClusterRoleBinding")
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                      "name": role["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": one(objs, "ServiceAccount")["metadata"]["name"],
                                        "namespace": NAMESPACE}]

    def test_single_namespace_mode_uses_a_role_and_reads_only_crds_cluster_wide(self):
        objs = objects(SCENARIOS["single-namespace"])
        role = next(r for r in of_kind(objs, "Role") if not r["metadata"]["name"].endswith("-leader"))
        assert role["metadata"]["namespace"] == "ml-team"
        assert grants(one(objs, "ClusterRole")["rules"]) == {
            ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
            ("apiextensions.k8s.io", "customresourcedefinitions", "watch")}
        binding = next(b for b in of_kind(objs, "RoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"])
        assert binding["roleRef"]["kind"] == "Role" and binding["metadata"]["namespace"] == "ml-team"
        assert binding["subjects"][0]["namespace"] == NAMESPACE
        assert one(objs, "ClusterRoleBinding")["roleRef"]["name"] == one(objs, "ClusterRole")["metadata"]["name"]

    @pytest.mark.parametrize("values", SCENARIO_PARAMS)
    def test_secrets_only_got_and_created_and_no_wildcards_anywhere(self, values):
        """Secrets: each job's keypair, made by the operator and read by name (never listed,
        watched, changed or deleted: the garbage collector removes it with its job)."""
        for role in rbac(objects(values)):
            for rule in role["rules"]:
                if "secrets" in rule.get("resources", []):
                    assert rule["resources"] == ["secrets"] and rule["verbs"] == ["get", "create"], rule
                for key in ("apiGroups", "resources", "verbs"):
                    assert "*" not in rule.get(key, []), (role["metadata"]["name"], rule)
                assert "nonResourceURLs" not in rule and "resourceNames" not in rule

    def test_a_custom_service_account_is_bound_not_created(self):
        objs = objects(SCENARIOS["everything"])
        assert of_kind(objs, "ServiceAccount") == []
        for binding in of_kind(objs, "RoleBinding") + of_kind(objs, "ClusterRoleBinding"):
            assert binding["subjects"][0]["name"] == "existing-sa"


class TestNetworkPolicy:
    """networkPolicy.* reaches the operator as the flags operator/objects/policies.py reads (docs/security.md)."""

    @staticmethod
    def settings(values: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
        from splitfeed.operator import commands
        from splitfeed.trainer_client import cli

        monkeypatch.setenv("SPLITFEED_OPERATOR_NAMESPACE", NAMESPACE)  # the pod's fieldRef, for --leader-elect
        c = container(objects(values))
        return commands.config_from_args(cli.build_parser().parse_args([*c["command"][1:], *c["args"]])).planning

    def test_on_by_default_naming_the_operators_own_pods_in_the_release_namespace(self, monkeypatch):
        policy = self.settings({}, monkeypatch).network_policy
        assert policy is not None
        (peer,) = policy.operator_from
        assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
        for values in ({}, SCENARIOS["everything"]):  # podLabels adds labels, never takes the selector's away
            pod_labels = one(objects(values), "Deployment")["spec"]["template"]["metadata"]["labels"]
            assert peer["podSelector"]["matchLabels"].items() <= pod_labels.items()
        assert set(peer["podSelector"]["matchLabels"]) >= {"app.kubernetes.io/instance", "app.kubernetes.io/component"}

    def test_the_metrics_peers_default_to_every_pod_in_the_cluster(self, monkeypatch):
        assert self.settings({}, monkeypatch).network_policy.metrics_from == ({"namespaceSelector": {}},)

    def test_the_metrics_peers_named_in_values_reach_the_operator_as_given(self, monkeypatch):
        wanted = SCENARIOS["everything"]["networkPolicy"]["metrics"]["from"]
        assert list(self.settings(SCENARIOS["everything"], monkeypatch).network_policy.metrics_from) == wanted
        nobody = {"networkPolicy": {"metrics": {"from": []}}}
        assert self.settings(nobody, monkeypatch).network_policy.metrics_from == ()

    def test_off_passes_no_flag_and_grants_nothing_on_networkpolicies(self, monkeypatch):
        values = SCENARIOS["network-policy-off"]
        assert self.settings(values, monkeypatch).network_policy is None
        assert not [a for a in container(objects(values))["args"] if a.startswith("--network-policy")]
        for scenario in (values, {**values, **SCENARIOS["namespace-list"]}):
            assert not [g for role in rbac(objects(scenario)) for g in grants(role["rules"])
                        if g[1] == "networkpolicies"]

    @pytest.mark.parametrize("values", [pytest.param({}, id="cluster"),
                                        pytest.param(SCENARIOS["namespace-list"], id="namespaces")])
    def test_on_grants_get_create_and_patch_on_networkpolicies_where_jobs_run(self, values):
        found = {(role["kind"], role["metadata"].get("namespace")): {g for g in grants(role["rules"])
                                                                     if g[1] == "networkpolicies"}
                 for role in rbac(objects(values))}
        verbs = {("networking.k8s.io", "networkpolicies", v) for v in ("get", "create", "patch")}
        expected = ({("ClusterRole", None): verbs} if not values else
                    {("Role", "team-a"): verbs, ("Role", "team-b"): verbs, ("ClusterRole", None): set()})
        assert {k: v for k, v in found.items() if not (k[0] == "Role" and k[1] == NAMESPACE)} == expected


# --- the webhook ----------------------------------------------------------------


class TestWebhook:
    def test_disabled_by_default(self):
        objs = objects()
        assert of_kind(objs, "ValidatingWebhookConfiguration") == [] and of_kind(objs, "Service") == []
        c = container(objs)
        assert not any(a.startswith("--webhook") for a in c["args"]) and "volumeMounts" not in c

    @pytest.mark.parametrize("scenario", ["webhook", "webhook-cert-manager", "everything"])
    def test_routes_job_writes_and_scale_requests_to_the_operator(self, scenario):
        values = SCENARIOS[scenario]
        objs = objects(values)
        service = one(objs, "Service")
        deployment = one(objs, "Deployment")
        pod = deployment["spec"]["template"]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        c = pod["spec"]["containers"][0]
        port = next(p for p in c["ports"] if p["name"] == service["spec"]["ports"][0]["targetPort"])
        assert port["containerPort"] == values["webhook"].get("port", 9443)
        assert c["args"][c["args"].index("--webhook-port") + 1] == str(port["containerPort"])
        hooks = one(objs, "ValidatingWebhookConfiguration")["webhooks"]
        rules = {(r["resources"][0], tuple(r["operations"])) for h in hooks for r in h["rules"]}
        assert rules == {("streamingjobs", ("CREATE", "UPDATE")), ("streamingjobs/scale", ("UPDATE",))}
        for hook in hooks:
            svc = hook["clientConfig"]["service"]
            assert (svc["name"], svc["namespace"], svc["port"]) == (service["metadata"]["name"], NAMESPACE, 443)
            assert hook["sideEffects"] == "None" and hook["admissionReviewVersions"] == ["v1"]

    def test_each_webhook_path_reaches_the_kopf_handler_for_its_resource(self):
        # Kopf's webhook server routes a request by the handler id in its URL
        # path (POST /<id>); a request for a path with no handler is admitted
        # unchecked. So the chart's paths must be operator/cluster/webhooks.py's ids,
        # with the same subresource and operations.
        import kopf

        from splitfeed.operator.cluster import webhooks

        registry = kopf.OperatorRegistry()
        webhooks.register(registry)
        handlers = {
            (f"/{h.id}", "streamingjobs" + (f"/{h.subresource}" if h.subresource else ""),
             tuple(h.operations or []))
            for h in registry._webhooks.get_all_handlers()
            if h.selector is not None and h.selector.group == "splitfeed.io"
        }
        assert handlers
        hooks = one(objects(SCENARIOS["webhook"]), "ValidatingWebhookConfiguration")["webhooks"]
        chart = {
            (h["clientConfig"]["service"]["path"], rule["resources"][0], tuple(rule["operations"]))
            for h in hooks for rule in h["rules"]
        }
        assert chart == handlers

    def test_user_certificates_are_mounted_and_the_ca_injected(self):
        objs = objects(SCENARIOS["webhook"])
        for hook in one(objs, "ValidatingWebhookConfiguration")["webhooks"]:
            assert hook["clientConfig"]["caBundle"] == CA_BUNDLE
        pod = one(objs, "Deployment")["spec"]["template"]["spec"]
        assert pod["volumes"] == [{"name": "webhook-cert", "secret": {"secretName": "splitfeed-webhook-tls"}}]
        mount = pod["containers"][0]["volumeMounts"][0]
        args = pod["containers"][0]["args"]
        # kubernetes.io/tls Secrets (and cert-manager's) hold tls.crt and tls.key.
        assert args[args.index("--webhook-cert") + 1] == f"{mount['mountPath']}/tls.crt"
        assert args[args.index("--webhook-key") + 1] == f"{mount['mountPath']}/tls.key"
        assert of_kind(objs, "Certificate") == []

    def test_cert_manager_issues_the_certificate_and_injects_the_ca(self):
        objs = objects(SCENARIOS["webhook-cert-manager"])
        webhook = one(objs, "ValidatingWebhookConfiguration")
        certificate = one(objs, "Certificate")
        assert webhook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
            f"{NAMESPACE}/{certificate['metadata']['name']}")
        assert all("caBundle" not in h["clientConfig"] for h in webhook["webhooks"])
        service = one(objs, "Service")["metadata"]["name"]
        assert f"{service}.{NAMESPACE}.svc" in certificate["spec"]["dnsNames"]
        secret = one(objs, "Deployment")["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"]
        assert secret == certificate["spec"]["secretName"]
        issuer = one(objs, "Issuer")
        assert certificate["spec"]["issuerRef"]["name"] == issuer["metadata"]["name"]

    def test_cert_manager_can_use_an_existing_issuer(self):
        objs = objects(SCENARIOS["webhook-cert-manager-issuer"])
        assert of_kind(objs, "Issuer") == []
        assert one(objs, "Certificate")["spec"]["issuerRef"]["name"] == "corp-ca"
        assert one(objs, "Certificate")["spec"]["issuerRef"]["kind"] == "ClusterIssuer"

    def test_single_namespace_mode_limits_the_webhook_to_that_namespace(self):
        hooks = one(objects(SCENARIOS["everything"]), "ValidatingWebhookConfiguration")["webhooks"]
        for hook in hooks:
            assert hook["namespaceSelector"] == {"matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["ml-team"]}]}
            assert hook["failurePolicy"] == "Ignore"
        several = {"webhook": SCENARIOS["webhook"]["webhook"], "watch": SCENARIOS["namespace-list"]["watch"]}
        for hook in one(objects(several), "ValidatingWebhookConfiguration")["webhooks"]:
            assert hook["namespaceSelector"]["matchExpressions"][0]["values"] == ["team-a", "team-b"]

    @pytest.mark.parametrize(
        "webhook",
        [
            pytest.param({"enabled": True}, id="nothing"),
            pytest.param({"enabled": True, "certSecretName": "tls"}, id="no-ca-bundle"),
            pytest.param({"enabled": True, "caBundle": CA_BUNDLE}, id="no-secret"),
        ],
    )
    def test_without_cert_manager_the_certificate_is_required(self, webhook):
        with pytest.raises(helm_python.HelmValuesError):
            rendered({"webhook": webhook})


# --- the CRD in the chart ------------------------------------------------------------


def load_sync():
    spec = importlib.util.spec_from_file_location("crd_sync", ROOT / "crds" / "sync.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TestCRD:
    def test_the_chart_installs_the_crd_from_crds_and_keeps_it_on_uninstall(self):
        crd = one(objects(), "CustomResourceDefinition")
        annotations = crd["metadata"].pop("annotations")
        assert annotations == {"helm.sh/resource-policy": "keep"}
        assert crd == yaml.safe_load((ROOT / "crds" / "streamingjob.yaml").read_text())

    def test_crds_disabled_installs_none(self):
        assert of_kind(objects(SCENARIOS["crds-disabled"]), "CustomResourceDefinition") == []

    def test_the_chart_copy_is_what_sync_writes(self):
        sync = load_sync()
        assert (CHART / "templates" / "crd.yaml").read_text() == sync.render(sync.SOURCE.read_text())
        assert sync.main(["--check"]) == 0

    def test_sync_refuses_text_helm_would_read(self):
        sync = load_sync()
        with pytest.raises(sync.SyncError):
            sync.render(sync.SOURCE.read_text().replace("description: Kopf's", "description: {{ .Values }} Kopf's"))


# --- values ------------------------------------------------------------------------


class TestValues:
    @pytest.mark.parametrize("values", SCENARIO_PARAMS)
    def test_the_schema_accepts_every_scenario(self, values):
        chart = helm_python.Chart.load(CHART)
        try:
            chart.validate_schema(chart.merge_values(copy.deepcopy(values)))
        finally:
            chart.close()

    @pytest.mark.parametrize(
        "values,words",
        [
            pytest.param({"sidecar": {"mode": "bogus"}}, "/sidecar/mode", id="sidecar-mode"),
            pytest.param({"sidecar": {"shmSize": "lots"}}, "/sidecar/shmSize", id="shm-size"),
            pytest.param({"sidecar": {"prefetchBatches": 0}}, "/sidecar/prefetchBatches", id="prefetch"),
            pytest.param({"watch": {"allNamespaces": "yes"}}, "/watch/allNamespaces", id="watch-mode"),
            pytest.param({"watch": {"namespace": "ML_Team"}}, "/watch/namespace", id="namespace-name"),
            pytest.param({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy", id="pull-policy"),
            pytest.param({"webhook": {"failurePolicy": "Maybe"}}, "/webhook/failurePolicy", id="failure-policy"),
            pytest.param({"webhook": {"enabled": True}}, "/webhook/caBundle", id="webhook-without-ca"),
            pytest.param({"crds": {"enable": True}}, "enable", id="typo"),
            pytest.param({"sidcar": {}}, "sidcar", id="unknown-top-level"),
            pytest.param({"peering": {"enabled": True, "name": ""}}, "/peering/name", id="peering-name"),
            pytest.param({"watch": {"namespaces": ["Team_A"]}}, "/watch/namespaces/0", id="namespace-list-name"),
            pytest.param({"leaderElection": {"enabled": "yes"}}, "/leaderElection/enabled", id="leader"),
            pytest.param({"failure": {"restartBackoffSeconds": -1}}, "/failure/restartBackoffSeconds",
                         id="negative-backoff"),
            pytest.param({"networkPolicy": {"enabled": "yes"}}, "/networkPolicy/enabled", id="netpol-enabled"),
            pytest.param({"networkPolicy": {"metrics": {"from": [{}]}}}, "/networkPolicy/metrics/from/0",
                         id="netpol-empty-peer"),
            pytest.param({"networkPolicy": {"metrics": {"from": [{"namespace": "monitoring"}]}}}, "namespace",
                         id="netpol-unknown-peer-key"),
            pytest.param({"networkPolicy": {"metrics": {"from": [{"podSelector": {"app": "prometheus"}}]}}},
                         "/networkPolicy/metrics/from/0/podSelector", id="netpol-bare-labels"),
        ],
    )
    def test_the_schema_rejects_bad_values(self, values, words):
        chart = helm_python.Chart.load(CHART)
        try:
            with pytest.raises(helm_python.HelmValuesError) as info:
                chart.validate_schema(chart.merge_values(values))
            assert words in str(info.value)
            with pytest.raises(helm_python.HelmValuesError):
                chart.render(values, name=RELEASE, namespace=NAMESPACE)
        finally:
            chart.close()


def test_notes_tell_how_to_apply_and_scale_a_job():
    notes = rendered()["splitfeed/templates/NOTES.txt"]
    assert "kubectl -n default apply -f examples/streamingjob.yaml" in notes
    assert "scale sj/resnet --replicas=" in notes
    assert "allowedReplicas" in notes
    single = rendered(SCENARIOS["single-namespace"])["splitfeed/templates/NOTES.txt"]
    assert "kubectl -n ml-team scale sj/resnet" in single
    assert "kubectl apply -f crds/streamingjob.yaml" in rendered(SCENARIOS["crds-disabled"])["splitfeed/templates/NOTES.txt"]


# --- metrics (docs/observability.md) ------------------------------------------------------

# kubernetes-validate has no schema for the Prometheus operator's kinds (they are not
# Kubernetes'): the fields the chart sets, from monitoring.coreos.com/v1's CRDs.
_ENDPOINT = {"type": "object", "additionalProperties": False, "required": ["port"],
             "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}}}
_MONITOR_META = {"type": "object", "required": ["name", "namespace"],
                 "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                                "labels": {"type": "object", "additionalProperties": {"type": "string"}}}}
_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
    "matchExpressions": {"type": "array", "items": {"type": "object", "required": ["key", "operator"]}}}}
_NS_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}}
PROMETHEUS_OPERATOR = {
    "ServiceMonitor": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "metadata": _MONITOR_META,
        "spec": {"type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
                 "properties": {"selector": _SELECTOR, "namespaceSelector": _NS_SELECTOR,
                                "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT}}}}},
    "PodMonitor": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "metadata": _MONITOR_META,
        "spec": {"type": "object", "additionalProperties": False, "required": ["selector", "podMetricsEndpoints"],
                 "properties": {"selector": _SELECTOR, "namespaceSelector": _NS_SELECTOR,
                                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT}}}}},
}
MONITORED = {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                         "podMonitor": {"enabled": True}, "dashboard": {"enabled": True}}}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector's meaning (matchLabels and Exists/In expressions), written out for the test."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        if e["operator"] == "Exists" and e["key"] not in labels:
            return False
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
    return True


class TestMetrics:
    @pytest.mark.parametrize("values", [pytest.param(MONITORED, id="monitored"),
                                        pytest.param({**SCENARIOS["everything"], **MONITORED}, id="everything")])
    def test_every_object_validates_with_metrics_and_monitors_enabled(self, values):
        report = helm_python.lint(CHART, copy.deepcopy(values), strict=True, namespace=NAMESPACE)
        assert report["errors"] == []
        objs = objects(values)
        kinds = {o["kind"] for o in objs}
        assert {"ServiceMonitor", "PodMonitor", "ConfigMap", "Service"} <= kinds
        for obj in objs:
            if obj["apiVersion"] == "monitoring.coreos.com/v1":
                with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                    kubernetes_validate.validate(obj, "1.30.0", strict=True)
                jsonschema.validate(obj, PROMETHEUS_OPERATOR[obj["kind"]])
            elif obj["apiVersion"].startswith("cert-manager.io/"):
                jsonschema.validate(obj, CERT_MANAGER[obj["kind"]])
            else:
                kubernetes_validate.validate(obj, "1.30.0", strict=True)

    def test_the_operator_serves_metrics_on_the_port_its_pod_names_and_annotates(self):
        objs = objects(MONITORED)
        c = container(objs)
        assert c["args"][c["args"].index("--metrics-port") + 1] == "8090"
        assert {"name": "metrics", "containerPort": 8090, "protocol": "TCP"} in c["ports"]
        annotations = one(objs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "8090",
                               "prometheus.io/path": "/metrics"}

    def test_the_service_monitor_selects_the_operator_pod_through_the_metrics_service(self):
        objs = objects(MONITORED)
        pod_labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
        monitor = one(objs, "ServiceMonitor")
        assert monitor["metadata"]["labels"]["release"] == "prom"
        services = [s for s in of_kind(objs, "Service") if _selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
        assert len(services) == 1, services
        service = services[0]
        assert all(pod_labels.get(k) == v for k, v in service["spec"]["selector"].items())
        assert [p["name"] for p in service["spec"]["ports"]] == [monitor["spec"]["endpoints"][0]["port"]] == ["metrics"]
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}

    def test_the_pod_monitor_selects_the_pods_the_operator_creates(self):
        from splitfeed.operator.objects import planning

        job = specs.parse_job(yaml.safe_load((ROOT / "examples" / "streamingjob.yaml").read_text()))
        pod = next(o for o in planning.world(job, 0, planning.Owner("j", "u"), planning.Settings(), None, None)
                   if o["kind"] == "Pod")
        monitor = one(objects(MONITORED), "PodMonitor")
        assert _selects(monitor["spec"]["selector"], pod["metadata"]["labels"])
        # The endpoint's port name is one the pod's sidecar declares, and its annotations agree.
        ports = {p["name"]: p["containerPort"] for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
                 for p in c.get("ports") or []}
        assert ports["metrics"] == 29502
        assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == "29502"

    def test_the_dashboard_is_valid_json_over_the_metrics_the_sidecar_and_operator_serve(self):
        data = one([o for o in objects(MONITORED) if o["kind"] == "ConfigMap"
                    and o["metadata"]["name"].endswith("-dashboard")], "ConfigMap")["data"]
        dashboard = json.loads(data["splitfeed.json"])
        exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
        for name in ("splitfeed_rows_delivered_total", "splitfeed_data_ready_seconds_bucket",
                     "splitfeed_data_wait_seconds_total", "splitfeed_trainer_seconds_total",
                     "splitfeed_read_seconds_bucket", "splitfeed_ring_filled_batches",
                     "splitfeed_checkpoint_seconds_bucket", "splitfeed_operator_rescale_seconds_bucket"):
            assert name in exprs, name

    def test_metrics_off_serves_nothing_and_adds_no_monitor(self):
        objs = objects({"metrics": {"enabled": False, "port": 8090, "serviceMonitor": {"enabled": True}}})
        c = container(objs)
        assert c["args"][c["args"].index("--metrics-port") + 1] == "0"
        assert not of_kind(objs, "ServiceMonitor") and not of_kind(objs, "PodMonitor")
