"""The test kubelet itself (tests/kubelet): what the end-to-end tier relies on it to do like a kubelet."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.cluster import NS, Cluster, alive, log, wait_for
from tests.kubelet.kubelet import Kubelet

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SCRIPT = """
echo main >> /work/order
mkdir -p /work/sub && env > /work/sub/env
if [ ! -f /work/restarted ]; then touch /work/restarted; echo 'first run failing' > /dev/termination-log; exit 3; fi
while ! grep -q 'probe/a="2"' /etc/podinfo/annotations; do sleep 0.05; done
echo "done: $(cat /etc/cm/greeting)" > /dev/termination-log
trap 'echo term >> /work/order; exit 0' TERM
while true; do sleep 0.05; done
"""


def test_a_pod_gets_its_environment_volumes_restarts_status_and_graceful_deletion(cluster: Cluster) -> None:
    cluster.kubectl("-n", NS, "create", "configmap", "probe-cm", "--from-literal=greeting=hello")
    cluster.kubectl("-n", NS, "create", "secret", "generic", "probe-secret", "--from-literal=password=s3cret")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "probe", "namespace": NS, "labels": {"app": "probe"}, "annotations": {"probe/a": "1"}},
        "spec": {
            "restartPolicy": "OnFailure", "terminationGracePeriodSeconds": 3,
            "initContainers": [{"name": "init", "image": "ignored", "command": ["sh", "-c", "echo init > /work/order"],
                                "volumeMounts": [{"name": "work", "mountPath": "/work"}]}],
            "containers": [{
                "name": "main", "image": "ignored", "command": ["sh", "-c"], "args": [SCRIPT],
                "env": [
                    {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                    {"name": "ANN", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['probe/a']"}}},
                    {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "probe-cm", "key": "greeting"}}},
                    {"name": "PASS", "valueFrom": {"secretKeyRef": {"name": "probe-secret", "key": "password"}}},
                    {"name": "DERIVED", "value": "$(GREETING)-x"},
                    {"name": "DIR", "value": "/work/sub"}],
                "volumeMounts": [{"name": "work", "mountPath": "/work"},
                                 {"name": "podinfo", "mountPath": "/etc/podinfo"},
                                 {"name": "cm", "mountPath": "/etc/cm"}]}],
            "volumes": [{"name": "work", "emptyDir": {}},
                        {"name": "podinfo", "downwardAPI": {"items": [
                            {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}]}},
                        {"name": "cm", "configMap": {"name": "probe-cm"}}]}}
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(pod))

    def main_status() -> dict:
        p = cluster.get(f"/api/v1/namespaces/{NS}/pods/probe")
        return next(iter(p["status"].get("containerStatuses") or []), {})
    st = wait_for(lambda: (s := main_status()).get("restartCount") == 1 and "running" in s["state"] and s,
                  30, "the failed first run to be restarted (OnFailure)")
    assert st["lastState"]["terminated"]["exitCode"] == 3
    assert st["lastState"]["terminated"]["message"].strip() == "first run failing"
    run = next(r for r in cluster.kubelet.runs.values() if r.name == "probe")
    assert run.volumes is not None
    work = run.volumes["work"]
    env = dict(line.split("=", 1) for line in (work / "sub" / "env").read_text().splitlines() if "=" in line)
    assert {k: env[k] for k in ("NAME", "APP", "ANN", "IP", "GREETING", "PASS", "DERIVED")} == {
        "NAME": "probe", "APP": "probe", "ANN": "1", "IP": cluster.kubelet.ip, "GREETING": "hello",
        "PASS": "s3cret", "DERIVED": "hello-x"}
    assert env["DIR"] == f"{work}/sub", "mount paths in env values are mapped to the volume's host directory"
    assert "KUBECONFIG" in env, "the default service account's token comes with a kubeconfig"

    log("kubelet probe: annotating; the downward-API file follows")
    cluster.kubectl("-n", NS, "annotate", "pod", "probe", "probe/a=2", "--overwrite")
    term = run.dir / "containers" / "main" / "termination-log"
    wait_for(lambda: term.read_text().startswith("done: hello"), 20, "the container to see the new annotation")
    pid = cluster.kubelet.pid(NS, "probe", "main")
    assert pid is not None
    cluster.kubectl("-n", NS, "delete", "pod", "probe", "--wait=true", "--timeout=30s")
    assert not alive(pid)
    assert (work / "order").read_text().split() == ["init", "main", "main", "term"]
    cluster.kubectl("-n", NS, "delete", "configmap", "probe-cm")
    cluster.kubectl("-n", NS, "delete", "secret", "probe-secret")


def test_a_native_sidecar_starts_before_the_main_container_and_stops_after_it(
        cluster: Cluster, tmp_path: Path) -> None:
    """Kubernetes 1.20 drops restartPolicy on init containers, so this drives the kubelet's sync directly."""
    kubelet = Kubelet(cluster.cp.server, cluster.cp.token, cluster.cp.ca_file, tmp_path / "kubelet",
                      bin_dir=Path(sys.executable).parent, node="unit-node")
    loop = ("echo side >> /w/order; trap 'echo side-stopped >> /w/order; exit 0' TERM; "
            "while true; do sleep 0.05; done")
    pod = {"metadata": {"name": "native", "namespace": NS, "uid": "00000000-native"},
           "spec": {"nodeName": "unit-node", "restartPolicy": "Never",
                    "initContainers": [{"name": "side", "restartPolicy": "Always", "command": ["sh", "-c", loop],
                                        "volumeMounts": [{"name": "w", "mountPath": "/w"}]}],
                    "containers": [{"name": "main", "command": ["sh", "-c", "sleep 0.3; echo main >> /w/order"],
                                    "volumeMounts": [{"name": "w", "mountPath": "/w"}]}],
                    "volumes": [{"name": "w", "emptyDir": {}}]}}
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            kubelet._sync_pod(json.loads(json.dumps(pod)))  # status writes 404: no such pod object
            run = kubelet.runs["00000000-native"]
            if run.phase in ("Succeeded", "Failed"):
                break
            time.sleep(0.05)
        assert run.phase == "Succeeded"
        assert run.volumes is not None
        assert (run.volumes["w"] / "order").read_text().split() == ["side", "main", "side-stopped"]
    finally:
        kubelet.stop()
