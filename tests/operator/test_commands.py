"""`splitfeed operator` argument parsing into the operator's configuration."""

from __future__ import annotations

import pytest

from splitfeed.operator import commands
from splitfeed.trainer_client import cli


def config(*argv: str):
    args = cli.build_parser().parse_args(["operator", *argv])
    assert args.func is commands.run
    return commands.config_from_args(args)


def test_defaults_are_cluster_wide_native_peered_and_without_webhooks():
    c = config()
    assert c.namespaces == () and c.planning.sidecar_mode == "native" and c.peering == "splitfeed"
    assert c.webhook is None and c.liveness is None


def test_namespaces_repeat_and_exclude_all_namespaces():
    assert config("--namespace", "a", "-n", "b").namespaces == ("a", "b")
    with pytest.raises(SystemExit):
        config("--namespace", "a", "--all-namespaces")


def test_webhook_options_build_a_webhook_config():
    c = config("--webhook-port", "9443", "--webhook-cert", "c.pem", "--webhook-key", "k.pem",
               "--webhook-host", "op.ns.svc", "--webhook-managed", "splitfeed.io")
    assert c.webhook is not None
    assert (c.webhook.port, c.webhook.certfile, c.webhook.pkeyfile, c.webhook.host, c.webhook.managed) == (
        9443, "c.pem", "k.pem", "op.ns.svc", "splitfeed.io")


def test_sidecar_mode_image_standalone_and_chart_env(monkeypatch):
    monkeypatch.setenv("SPLITFEED_SIDECAR_SHM_SIZE", "8Gi")
    c = config("--sidecar-mode", "container", "--sidecar-image", "x:1", "--standalone")
    assert (c.planning.sidecar_mode, c.planning.sidecar_image, c.peering) == ("container", "x:1", None)
    assert c.planning.sidecar_defaults == {"shmSize": "8Gi"}
    with pytest.raises(SystemExit):
        config("--sidecar-mode", "sideways")


def test_leader_election_takes_its_namespace_from_the_flag_or_the_pod(monkeypatch):
    monkeypatch.delenv("SPLITFEED_OPERATOR_NAMESPACE", raising=False)
    assert config().leader is None
    with pytest.raises(SystemExit, match="--leader-election-namespace"):
        config("--leader-elect")
    monkeypatch.setenv("SPLITFEED_OPERATOR_NAMESPACE", "splitfeed")
    c = config("--leader-elect")
    assert c.leader is not None and (c.leader.namespace, c.leader.name) == ("splitfeed", "splitfeed-operator")
    assert c.leader.renew_deadline_s < c.leader.duration_s  # a holder stops before anyone may take over
    c = config("--leader-elect", "--leader-election-namespace", "ops", "--leader-election-lease", "sf")
    assert (c.leader.namespace, c.leader.name) == ("ops", "sf")


def test_failure_policy_and_webhook_hardening_flags():
    c = config("--restart-backoff", "2.5", "--restart-backoff-max", "30", "--stall-timeout", "60",
               "--webhook-port", "9443", "--no-webhook-dry-run", "--webhook-check-pod-permission",
               "--webhook-cert-check", "5")
    assert (c.planning.restart_backoff_s, c.planning.restart_backoff_max_s, c.planning.stall_timeout_s) == (2.5, 30, 60)
    assert c.planning.backoff_s(1) == 2.5 and c.planning.backoff_s(5) == 30
    assert c.webhook is not None
    assert (c.webhook.dry_run_pods, c.webhook.check_pod_permission, c.webhook.cert_check_s) == (False, True, 5)
    d = config("--webhook-port", "9443")
    assert d.webhook is not None and d.webhook.dry_run_pods and not d.webhook.check_pod_permission
    assert d.planning.restart_backoff_s == 10 and d.planning.stall_timeout_s == 900


@pytest.mark.parametrize("kubeconfig,words", [
    (None, "no kubeconfig at {path} and not in a pod"),
    ("apiVersion: v1\nkind: Config\nclusters: []\n", "the kubeconfig at {path} cannot be used"),
], ids=["missing", "unusable"])
def test_no_way_to_reach_a_cluster_is_one_line_that_says_what_to_set(tmp_path, kubeconfig, words):
    import os
    import subprocess
    import sys

    path = tmp_path / "kubeconfig"
    if kubeconfig:
        path.write_text(kubeconfig)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "KUBECONFIG"))}
    done = subprocess.run([sys.executable, "-m", "splitfeed.trainer_client.cli", "operator",
                           "--kubeconfig", str(path)], env={**env, "HOME": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr  # one line, no traceback
    assert words.format(path=path) in done.stderr and "set --kubeconfig or KUBECONFIG" in done.stderr
