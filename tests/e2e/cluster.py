"""The end-to-end harness: a control plane, the test kubelet, the chart installed by helm.

`Cluster.start(work)` brings up, in order, each step logged with a timestamp:
1. etcd + kube-apiserver + kube-controller-manager (tests/envtest) with the
   deployment, replicaset, endpoint, garbage-collector, namespace and
   service-account controllers; the apiserver routes to Service endpoints
   (--enable-aggregator-routing) because there is no kube-proxy;
2. the test kubelet (tests/e2e/kubelet.py), which binds and runs every pod;
3. the StreamingJob CRD with its CEL rules stripped (1.20 has no CEL);
4. `helm install` of charts/splitfeed with the real helm binary:
   crds.enabled=false, sidecar.mode=container (1.20 drops native sidecars),
   webhook.enabled=true with an openssl-made certificate. The Deployment and
   ReplicaSet controllers turn it into the operator's pod, which the kubelet runs
   (`splitfeed operator ...` from the chart) with its service account's token,
   so the chart's RBAC is what the apiserver enforces;
5. a LanceDB table of 1000 rows (tests/support/tables.py: write_training_table).

StreamingJobs go to namespace `e2e`; their trainers run tests/e2e/trainer.py, a
real DDP trainer (torch.distributed, gloo on CPU) whose rendezvous goes to
`<job>-w<epoch>-0.<job>`, a name the test kubelet serves from /etc/hosts.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.e2e.kubelet import Kubelet
from tests.support import manifests, tables, waiting
from tests.support.controlplane import ControlPlane, strip_cel, KubectlError, MISSING_ASSETS_HINT, find_assets
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).with_name("trainer.py")
CONTROLLERS = ["garbagecollector", "serviceaccount", "serviceaccount-token", "namespace",
               "deployment", "replicaset", "endpoint"]
RELEASE, SYSTEM_NS, NS = "splitfeed", "splitfeed-system", "e2e"
WEBHOOK_SECRET = "splitfeed-webhook-tls"
NOT_READY = "run make envtest"
_T0 = time.monotonic()


def log(message: str) -> None:
    """A timestamped progress line: a failing run shows where it stopped."""
    print(f"[{datetime.datetime.now():%H:%M:%S.%f}"[:-3] + f" +{time.monotonic() - _T0:6.1f}s] {message}",
          flush=True)


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll `check` until it returns something truthy; AssertionError naming `what` on timeout."""
    return waiting.wait_for(check, timeout, what, interval, ignore=(KubectlError, OSError, ValueError, KeyError))


def webhook_certs(d: Path, dns_name: str) -> None:
    """A CA and a serving certificate for the webhook Service's name (what the apiserver checks)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "ext.cnf").write_text(f"subjectAltName = DNS:{dns_name}\nextendedKeyUsage = serverAuth\n"
                               "basicConstraints = CA:FALSE\n")

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "2", "-subj", "/CN=splitfeed-e2e-webhook-ca")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj", f"/CN={dns_name}")
    ssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "tls.crt", "-days", "2", "-extfile", "ext.cnf")


class Cluster:
    """Everything a test needs: kubectl, the API as JSON, the kubelet, paths."""

    def __init__(self, cp: ControlPlane, kubelet: Kubelet, work: Path, table_uri: str) -> None:
        self.cp, self.kubelet, self.work, self.table_uri = cp, kubelet, work, table_uri

    # -- start ---------------------------------------------------------------------------
    @classmethod
    @contextlib.contextmanager
    def start(cls, work: Path) -> Iterator["Cluster"]:
        assets = find_assets()
        if assets is None:
            raise AssertionError(f"{NOT_READY}: {MISSING_ASSETS_HINT}")
        for binary in ("kube-controller-manager", "helm"):
            if not os.access(assets / binary, os.X_OK):
                raise AssertionError(f"{NOT_READY}: {assets} has no {binary}")
        log(f"starting etcd, kube-apiserver, kube-controller-manager from {assets}")
        with ControlPlane(assets, work / "cp", controllers=CONTROLLERS,
                          apiserver_args=["--enable-aggregator-routing=true"]) as cp:
            log(f"control plane up at {cp.server} ({cp.startup_seconds})")
            with Kubelet(cp.server, cp.token, cp.ca_file, work / "kubelet",
                         bin_dir=Path(sys.executable).parent) as kubelet:
                log(f"test kubelet registered node {kubelet.node} (pod IP {kubelet.ip})")
                cluster = cls(cp, kubelet, work, str(work / "lance" / "db"))
                try:
                    cluster._install()
                    yield cluster
                except BaseException:
                    log("cluster start failed:\n" + cluster.dump())
                    raise

    def _install(self) -> None:
        # The chart's operator serves liveness on 0.0.0.0:8080, and pods share this host's network.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", 8080))
            except OSError as exc:
                raise AssertionError(f"port 8080 is taken ({exc}): the chart's operator listens there "
                                     "and the test kubelet runs pods on the host network") from None
        crd = strip_cel(yaml.safe_load((REPO / "crds" / "streamingjob.yaml").read_text()))
        self.kubectl("apply", "-f", "-", input=json.dumps(crd))
        self.cp.wait_established("streamingjobs.splitfeed.io")
        log("CRD installed (CEL rules stripped)")
        for ns in (SYSTEM_NS, NS):
            self.kubectl("create", "namespace", ns)
        service = f"{RELEASE}-webhook"
        certs = self.work / "webhook-certs"
        webhook_certs(certs, f"{service}.{SYSTEM_NS}.svc")
        self.kubectl("-n", SYSTEM_NS, "create", "secret", "tls", WEBHOOK_SECRET,
                     f"--cert={certs / 'tls.crt'}", f"--key={certs / 'tls.key'}")
        ca_bundle = base64.b64encode((certs / "ca.crt").read_bytes()).decode()
        self.webhook_port = free_port()
        self.metrics_port = free_port()  # the operator's /metrics (a fixed port may be taken on a shared host)
        values = {"crds.enabled": "false", "sidecar.mode": "container", "webhook.enabled": "true",
                  "webhook.port": str(self.webhook_port), "webhook.certSecretName": WEBHOOK_SECRET,
                  "webhook.caBundle": ca_bundle, "webhook.timeoutSeconds": "5",
                  "metrics.port": str(self.metrics_port)}
        helm_home = self.work / "helm-home"
        env = {**os.environ, "HELM_CACHE_HOME": str(helm_home / "cache"),
               "HELM_CONFIG_HOME": str(helm_home / "config"), "HELM_DATA_HOME": str(helm_home / "data")}
        env.pop("KUBECONFIG", None)
        cmd = [str(self.cp.assets / "helm"), "install", RELEASE, str(REPO / "charts" / "splitfeed"),
               "--namespace", SYSTEM_NS, "--kubeconfig", str(self.cp.kubeconfig), "--wait", "--timeout", "120s"]
        for key, value in values.items():
            cmd += ["--set", f"{key}={value}"]
        log("helm install " + " ".join(f"{k}={v if k != 'webhook.caBundle' else '...'}" for k, v in values.items()))
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
        if out.returncode != 0:
            raise AssertionError(f"helm install failed:\n{out.stdout}\n{out.stderr}")
        log(f"helm install done: operator pod {self.operator_pod()['metadata']['name']} ready")
        wait_for(lambda: self._endpoint_ready(service), 60, "the webhook Service's endpoints")
        wait_for(lambda: any(s["type"] == "kubernetes.io/service-account-token"
                             for s in self.get(f"/api/v1/namespaces/{NS}/secrets")["items"]),
                 60, f"the default service account's token in namespace {NS}")
        # The webhook answers (a dry-run create goes through it).
        wait_for(lambda: self.kubectl("apply", "--dry-run=server", "-f", "-", check=False,
                                      input=json.dumps(self.manifest("probe", log_dir=self.work)))
                 .returncode == 0, 60, "the admission webhook to answer")
        log("webhook serving; writing the LanceDB table")
        tables.write_training_table(self.table_uri)
        log("cluster ready")

    def _endpoint_ready(self, service: str) -> bool:
        ep = self.get(f"/api/v1/namespaces/{SYSTEM_NS}/endpoints/{service}")
        return any(s.get("addresses") for s in ep.get("subsets") or [])

    def dump(self) -> str:
        """What a failed run needs to see: pods, jobs, events, the operator's and kubelet's logs."""
        parts = []
        for title, get in (
            ("pods", lambda: self.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout),
            ("jobs", lambda: self.kubectl("get", "sj", "-A", "-o", "yaml", check=False).stdout[-6000:]),
            ("events", lambda: self.kubectl("get", "events", "-A", check=False).stdout[-6000:]),
            ("operator log", lambda: self.operator_log()[-8000:]),
            ("kubelet log", lambda: (self.kubelet.root / "kubelet.log").read_text()[-5000:]),
            ("kubelet errors", lambda: "\n".join(self.kubelet.errors[-3:])),
        ):
            try:
                parts.append(f"--- {title}:\n{get()}")
            except Exception as exc:  # noqa: BLE001 - a dump must not hide the failure
                parts.append(f"--- {title}: unavailable ({exc})")
        return "\n".join(parts)

    # -- API helpers ---------------------------------------------------------------------
    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return self.cp.kubectl(*args, check=check, input=input, timeout=timeout)

    def get(self, path: str) -> Any:
        return self.kubelet.api.get(path)

    def job(self, name: str) -> dict[str, Any]:
        return self.get(f"/apis/splitfeed.io/v1alpha1/namespaces/{NS}/streamingjobs/{name}")

    def status(self, name: str) -> dict[str, Any]:
        return self.job(name).get("status") or {}

    def pods(self, job: str, *, include_deleting: bool = False) -> list[dict[str, Any]]:
        items = self.get(f"/api/v1/namespaces/{NS}/pods?labelSelector=splitfeed.io/job%3D{job}")["items"]
        return [p for p in items if include_deleting or not p["metadata"].get("deletionTimestamp")]

    def events(self, name: str) -> list[dict[str, Any]]:
        items = self.get(f"/api/v1/namespaces/{NS}/events?fieldSelector=involvedObject.name%3D{name}")["items"]
        return sorted(items, key=lambda e: (e.get("firstTimestamp") or "", e["metadata"]["creationTimestamp"]))

    def operator_pods(self) -> list[dict[str, Any]]:
        """The operator's pods not being deleted: none for a moment after one is deleted,
        until its ReplicaSet creates the next."""
        items = self.get(f"/api/v1/namespaces/{SYSTEM_NS}/pods?labelSelector="
                         "app.kubernetes.io/component%3Doperator")["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def operator_pod(self) -> dict[str, Any]:
        live = self.operator_pods()
        if len(live) != 1:
            raise AssertionError(f"expected one operator pod, found {[p['metadata']['name'] for p in live]}")
        return live[0]

    def operator_log(self) -> str:
        with contextlib.suppress(Exception):
            path = self.kubelet.log_path(SYSTEM_NS, self.operator_pod()["metadata"]["name"], "operator")
            if path is not None:
                return path.read_text(errors="replace")
        return ""

    # -- StreamingJobs -------------------------------------------------------------------
    def manifest(self, name: str, *, log_dir: Path | None = None, replicas: int = 4, epochs: int = 1,
                 sleep_s: float = 0.25, checkpoint_every: int = 0, restart_policy: str = "Never", timeout_seconds: int = 60,
                 **data: Any) -> dict[str, Any]:
        """A StreamingJob over the test table whose data section is the data-plane reference's."""
        ref = manifests.data_manifest(self.table_uri, self.checkpoint_uri, epochs=epochs, **data)["spec"]
        command = ["python", str(TRAINER), str(log_dir or self.log_dir(name)), "--sleep-s", str(sleep_s),
                   "--checkpoint-every", str(checkpoint_every), "--timeout-s", "60"]
        spec: dict[str, Any] = {
            "replicas": replicas,
            "data": ref["data"],
            "sidecar": ref["sidecar"],
            "checkpoint": {"uri": self.checkpoint_uri, "timeoutSeconds": timeout_seconds},
            "trainer": {"template": {"spec": {
                "restartPolicy": restart_policy,
                # docs/agreement.md: enough for prefetchBatches + 2 steps and a checkpoint on SIGTERM.
                "terminationGracePeriodSeconds": 5,
                "containers": [{"name": "trainer", "image": "e2e-trainer:ignored", "command": command}],
            }}},
        }
        return {"apiVersion": "splitfeed.io/v1alpha1", "kind": "StreamingJob",
                "metadata": {"name": name, "namespace": NS}, "spec": spec}

    def log_dir(self, job: str) -> Path:
        """Where the trainers of `job` log (tests/e2e/trainer.py)."""
        return self.work / "logs" / job

    @property
    def checkpoint_uri(self) -> str:
        return str(self.work / "ckpt")

    def store(self, job: str) -> Path:
        """The job's data checkpoints: <checkpoint.uri>/<namespace>/<job> (pod contract; the step
        directories may sit a level deeper, under the job's UID)."""
        return self.work / "ckpt" / NS / job

    def apply(self, obj: dict[str, Any], check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj), check=check)


def max_step(log_dir: Path, world: int) -> int:
    """The highest global step any rank of world `world` has logged (-1: none yet)."""
    best = -1
    for path in log_dir.glob(f"w{world}-r*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["event"] == "batch":
                best = max(best, rec["step"])
    return best


class StatusWatch:
    """Samples a job's status in a thread: the (phase, Rescaling reason) pairs it walked through."""

    def __init__(self, cluster: Cluster, name: str, interval: float = 0.1) -> None:
        import threading

        self.cluster, self.name, self.interval = cluster, name, interval
        self.seen: list[tuple[str | None, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)

    def __enter__(self) -> "StatusWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sample()  # what the test last waited for, even if the thread had not seen it yet

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def _sample(self) -> None:
        with contextlib.suppress(Exception):
            st = self.cluster.status(self.name)
            now = (st.get("phase"), rescaling_reason(st))
            if not self.seen or self.seen[-1] != now:
                self.seen.append(now)
                log(f"{self.name}: phase {now[0]}, Rescaling reason {now[1]}, "
                    f"world {st.get('worldEpoch')} x{st.get('replicas')}")


def rescaling_reason(status: dict[str, Any]) -> str | None:
    cond = next((c for c in status.get("conditions") or [] if c["type"] == "Rescaling"), None)
    return cond["reason"] if cond else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
