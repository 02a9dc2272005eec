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
