"""The envtest control plane itself: a real kube-apiserver, etcd and controllers."""

from __future__ import annotations

import json
import os

import pytest

from tests.support.controlplane import MISSING_ASSETS_HINT, ControlPlane, find_assets
from tests.support.waiting import wait_for

CONTROLLERS = ["garbagecollector", "serviceaccount", "serviceaccount-token", "namespace"]


def _assets():
    assets = find_assets()
    if assets is None:
        pytest.fail(MISSING_ASSETS_HINT, pytrace=False)
    return assets


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@pytest.mark.kube
def test_control_plane_serves_api_and_runs_garbage_collector(tmp_path):
    cp = ControlPlane(_assets(), tmp_path / "cp", controllers=CONTROLLERS)
    with cp:
        assert cp.server.startswith("https://127.0.0.1:")
        assert set(cp.pids) == {"etcd", "kube-apiserver", "kube-controller-manager"}

        ns = "envtest-check"
        cp.kubectl("create", "namespace", ns)
        cp.kubectl("-n", ns, "create", "configmap", "owner", "--from-literal=answer=42",
                   "--from-literal=greeting=hello")

        owner = json.loads(cp.kubectl("-n", ns, "get", "configmap", "owner", "-o", "json").stdout)
        assert owner["data"] == {"answer": "42", "greeting": "hello"}

        child = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "child",
                "namespace": ns,
                "ownerReferences": [{
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "name": "owner",
                    "uid": owner["metadata"]["uid"],
                }],
            },
            "data": {"owned": "yes"},
        }
        cp.kubectl("create", "-f", "-", input=json.dumps(child))
        got = json.loads(cp.kubectl("-n", ns, "get", "configmap", "child", "-o", "json").stdout)
        assert got["data"] == {"owned": "yes"}
        assert got["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]

        # Background deletion: the garbage collector must remove the dependent.
        cp.kubectl("-n", ns, "delete", "configmap", "owner", "--wait=false")
        def child_gone() -> bool:
            res = cp.kubectl("-n", ns, "get", "configmap", "child", "-o", "name", check=False)
            return res.returncode != 0 and "NotFound" in res.stderr

        try:
            wait_for(child_gone, 30, "the garbage collector to delete the child", interval=0.5)
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}; kube-controller-manager log tail:\n{cp.logs['kube-controller-manager'].read_text()[-3000:]}"
            ) from None

        pids = dict(cp.pids)

    for name, proc in cp.processes.items():
        assert proc.returncode is not None, f"{name} still running after exit"
    for name, pid in pids.items():
        assert not _alive(pid), f"{name} (pid {pid}) still alive after exit"
