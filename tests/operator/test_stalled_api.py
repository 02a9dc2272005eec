"""A half-open apiserver connection: the operator times out, reconnects and reconciles.

Real-API tier (`-m kube`): the operator process talks to the envtest kube-apiserver
through a TCP proxy. At some point the proxy stops forwarding: every open
connection stays open and silent for good (half-open, as when a NAT entry or a
node vanishes without a reset), and new connections are accepted and left silent
too. Later it forwards new connections again. Kopf's watch and the operator's own
calls were made on the silent connections: they must time out and reconnect, and
a job created while the API was unreachable must then get its pods and reach
Running, as must the job created before.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from tests.support import processes
from tests.support.controlplane import MISSING_ASSETS_HINT, ControlPlane, find_assets, strip_cel
from tests.support.ports import free_port
from tests.support.builders import manifest
from tests.support.waiting import wait_for_api

pytestmark = [pytest.mark.kube, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
NS = "default"
API_TIMEOUT_S = 2
WATCH_TIMEOUT_S = 5


class StallingProxy:
    """A TCP proxy whose connections can all be made silent at once (threads: a test helper)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.stalled = False
        self.lock = threading.Lock()
        self.live: list[dict[str, Any]] = []
        self.dead_count = 0
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def stall(self) -> None:
        """From now on nothing is forwarded on any open connection, ever; new ones stay silent."""
        with self.lock:
            self.stalled = True
            for conn in self.live:
                conn["dead"] = True
            self.dead_count += len(self.live)
            self.live = []

    def resume(self) -> None:
        """New connections are forwarded again; the silent ones stay silent."""
        with self.lock:
            self.stalled = False

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            self.sockets.append(client)
            with self.lock:
                if self.stalled:
                    self.dead_count += 1
                    threading.Thread(target=self._drain, args=(client,), daemon=True).start()
                    continue
                conn = {"dead": False}
                self.live.append(conn)
            upstream = socket.create_connection(self.upstream)
            self.sockets.append(upstream)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst, conn), daemon=True).start()

    @staticmethod
    def _drain(sock: socket.socket) -> None:
        """Read and drop: the connection is open, and nothing ever comes back."""
        with contextlib.suppress(OSError):
            while sock.recv(65536):
                pass

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, conn: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if not conn["dead"]:
                    dst.sendall(data)
            if not conn["dead"]:
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.server.close()
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.close()


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    assets = find_assets()
    if assets is None:
        pytest.fail(f"run make envtest: {MISSING_ASSETS_HINT}")
    # The service-account controllers: pods need the namespace's default ServiceAccount.
    with ControlPlane(assets, tmp_path_factory.mktemp("stall") / "cp",
                      controllers=["serviceaccount", "serviceaccount-token"]) as plane:
        crd = strip_cel(yaml.safe_load((REPO / "crds" / "streamingjob.yaml").read_text()))
        plane.kubectl("apply", "-f", "-", input=json.dumps(crd))
        plane.wait_established("streamingjobs.splitfeed.io")
        yield plane


def test_a_stalled_api_connection_times_out_and_the_operator_recovers(cp: ControlPlane, tmp_path: Path) -> None:
    api = kubernetes.config.new_client_from_config(config_file=str(cp.kubeconfig))
    core, custom = kubernetes.client.CoreV1Api(api), kubernetes.client.CustomObjectsApi(api)
    assert cp.port is not None
    proxy = StallingProxy((cp.host, cp.port))
    kubeconfig = yaml.safe_load(cp.kubeconfig.read_text())
    for cluster in kubeconfig["clusters"]:
        cluster["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    proxied = tmp_path / "kubeconfig"
    proxied.write_text(yaml.safe_dump(kubeconfig))
    live_port = free_port()
    log = tmp_path / "operator.log"
    cmd = [sys.executable, "-m", "splitfeed.trainer_client.cli", "operator", "--all-namespaces",
           "--kubeconfig", str(proxied), "--sidecar-mode", "container", "--standalone",
           "--liveness", f"http://127.0.0.1:{live_port}/healthz", "--restart-backoff", "1",
           "--api-timeout", str(API_TIMEOUT_S), "--watch-timeout", str(WATCH_TIMEOUT_S)]
    child_env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    with open(log, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO, env=child_env)

    def job(name: str) -> dict[str, Any]:
        m = manifest(name=name, replicas=1)
        m["metadata"] = {"name": name, "namespace": NS}
        return m

    def pods(name: str) -> list[str]:
        items = core.list_namespaced_pod(NS, label_selector=f"splitfeed.io/job={name}").items
        return [p.metadata.name for p in items if not p.metadata.deletion_timestamp]

    def phase(name: str) -> str:
        body = custom.get_namespaced_custom_object("splitfeed.io", "v1alpha1", NS, "streamingjobs", name)
        return str((body.get("status") or {}).get("phase"))

    def running(name: str) -> bool:
        for pod in pods(name):
            core.patch_namespaced_pod_status(pod, NS, {"status": {"phase": "Running"}})
        return phase(name) == "Running"

    try:
        def alive() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"operator exited {proc.returncode}:\n{log.read_text()[-4000:]}")
            with urllib.request.urlopen(f"http://127.0.0.1:{live_port}/healthz", timeout=2) as r:
                return r.status == 200
        wait_for_api(alive, 60, "the operator's liveness endpoint")
        cp.kubectl("apply", "-f", "-", input=json.dumps(job("before")))
        wait_for_api(lambda: pods("before"), 30, "the first job's pod")

        proxy.stall()
        cp.kubectl("apply", "-f", "-", input=json.dumps(job("during")))  # straight to the apiserver
        time.sleep(3 * WATCH_TIMEOUT_S)  # watches and calls time out and retry into silence meanwhile
        assert pods("during") == [], "the operator reached the API through a silent proxy?"
        assert alive(), "the operator died while the API was unreachable"
        assert proxy.dead_count >= 2, "the operator opened no connection during the stall"

        proxy.resume()
        # The watch that was open when the proxy fell silent delivers nothing, ever: the
        # job created meanwhile is seen only through a new watch (the inactivity timeout).
        wait_for_api(lambda: pods("during"), 2 * WATCH_TIMEOUT_S + 3 * (5 + API_TIMEOUT_S),
                 "the pod of the job created while the API was unreachable")
        wait_for_api(lambda: running("before") and running("during"), 30, "both jobs Running")
        assert alive()
        # Each unanswered call is one line and a prompt retry, not Kopf's traceback and 60 s back-off.
        text = log.read_text(errors="replace")
        assert "failed temporarily: the Kubernetes API: HTTP 0 NoAnswer" in text
        assert "failed with an exception" not in text, "an API timeout was logged as a crash"
    except AssertionError as exc:
        raise AssertionError(f"{exc}\noperator log:\n{log.read_text(errors='replace')[-4000:]}") from None
    finally:
        processes.stop(proc)
        proxy.close()
        api.close()
