"""A test double for the kubelet: one Node whose pods run as local processes.

NOT product code. The end-to-end tier (tests/e2e) runs on machines without a
container runtime, against the real kube-apiserver and kube-controller-manager
of tests/envtest. This module plays the part of the kubelet (and of the
scheduler: it binds every unscheduled pod to its node):

- registers one Node with status Ready;
- binds pending pods to it through the Binding subresource;
- runs each container's command + args as a local process, with the environment
  a kubelet would build (literals with $(VAR) expansion, envFrom, fieldRef on
  metadata.name/namespace/uid/labels/annotations, spec.nodeName,
  spec.serviceAccountName, status.podIP/hostIP, configMapKeyRef, secretKeyRef);
- maps volumes to per-pod host directories: emptyDir (medium Memory under
  /dev/shm), configMap and secret written as files, downwardAPI files kept up to
  date when labels/annotations change (each file replaced atomically), projected
  (serviceAccountToken via the TokenRequest API), hostPath as itself;
- orders containers as a kubelet does: plain init containers one after the
  other, native sidecars (init containers with restartPolicy Always) started
  before the main containers and stopped after they exit;
- applies the pod's restartPolicy (Never / OnFailure / Always) with a short
  fixed back-off, writes pod status back (phase, container states with exit
  codes and termination messages, podIP, conditions);
- on deletion: SIGTERM, wait the deletion's grace period (capped at 30 s),
  SIGKILL, then delete the pod object with gracePeriodSeconds=0, as the kubelet
  does; a pod object removed under it (a forced delete) has its processes
  SIGKILLed at once.

Liberties a test double takes (and the only ones):
- Images are ignored. `splitfeed`, `python` and `python3` resolve to the
  project's virtual environment; any other command is looked up on PATH.
- THE ONE LIBERTY WITH PATHS: a process sees the host file system, so every
  absolute mountPath that appears as a path prefix in a container's command,
  args, env values or workingDir is replaced by the host directory of that
  volume; the terminationMessagePath (/dev/termination-log) likewise becomes a
  per-container file, whose content becomes state.terminated.message.
  Paths inside files (a ConfigMap's JSON, say) are not rewritten.
- In-cluster config reads fixed absolute paths, so a pod that mounts a service
  account token gets KUBECONFIG pointing at a kubeconfig holding that token
  (and no KUBERNETES_SERVICE_HOST): the apiserver then enforces RBAC with the
  service account's identity.
- podIP and hostIP are this host's first non-loopback IPv4 address (127.0.0.1
  if it has none): Endpoints reject loopback addresses, and Services (a
  webhook's, say) need endpoints. Every process shares the host network.
- CLUSTER DNS IN /etc/hosts: there is no cluster DNS, so the names Kubernetes
  DNS gives a pod with spec.hostname + spec.subdomain under a headless Service
  of that name in its namespace (`<hostname>.<subdomain>`, `….<ns>.svc`,
  `….<ns>.svc.cluster.local`) are written, with the pod IP, into marked lines
  of /etc/hosts (glibc's getaddrinfo reads it on every lookup: torch's gloo and
  ZeroMQ resolve through it). A name appears once the pod is admitted and the
  Service exists, stays while the pod terminates (publishNotReadyAddresses, as
  the operator's Service sets), and goes when the pod has finished or its
  object is gone; `stop()` removes the kubelet's lines, and every edit drops
  the lines of test kubelets whose process is dead. The short name resolves
  from every namespace (there are no per-pod search domains). Writing
  /etc/hosts needs root, as CI has.
- exec readiness probes run (periodSeconds, timeoutSeconds, initialDelaySeconds; paths
  mapped as in commands); a container with one is ready only once it passed, and the
  pod is Ready when every main and native-sidecar container is. Other probes,
  securityContext, resources and ports are ignored; ConfigMap and
  Secret volumes are written once, when the pod starts.
- A test may `hold(namespace, pod)` a pod: it is admitted (it has its IP and DNS
  name) but stays Pending, ContainerCreating, as during a slow image pull, until
  `release(namespace, pod)`.

Every process is started in its own process group and stopped by PID (its
group), on pod deletion and in `stop()`, also when a test fails.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support import guards, processes

__all__ = ["Kubelet", "ApiError", "HostsFile", "host_ip"]

SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
GRACE_CAP_S = 30.0
RESTART_DELAY_S = 1.0
SYNC_S = 0.2


def host_ip() -> str:
    """This host's first non-loopback IPv4 address (no packet is sent), else 127.0.0.1."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.254.254.254", 1))
        ip = s.getsockname()[0]
        if not ip.startswith("127."):
            return ip
    return "127.0.0.1"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARK = "# splitfeed-test-kubelet"
"""Ends every line a test kubelet writes into /etc/hosts, followed by its owner's tag."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def rewrite_hosts(text: str, tag: str, entries: list[str],
                  alive: Callable[[int], bool] = _pid_alive) -> str:
    """/etc/hosts text with `tag`'s lines replaced by `entries` and dead owners' lines dropped.

    Each line a kubelet writes ends with `HOSTS_MARK node=… id=… pid=<pid>`: the
    lines of a kubelet whose process is gone are stale and go too. Every other
    line is kept as it is.
    """
    kept = []
    for line in text.splitlines(keepends=True):
        _, sep, owner = line.rstrip("\n").partition(f" {HOSTS_MARK} ")
        if sep:
            pid = re.search(r"\bpid=(\d+)$", owner)
            if owner == tag or (pid is not None and not alive(int(pid.group(1)))):
                continue
        kept.append(line)
    if kept and not kept[-1].endswith("\n"):
        kept[-1] += "\n"
    return "".join(kept) + "".join(f"{entry} {HOSTS_MARK} {tag}\n" for entry in entries)


class HostsFile:
    """One kubelet's lines in /etc/hosts: pod DNS names -> pod IP (the cluster DNS liberty).

    Edits hold an exclusive lock (a file beside the temp dir, shared by every
    test kubelet on the host) and replace the file atomically, or, where it is a
    bind mount that cannot be renamed over (a container's /etc/hosts), rewrite it
    in place without ever exposing a half-written line.
    """

    LOCK = Path(tempfile.gettempdir()) / "splitfeed-test-kubelet-hosts.lock"

    def __init__(self, node: str, path: Path = HOSTS_FILE) -> None:
        self.path = path
        self.tag = f"node={node} id={uuid.uuid4().hex[:8]} pid={os.getpid()}"
        self.entries: list[str] | None = None  # what this kubelet last wrote

    def set(self, entries: list[str]) -> bool:
        """Make this kubelet's lines `entries` (and drop stale owners'); False if nothing changed."""
        if entries == self.entries or (not entries and not self.entries):
            return False
        self._edit(entries)
        self.entries = list(entries)
        return True

    def clear(self) -> None:
        self._edit([])
        self.entries = []

    def writable(self) -> bool:
        return os.access(self.path, os.W_OK)

    def _edit(self, entries: list[str]) -> None:
        with open(self.LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            old = self.path.read_text()
            new = rewrite_hosts(old, self.tag, entries)
            if new != old:
                self._replace(old, new)

    def _replace(self, old: str, new: str) -> None:
        tmp = self.path.with_name(f".{self.path.name}.splitfeed-{os.getpid()}")
        try:
            tmp.write_text(new)
            os.chmod(tmp, stat_mode(self.path))
            os.replace(tmp, self.path)
            return
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if exc.errno not in (errno.EBUSY, errno.EXDEV, errno.EPERM, errno.EACCES, errno.EROFS):
                raise
        # A bind mount: write over it, padding with blank lines (which a reader skips) so that
        # no moment shows the tail of an old line, then cut the padding off.
        data = new.encode()
        pad = max(0, len(old.encode()) - len(data))
        with open(self.path, "r+b") as f:
            f.write(data + b"\n" * pad)
            f.flush()
            f.truncate(len(data))


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777


class ApiError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        self.status = status
        super().__init__(f"HTTP {status}: {body[:400]}")


class Api:
    """A minimal JSON client for the kube-apiserver (bearer token, CA file)."""

    def __init__(self, server: str, token: str, ca_file: str | os.PathLike[str]) -> None:
        self.server, self.token = server.rstrip("/"), token
        self.ssl = ssl.create_default_context(cafile=str(ca_file))

    def call(self, method: str, path: str, body: Any = None,
             content_type: str = "application/json") -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": content_type,
            "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=15, context=self.ssl) as resp:
                text = resp.read()
        except urllib.error.HTTPError as exc:
            with exc:
                raise ApiError(exc.code, exc.read().decode("utf-8", "replace")) from None
        return json.loads(text) if text else None

    def get(self, path: str) -> Any:
        return self.call("GET", path)

    def patch(self, path: str, body: Any) -> Any:
        return self.call("PATCH", path, body, "application/merge-patch+json")


def _quote(value: str) -> str:
    """Go's strconv.Quote for the downward API's key="value" lines (JSON is close enough)."""
    return json.dumps(value)


def _field(pod: dict[str, Any], path: str, ip: str) -> str:
    """A downward-API fieldPath of `pod`, as the kubelet renders it."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1]) or {}
        return "".join(f"{k}={_quote(str(v))}\n" for k, v in sorted(items.items()))
    simple = {
        "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": ip, "status.hostIP": ip, "status.podIPs": ip, "status.hostIPs": ip,
    }
    if path not in simple:
        raise ValueError(f"fieldPath {path!r} is not supported by the test kubelet")
    return str(simple[path] or "")


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: defined names are replaced, $$ escapes."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, text)


class Container:
    """One container of a pod: its process and what the status reports about it."""

    def __init__(self, spec: dict[str, Any], kind: str) -> None:
        self.spec, self.kind = spec, kind  # kind: init | sidecar | main
        self.name: str = spec["name"]
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: str | None = None
        self.restarts = 0
        self.terminated: dict[str, Any] | None = None  # the current state, when not running
        self.last: dict[str, Any] | None = None  # lastState.terminated
        self.next_start = 0.0
        self.stopping = False
        self.probe_ok: bool | None = None  # the readiness probe's last result (None: not run since the start)
        self.next_probe = 0.0
        self.host_path: Callable[[str], str] | None = None  # this start's path mapping, for probes
        self.env: dict[str, str] = {}

    @property
    def ready(self) -> bool:
        return self.running and ("exec" not in (self.spec.get("readinessProbe") or {}) or self.probe_ok is True)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        return None if self.terminated is None else int(self.terminated["exitCode"])


class PodRun:
    """What the kubelet knows about one pod it runs."""

    def __init__(self, pod: dict[str, Any], root: Path) -> None:
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.namespace, self.name = meta["namespace"], meta["name"]
        self.dir = root / f"{self.namespace}_{self.name}_{self.uid[:8]}"
        self.shm = guards.shm_root() / f"kubelet-{self.uid[:8]}"
        self.pod = pod
        spec = pod["spec"]
        self.containers: list[Container] = [
            Container(c, "sidecar" if c.get("restartPolicy") == "Always" else "init")
            for c in spec.get("initContainers") or []
        ] + [Container(c, "main") for c in spec.get("containers") or []]
        self.volumes: dict[str, Path] | None = None  # name -> host dir, once prepared
        self.downward: dict[Path, list[dict[str, Any]]] = {}  # dir -> downward items
        self.waiting_reason = "ContainerCreating"
        self.waiting_message = ""
        self.phase = "Pending"
        self.start_time = _now()
        self.conditions: dict[str, tuple[str, str]] = {}  # type -> (status, since)
        self.written: dict[str, Any] | None = None
        self.kill_deadline: float | None = None
        self.gone = False  # processes stopped, pod object deleted

    def container(self, name: str) -> Container:
        return next(c for c in self.containers if c.name == name)


class Kubelet:
    """Runs the pods bound to `node` as local processes. Use as a context manager."""

    def __init__(self, server: str, token: str, ca_file: str | os.PathLike[str],
                 workdir: str | os.PathLike[str], *, bin_dir: str | os.PathLike[str],
                 node: str = "e2e-node", pod_ip: str | None = None,
                 grace_cap_s: float = GRACE_CAP_S, restart_delay_s: float = RESTART_DELAY_S,
                 hosts_file: Path = HOSTS_FILE) -> None:
        self.api = Api(server, token, ca_file)
        self.server, self.ca_file = server, Path(ca_file)
        self.root = Path(workdir)
        self.bin_dir = Path(bin_dir)
        self.node = node
        self.ip = pod_ip or host_ip()
        self.grace_cap_s, self.restart_delay_s = grace_cap_s, restart_delay_s
        self.runs: dict[str, PodRun] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.root.mkdir(parents=True, exist_ok=True)
        self._log: Any = open(self.root / "kubelet.log", "a", buffering=1)
        self._deleted: set[str] = set()  # uids of pod objects this kubelet removed
        self._held: set[tuple[str, str]] = set()  # (namespace, pod) kept Pending by the test
        self.hosts = HostsFile(node, Path(hosts_file))
        """This kubelet's pod DNS names in /etc/hosts (see the module doc)."""
        self.errors: list[str] = []
        """Tracebacks of failed syncs (the loop goes on); shown when a test fails."""

    # -- public -------------------------------------------------------------------------
    def __enter__(self) -> "Kubelet":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> "Kubelet":
        if not self.hosts.writable():
            raise PermissionError(f"the test kubelet plays cluster DNS in {self.hosts.path} and cannot write it "
                                  "(run the end-to-end tier as root, as CI does)")
        self.hosts.clear()  # also drops the lines of test kubelets that died without stop()
        self._register_node()
        self._thread = threading.Thread(target=self._loop, name="test-kubelet", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop, then every process by PID (SIGTERM, short wait, SIGKILL)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        with self._lock:
            runs = list(self.runs.values())
            for run in runs:
                self._signal_all(run, signal.SIGTERM)
            deadline = time.monotonic() + 5
            for run in runs:
                for c in run.containers:
                    if c.proc is not None:
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            c.proc.wait(max(0.1, deadline - time.monotonic()))
                self._signal_all(run, signal.SIGKILL)
                self._reap(run)
                shutil.rmtree(run.shm, ignore_errors=True)
        if self.hosts.entries:
            with contextlib.suppress(OSError):
                self.hosts.clear()
        if self._log is not None:
            self._log.close()
            self._log = None

    def hold(self, namespace: str, pod: str) -> None:
        """Keep `pod` Pending, its containers not started (a slow image pull), until release()."""
        with self._lock:
            self._held.add((namespace, pod))

    def release(self, namespace: str, pod: str) -> None:
        with self._lock:
            self._held.discard((namespace, pod))

    def pid(self, namespace: str, pod: str, container: str) -> int | None:
        """PID of a running container's process (also its process group)."""
        with self._lock:
            for run in self.runs.values():
                if (run.namespace, run.name) == (namespace, pod):
                    c = run.container(container)
                    return c.proc.pid if c.running and c.proc else None
        return None

    def pids(self) -> dict[tuple[str, str, str], int]:
        """(namespace, pod, container) -> PID of every running process."""
        with self._lock:
            return {(r.namespace, r.name, c.name): c.proc.pid for r in self.runs.values()
                    for c in r.containers if c.running and c.proc}

    def log_path(self, namespace: str, pod: str, container: str) -> Path | None:
        with self._lock:
            for run in self.runs.values():
                if (run.namespace, run.name) == (namespace, pod):
                    return run.dir / "containers" / container / "output.log"
        return None

    def log(self, message: str) -> None:
        if self._log is not None:
            self._log.write(f"{datetime.datetime.now():%H:%M:%S.%f} {message}\n")

    # -- the sync loop ------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception:  # noqa: BLE001 - a test double keeps going, loudly
                self.errors.append(traceback.format_exc())
                self.log("sync failed:\n" + traceback.format_exc())
            self._stop.wait(SYNC_S)

    def _sync(self) -> None:
        pods = self.api.get("/api/v1/pods")["items"]
        seen: set[str] = set()
        for pod in pods:
            meta, spec = pod["metadata"], pod["spec"]
            if not spec.get("nodeName"):
                if not meta.get("deletionTimestamp"):
                    self._bind(pod)
                continue
            if spec["nodeName"] != self.node:
                continue
            seen.add(meta["uid"])
            try:
                self._sync_pod(pod)
            except Exception:  # noqa: BLE001
                self.log(f"pod {meta['namespace']}/{meta['name']}:\n{traceback.format_exc()}")
        with self._lock:
            for uid in [u for u in self.runs if u not in seen]:
                run = self.runs.pop(uid)  # removed under us (force-deleted, or finished and deleted)
                self.log(f"{run.namespace}/{run.name} is gone from the API: stopping what still runs")
                self._signal_all(run, signal.SIGKILL)
                self._reap(run)
                shutil.rmtree(run.shm, ignore_errors=True)
        self._publish_names()

    # -- cluster DNS (the /etc/hosts liberty) --------------------------------------------
    def _publish_names(self) -> None:
        """Pod DNS names of every admitted, unfinished pod with hostname + subdomain under a
        headless Service of that name (publishNotReadyAddresses is what the operator sets)."""
        with self._lock:
            wanted = [(r.namespace, r.pod["spec"]["hostname"], r.pod["spec"]["subdomain"])
                      for r in self.runs.values()
                      if not r.gone and r.phase not in ("Succeeded", "Failed")
                      and r.pod["spec"].get("hostname") and r.pod["spec"].get("subdomain")]
        entries: list[str] = []
        if wanted:
            headless = {(s["metadata"]["namespace"], s["metadata"]["name"])
                        for s in self.api.get("/api/v1/services")["items"]
                        if (s.get("spec") or {}).get("clusterIP") == "None"}
            for ns, host, sub in sorted(set(wanted)):
                if (ns, sub) in headless:
                    fqdn = f"{host}.{sub}.{ns}.svc"
                    entries.append(f"{self.ip} {host}.{sub} {fqdn} {fqdn}.cluster.local")
        if self.hosts.set(entries):
            self.log(f"{self.hosts.path}: {len(entries)} pod names")

    def _register_node(self) -> None:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node, "labels": {
            "kubernetes.io/hostname": self.node, "kubernetes.io/os": "linux"}}}
        with contextlib.suppress(ApiError):
            self.api.call("POST", "/api/v1/nodes", node)
        capacity = {"cpu": str(os.cpu_count() or 1), "memory": "64Gi", "pods": "110"}
        self.api.patch(f"/api/v1/nodes/{self.node}/status", {"status": {
            "capacity": capacity, "allocatable": capacity,
            "addresses": [{"type": "InternalIP", "address": self.ip}, {"type": "Hostname", "address": self.node}],
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "test kubelet (local processes)", "lastHeartbeatTime": _now(),
                            "lastTransitionTime": _now()}],
            "nodeInfo": {"kubeletVersion": "v0.0.0-test", "operatingSystem": "linux",
                         "architecture": "amd64", "containerRuntimeVersion": "local-processes://0",
                         "kernelVersion": "", "osImage": "", "machineID": "", "systemUUID": "",
                         "bootID": "", "kubeProxyVersion": ""}}})

    def _bind(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"], "uid": meta["uid"]},
                "target": {"apiVersion": "v1", "kind": "Node", "name": self.node}}
        try:
            self.api.call("POST", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding", body)
            self.log(f"bound {meta['namespace']}/{meta['name']}")
        except ApiError as exc:
            if exc.status not in (404, 409):
                raise

    def _sync_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        with self._lock:
            run = self.runs.get(uid)
            if meta.get("deletionTimestamp"):
                self._terminate(run, pod)
                return
            if run is None:
                if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    return  # finished before this kubelet started: nothing to run
                run = self.runs[uid] = PodRun(pod, self.root)
                self.log(f"admitted {run.namespace}/{run.name}")
                self._publish_names()  # the pod's DNS name exists before its containers start
            run.pod = pod
            if run.volumes is None and (run.namespace, run.name) in self._held:
                run.waiting_reason = "ContainerCreating"
                run.waiting_message = "held by the test (as during a slow image pull)"
            elif run.phase not in ("Succeeded", "Failed"):
                if run.volumes is None:
                    run.waiting_message = ""
                    self._prepare(run)
                if run.volumes is not None:
                    self._refresh_downward(run)
                    self._advance(run)
                    self._probe(run)
            self._write_status(run)

    # -- volumes ----------------------------------------------------------------------
    def _prepare(self, run: PodRun) -> None:
        """Create every volume; a missing ConfigMap/Secret leaves the pod waiting."""
        volumes: dict[str, Path] = {}
        try:
            for vol in run.pod["spec"].get("volumes") or []:
                volumes[vol["name"]] = self._volume(run, vol)
        except _NotYet as exc:
            run.waiting_reason, run.waiting_message = "ContainerCreating", str(exc)
            return
        run.volumes = volumes

    def _volume(self, run: PodRun, vol: dict[str, Any]) -> Path:
        name = vol["name"]
        if "hostPath" in vol:
            path = Path(vol["hostPath"]["path"])
            if vol["hostPath"].get("type") == "DirectoryOrCreate":
                path.mkdir(parents=True, exist_ok=True)
            return path
        if "emptyDir" in vol:
            base = run.shm if (vol["emptyDir"] or {}).get("medium") == "Memory" else run.dir / "volumes"
            (base / name).mkdir(parents=True, exist_ok=True)
            return base / name
        target = run.dir / "volumes" / name
        target.mkdir(parents=True, exist_ok=True)
        sources: list[dict[str, Any]]
        if "projected" in vol:
            sources = vol["projected"].get("sources") or []
        else:
            sources = [vol]
        for src in sources:
            if "configMap" in src:
                self._write_keys(run, target, "configmaps", src["configMap"], "name", binary=False)
            elif "secret" in src:
                self._write_keys(run, target, "secrets", src["secret"], "secretName", binary=True)
            elif "downwardAPI" in src:
                run.downward.setdefault(target, []).extend(src["downwardAPI"].get("items") or [])
            elif "serviceAccountToken" in src:
                tok = src["serviceAccountToken"]
                sa = run.pod["spec"].get("serviceAccountName") or "default"
                req = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
                    "audiences": [tok["audience"]] if tok.get("audience") else None,
                    "expirationSeconds": tok.get("expirationSeconds", 3600),
                    "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": run.name, "uid": run.uid}}}
                out = self.api.call(
                    "POST", f"/api/v1/namespaces/{run.namespace}/serviceaccounts/{sa}/token", req)
                _atomic_write(target / tok.get("path", "token"), out["status"]["token"].encode())
            else:
                raise ValueError(f"volume {name}: unsupported source {sorted(src)}")
        return target

    def _write_keys(self, run: PodRun, target: Path, kind: str, ref: dict[str, Any], key: str,
                    binary: bool) -> None:
        try:
            obj = self.api.get(f"/api/v1/namespaces/{run.namespace}/{kind}/{ref[key]}")
        except ApiError as exc:
            if exc.status == 404 and ref.get("optional"):
                return
            if exc.status == 404:
                raise _NotYet(f"{kind[:-1]} {ref[key]} not found") from None
            raise
        data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()} if binary else {
            k: v.encode() for k, v in (obj.get("data") or {}).items()}
        items = ref.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            if item["key"] in data:
                _atomic_write(target / item["path"], data[item["key"]])

    def _refresh_downward(self, run: PodRun) -> None:
        for target, items in run.downward.items():
            for item in items:
                if "fieldRef" not in item:
                    continue  # resourceFieldRef: not modelled
                text = _field(run.pod, item["fieldRef"]["fieldPath"], self.ip).encode()
                path = target / item["path"]
                if not path.exists() or path.read_bytes() != text:
                    _atomic_write(path, text)

    # -- containers -------------------------------------------------------------------
    def _advance(self, run: PodRun) -> None:
        """One step of the container life cycle; sets run.phase."""
        policy = run.pod["spec"].get("restartPolicy") or "Always"
        now = time.monotonic()
        for c in run.containers:
            self._collect(run, c)
        # Plain init containers in order; native sidecars started on the way.
        for c in run.containers:
            if c.kind == "main":
                break
            if c.kind == "sidecar":
                if c.proc is None or (not c.running and not c.stopping and now >= c.next_start):
                    self._start(run, c)
                continue
            if c.exit_code == 0:
                continue
            if c.running:
                run.phase = "Pending"
                return
            if c.terminated is not None:
                if policy == "Never":
                    run.phase = "Failed"
                    self._stop_sidecars(run)
                    return
                if now < c.next_start:
                    run.phase = "Pending"
                    return
            self._start(run, c)
            run.phase = "Pending"
            return
        mains = [c for c in run.containers if c.kind == "main"]
        for c in mains:
            if c.proc is None:
                self._start(run, c)
            elif not c.running and self._restarts(policy, c) and now >= c.next_start:
                self._start(run, c)
        if all(not c.running and c.terminated is not None and not self._restarts(policy, c) for c in mains):
            self._stop_sidecars(run)
            if not any(c.running for c in run.containers):
                run.phase = "Succeeded" if all(c.exit_code == 0 for c in mains) else "Failed"
                shutil.rmtree(run.shm, ignore_errors=True)
                self.log(f"{run.namespace}/{run.name} {run.phase}")
                return
        run.phase = "Running"

    @staticmethod
    def _restarts(policy: str, c: Container) -> bool:
        return policy == "Always" or (policy == "OnFailure" and c.exit_code not in (0, None))

    def _stop_sidecars(self, run: PodRun) -> None:
        for c in reversed(run.containers):
            if c.kind == "sidecar" and c.running and not c.stopping and c.proc is not None:
                c.stopping = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGTERM)

    def _collect(self, run: PodRun, c: Container) -> None:
        """Notice a process that has exited: state.terminated with its message."""
        if c.proc is None or c.terminated is not None or c.proc.poll() is None:
            return
        code = c.proc.returncode
        code = 128 - code if code < 0 else code
        cdir = run.dir / "containers" / c.name
        message = ""
        with contextlib.suppress(OSError):
            message = (cdir / "termination-log").read_bytes()[:4096].decode("utf-8", "replace")
        if not message and code != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            with contextlib.suppress(OSError):
                message = "\n".join((cdir / "output.log").read_text(errors="replace").splitlines()[-80:])[-2048:]
        c.terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                        "startedAt": c.started_at, "finishedAt": _now(), "containerID": f"local://{c.proc.pid}"}
        if message:
            c.terminated["message"] = message
        c.next_start = time.monotonic() + self.restart_delay_s
        self.log(f"{run.namespace}/{run.name}/{c.name} pid {c.proc.pid} exited {code}")

    def _start(self, run: PodRun, c: Container) -> None:
        assert run.volumes is not None
        if c.proc is not None:
            c.restarts += 1
            c.last = c.terminated
        c.terminated, c.stopping = None, False
        cdir = run.dir / "containers" / c.name
        cdir.mkdir(parents=True, exist_ok=True)
        term = cdir / "termination-log"
        term.write_bytes(b"")
        try:
            argv, env, cwd = self._command(run, c, term)
        except Exception as exc:  # noqa: BLE001 - reported like a container that cannot start
            c.proc = None
            c.terminated = {"exitCode": 128, "reason": "StartError", "message": str(exc)[:4096],
                            "startedAt": _now(), "finishedAt": _now()}
            c.next_start = time.monotonic() + self.restart_delay_s
            c.proc = _Exited()
            self.log(f"{run.namespace}/{run.name}/{c.name} cannot start: {exc}")
            return
        with open(cdir / "output.log", "ab") as out:
            out.write(f"--- {_now()} start: {argv}\n".encode())
            out.flush()
            c.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=processes.die_with_parent(signal.SIGKILL))
        c.started_at = _now()
        c.probe_ok, c.env = None, env
        c.next_probe = time.monotonic() + float((c.spec.get("readinessProbe") or {}).get("initialDelaySeconds", 0))
        self.log(f"{run.namespace}/{run.name}/{c.name} started pid {c.proc.pid}: {argv}")

    def _command(self, run: PodRun, c: Container, term: Path) -> tuple[list[str], dict[str, str], str]:
        """argv, environment and working directory of container `c`, paths mapped to the host."""
        assert run.volumes is not None
        spec, pod = c.spec, run.pod
        home = run.dir / "home"
        home.mkdir(parents=True, exist_ok=True)
        mounts: dict[str, str] = {}
        for m in spec.get("volumeMounts") or []:
            host = run.volumes[m["name"]] / m.get("subPath", "")
            mounts[m["mountPath"].rstrip("/") or "/"] = str(host).rstrip("/")
        mounts[spec.get("terminationMessagePath") or "/dev/termination-log"] = str(term)

        def host_path(text: str) -> str:
            for mount in sorted(mounts, key=len, reverse=True):
                text = re.sub(r"(?<![\w.\-/])" + re.escape(mount) + r"(?=/|$|[^\w.\-])",
                              lambda _m, h=mounts[mount]: h, text)
            return text

        env: dict[str, str] = {"PATH": f"{self.bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home),
                               "HOSTNAME": pod["spec"].get("hostname") or run.name,
                               "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1"}
        sa_dir = mounts.get(SA_MOUNT)
        if sa_dir and os.path.exists(os.path.join(sa_dir, "token")):
            env["KUBECONFIG"] = str(self._kubeconfig(run, Path(sa_dir)))
        for src in spec.get("envFrom") or []:
            prefix = src.get("prefix", "")
            for kind, key, binary in (("configMapRef", "configmaps", False), ("secretRef", "secrets", True)):
                if kind in src:
                    obj = self._get_optional(run, key, src[kind])
                    for k, v in ((obj or {}).get("data") or {}).items():
                        env[prefix + k] = base64.b64decode(v).decode() if binary else v
        for e in spec.get("env") or []:
            if "valueFrom" not in e:
                env[e["name"]] = _expand(str(e.get("value", "")), env)
                continue
            vf = e["valueFrom"]
            if "fieldRef" in vf:
                env[e["name"]] = _field(pod, vf["fieldRef"]["fieldPath"], self.ip)
            elif "configMapKeyRef" in vf or "secretKeyRef" in vf:
                binary = "secretKeyRef" in vf
                ref = vf["secretKeyRef"] if binary else vf["configMapKeyRef"]
                obj = self._get_optional(run, "secrets" if binary else "configmaps",
                                         {"name": ref["name"], "optional": ref.get("optional")})
                value = ((obj or {}).get("data") or {}).get(ref["key"])
                if value is None and not ref.get("optional"):
                    raise ValueError(f"env {e['name']}: key {ref['key']!r} not in {ref['name']}")
                if value is not None:
                    env[e["name"]] = base64.b64decode(value).decode() if binary else value
            elif "resourceFieldRef" in vf:
                env[e["name"]] = "0"
        env = {k: host_path(v) for k, v in env.items()}
        words = [_expand(w, env) for w in (spec.get("command") or []) + (spec.get("args") or [])]
        if not spec.get("command"):
            raise ValueError("no command: the test kubelet ignores images, so a container needs one")
        argv = [host_path(w) for w in words]
        argv[0] = self._executable(argv[0], env["PATH"])
        c.host_path = host_path
        cwd = host_path(spec["workingDir"]) if spec.get("workingDir") else str(home)
        return argv, env, cwd

    def _probe(self, run: PodRun) -> None:
        """Run each due exec readiness probe, as the kubelet does, in the container's view."""
        now = time.monotonic()
        for c in run.containers:
            probe = c.spec.get("readinessProbe") or {}
            if "exec" not in probe or not c.running or c.host_path is None or now < c.next_probe:
                continue
            c.next_probe = now + float(probe.get("periodSeconds", 10))
            try:
                argv = [c.host_path(w) for w in probe["exec"]["command"]]
                argv[0] = self._executable(argv[0], c.env.get("PATH", os.defpath))
                done = subprocess.run(argv, env=c.env, capture_output=True,
                                      timeout=float(probe.get("timeoutSeconds", 1)))
                ok = done.returncode == 0
            except (OSError, ValueError, subprocess.TimeoutExpired):  # a command that cannot run fails
                ok = False
            if ok != c.probe_ok:
                self.log(f"{run.namespace}/{run.name}/{c.name} readiness probe: {'ready' if ok else 'not ready'}")
            c.probe_ok = ok

    def _executable(self, name: str, path: str) -> str:
        base = os.path.basename(name)
        if base in ("python", "python3") or re.fullmatch(r"python3\.\d+", base):
            return str(self.bin_dir / "python")
        if base == "splitfeed":
            return str(self.bin_dir / "splitfeed")
        if os.path.isabs(name) and os.access(name, os.X_OK):
            return name
        found = shutil.which(base, path=path)
        if found is None:
            raise ValueError(f"executable {name!r} not found")
        return found

    def _get_optional(self, run: PodRun, kind: str, ref: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return self.api.get(f"/api/v1/namespaces/{run.namespace}/{kind}/{ref['name']}")
        except ApiError as exc:
            if exc.status == 404 and ref.get("optional"):
                return None
            raise

    def _kubeconfig(self, run: PodRun, sa_dir: Path) -> Path:
        """A kubeconfig with the pod's service-account token: RBAC sees the pod's identity."""
        ca = sa_dir / "ca.crt" if (sa_dir / "ca.crt").exists() else self.ca_file
        cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "pod", "preferences": {},
               "clusters": [{"name": "pod", "cluster": {"server": self.server, "certificate-authority": str(ca)}}],
               "users": [{"name": "pod", "user": {"tokenFile": str(sa_dir / "token")}}],
               "contexts": [{"name": "pod", "context": {"cluster": "pod", "user": "pod",
                                                        "namespace": run.namespace}}]}
        path = run.dir / "kubeconfig"
        _atomic_write(path, json.dumps(cfg, indent=1).encode())
        return path

    # -- status -----------------------------------------------------------------------
    def _container_status(self, run: PodRun, c: Container) -> dict[str, Any]:
        if c.running:
            state: dict[str, Any] = {"running": {"startedAt": c.started_at}}
        elif c.terminated is not None:
            restarting = run.phase not in ("Succeeded", "Failed") and c.kind != "init" and not c.stopping \
                and self._restarts(run.pod["spec"].get("restartPolicy") or "Always", c)
            state = {"waiting": {"reason": "CrashLoopBackOff"}} if restarting else {"terminated": c.terminated}
        else:
            state = {"waiting": {"reason": run.waiting_reason, **(
                {"message": run.waiting_message} if run.waiting_message else {})}}
        last = {"terminated": c.last} if c.last else {}
        if "waiting" in state and c.terminated is not None and "terminated" not in last:
            last = {"terminated": c.terminated}
        pid = c.proc.pid if c.proc is not None and not isinstance(c.proc, _Exited) else None
        return {"name": c.name, "image": c.spec.get("image", ""), "imageID": "",
                "containerID": f"local://{pid}" if pid else "", "ready": c.ready, "started": c.running,
                "restartCount": c.restarts, "state": state, "lastState": last}

    def _condition(self, run: PodRun, type_: str, ok: bool) -> dict[str, Any]:
        status = "True" if ok else "False"
        old = run.conditions.get(type_)
        if old is None or old[0] != status:
            run.conditions[type_] = (status, _now())
        return {"type": type_, "status": status, "lastProbeTime": None,
                "lastTransitionTime": run.conditions[type_][1]}

    def _write_status(self, run: PodRun) -> None:
        inits = [c for c in run.containers if c.kind != "main"]
        mains = [c for c in run.containers if c.kind == "main"]
        ready = run.phase == "Running" and all(c.ready for c in mains + [c for c in inits if c.kind == "sidecar"])
        initialized = all(c.exit_code == 0 for c in inits if c.kind == "init") and run.volumes is not None
        status: dict[str, Any] = {
            "phase": run.phase, "hostIP": self.ip, "podIP": self.ip, "podIPs": [{"ip": self.ip}],
            "startTime": run.start_time,
            "conditions": [self._condition(run, "Initialized", initialized),
                           self._condition(run, "Ready", ready),
                           self._condition(run, "ContainersReady", ready),
                           self._condition(run, "PodScheduled", True)],
            "containerStatuses": [self._container_status(run, c) for c in mains],
        }
        if inits:
            status["initContainerStatuses"] = [self._container_status(run, c) for c in inits]
        if status == run.written:
            return
        try:
            self.api.patch(f"/api/v1/namespaces/{run.namespace}/pods/{run.name}/status", {"status": status})
            run.written = status
        except ApiError as exc:
            if exc.status != 404:
                raise

    # -- deletion ---------------------------------------------------------------------
    def _terminate(self, run: PodRun | None, pod: dict[str, Any]) -> None:
        """SIGTERM, grace (capped), SIGKILL; then remove the pod object (grace 0)."""
        meta = pod["metadata"]
        if run is not None and not run.gone:
            live = [c for c in run.containers if c.running]
            if live and run.kill_deadline is None:
                grace = float(meta.get("deletionGracePeriodSeconds",
                                       pod["spec"].get("terminationGracePeriodSeconds", 30)))
                run.kill_deadline = time.monotonic() + min(max(grace, 0.0), self.grace_cap_s)
                self.log(f"{run.namespace}/{run.name} deleted: SIGTERM to {[c.name for c in live]}")
                for c in live:
                    c.stopping = True
                self._signal_all(run, signal.SIGTERM)
            if live and time.monotonic() < (run.kill_deadline or 0):
                return
            if live:
                self.log(f"{run.namespace}/{run.name}: grace period over, SIGKILL")
                self._signal_all(run, signal.SIGKILL)
            self._reap(run)
            shutil.rmtree(run.shm, ignore_errors=True)
            run.gone = True
        if meta["uid"] in self._deleted:
            return
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                "preconditions": {"uid": meta["uid"]}}
        try:
            self.api.call("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", body)
            self.log(f"{meta['namespace']}/{meta['name']} removed")
        except ApiError as exc:
            if exc.status not in (404, 409):
                raise
        self._deleted.add(meta["uid"])
        self.runs.pop(meta["uid"], None)

    def _signal_all(self, run: PodRun, sig: int) -> None:
        for c in run.containers:
            if c.running and c.proc is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(c.proc.pid, sig)

    def _reap(self, run: PodRun) -> None:
        for c in run.containers:
            if c.proc is not None and not isinstance(c.proc, _Exited):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(5)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(c.proc.pid, signal.SIGKILL)  # stray children of the group


class _NotYet(Exception):
    """A volume's source does not exist yet: the pod waits, as with a real kubelet."""


class _Exited:
    """Stands in for a process that never started (StartError)."""

    pid = 0
    returncode = 128

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
