"""The test kubelet itself (tests/e2e/kubelet.py): what the end-to-end tier relies on it to do like a kubelet."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.cluster import NS, Cluster, alive, log, wait_for
from tests.e2e.kubelet import HOSTS_MARK, Kubelet, rewrite_hosts

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
        def synced_to_an_end() -> bool:
            kubelet._sync_pod(json.loads(json.dumps(pod)))  # status writes 404: no such pod object
            return kubelet.runs["00000000-native"].phase in ("Succeeded", "Failed")

        wait_for(synced_to_an_end, 20, "the native-sidecar pod to end", interval=0.05)
        run = kubelet.runs["00000000-native"]
        assert run.phase == "Succeeded"
        assert run.volumes is not None
        assert (run.volumes["w"] / "order").read_text().split() == ["side", "main", "side-stopped"]
    finally:
        kubelet.stop()


RESOLVER = """
import json, os, socket, sys, time
names = sys.argv[1:]
while True:
    try:
        ips = {n: socket.getaddrinfo(n, None, socket.AF_INET)[0][4][0] for n in names}
        break
    except socket.gaierror:
        time.sleep(0.1)
srv = socket.socket()
srv.bind(("0.0.0.0", 0))
srv.listen()
with open("/out/.r", "w") as f:
    json.dump({"ips": ips, "port": srv.getsockname()[1]}, f)
os.replace("/out/.r", "/out/resolved.json")
while True:
    conn, _ = srv.accept()
    conn.sendall(b"hello from dns-0")
    conn.close()
"""


def resolves(name: str) -> str | None:
    try:
        return socket.getaddrinfo(name, None, socket.AF_INET)[0][4][0]
    except socket.gaierror:
        return None


def test_a_pod_with_hostname_and_subdomain_is_reachable_by_its_cluster_dns_names(cluster: Cluster) -> None:
    """Kubernetes DNS gives such a pod `<hostname>.<subdomain>[.<ns>.svc[.cluster.local]]` once a headless
    Service named `<subdomain>` exists; the test kubelet serves these from /etc/hosts (gloo and ZeroMQ
    resolve through glibc), and removes them when the pod is deleted."""
    names = ["dns-0.dns", f"dns-0.dns.{NS}.svc", f"dns-0.dns.{NS}.svc.cluster.local"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "dns-0", "namespace": NS, "labels": {"app": "dns"}},
           "spec": {"hostname": "dns-0", "subdomain": "dns", "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "main", "image": "ignored",
                                    "command": ["python", "-c", RESOLVER, *names],
                                    "volumeMounts": [{"name": "out", "mountPath": "/out"}]}],
                    "volumes": [{"name": "out", "emptyDir": {}}]}}
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(pod))
    wait_for(lambda: cluster.get(f"/api/v1/namespaces/{NS}/pods/dns-0")["status"].get("phase") == "Running",
             30, "pod dns-0 running")
    time.sleep(1)  # several kubelet syncs
    assert [resolves(n) for n in names] == [None] * 3, "a pod name resolves without its headless Service"

    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "dns", "namespace": NS},
               "spec": {"clusterIP": "None", "selector": {"app": "dns"}, "publishNotReadyAddresses": True,
                        "ports": [{"name": "x", "port": 1}]}}
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(service))
    run = next(r for r in cluster.kubelet.runs.values() if r.name == "dns-0")
    assert run.volumes is not None
    out = run.volumes["out"] / "resolved.json"
    wait_for(out.exists, 30, "the pod to resolve its own names")
    got = json.loads(out.read_text())
    assert got["ips"] == {n: cluster.kubelet.ip for n in names}, got
    assert [resolves(n) for n in names] == [cluster.kubelet.ip] * 3
    with socket.create_connection((names[0], got["port"]), timeout=10) as conn:
        assert conn.recv(100) == b"hello from dns-0"
    hosts = Path("/etc/hosts").read_text()
    assert hosts.count(HOSTS_MARK) >= 1 and "dns-0.dns " in hosts, hosts

    log("kubelet probe: deleting pod dns-0; its names go")
    cluster.kubectl("-n", NS, "delete", "pod", "dns-0", "--wait=true", "--timeout=30s")
    wait_for(lambda: all(resolves(n) is None for n in names), 10, "the deleted pod's names to be gone")
    cluster.kubectl("-n", NS, "delete", "service", "dns")


def test_an_exec_readiness_probe_decides_when_the_container_and_the_pod_are_ready(cluster: Cluster) -> None:
    """The probe runs in the container's view of its mounts; Ready follows it both ways."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "ready", "namespace": NS},
           "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "main", "image": "ignored", "command": ["sleep", "60"],
                                    "readinessProbe": {"exec": {"command": ["test", "-e", "/flag/up"]},
                                                       "periodSeconds": 1},
                                    "volumeMounts": [{"name": "flag", "mountPath": "/flag"}]}],
                    "volumes": [{"name": "flag", "emptyDir": {}}]}}
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(pod))

    def ready() -> tuple[str | None, bool | None]:
        status = cluster.get(f"/api/v1/namespaces/{NS}/pods/ready")["status"]
        cond = next((c["status"] for c in status.get("conditions") or [] if c["type"] == "Ready"), None)
        return cond, next((c["ready"] for c in status.get("containerStatuses") or []), None)
    wait_for(lambda: cluster.get(f"/api/v1/namespaces/{NS}/pods/ready")["status"].get("phase") == "Running",
             30, "pod ready running")
    time.sleep(1.5)  # a probe or two
    assert ready() == ("False", False)
    run = next(r for r in cluster.kubelet.runs.values() if r.name == "ready")
    assert run.volumes is not None
    (run.volumes["flag"] / "up").touch()
    wait_for(lambda: ready() == ("True", True), 10, "the probe to pass")
    (run.volumes["flag"] / "up").unlink()
    wait_for(lambda: ready() == ("False", False), 10, "the probe to fail again")
    cluster.kubectl("-n", NS, "delete", "pod", "ready", "--wait=true", "--timeout=30s")


def test_hosts_lines_of_a_dead_test_kubelet_are_dropped_and_others_kept() -> None:
    dead = 2 ** 22 + 12345  # above Linux's default pid_max: never a live process
    live = os.getpid()
    text = ("127.0.0.1 localhost\n"
            f"10.0.0.1 a.b {HOSTS_MARK} node=n id=1 pid={dead}\n"
            f"10.0.0.2 c.d {HOSTS_MARK} node=n id=2 pid={live}\n"
            f"10.0.0.3 e.f {HOSTS_MARK} node=m id=3 pid={live}\n")
    out = rewrite_hosts(text, f"node=m id=3 pid={live}", ["10.0.0.4 g.h"])
    assert out == ("127.0.0.1 localhost\n"
                   f"10.0.0.2 c.d {HOSTS_MARK} node=n id=2 pid={live}\n"
                   f"10.0.0.4 g.h {HOSTS_MARK} node=m id=3 pid={live}\n")
    assert rewrite_hosts("127.0.0.1 localhost", "node=x id=9 pid=1", []) == "127.0.0.1 localhost\n"
