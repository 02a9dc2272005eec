"""A real Kubernetes control plane on loopback for tests ("envtest").

``ControlPlane`` starts etcd, kube-apiserver and optionally kube-controller-manager as
local processes on free 127.0.0.1 ports, from a directory of binaries laid out the
envtest way (``KUBEBUILDER_ASSETS``: ``kube-apiserver``, ``etcd``, ``kubectl``, and
``kube-controller-manager`` if controllers are wanted). ``tests/envtest/build.sh``
(``make envtest``) provides such a directory on machines without official binaries.

    with ControlPlane(find_assets(), tmp_path, controllers=["garbagecollector"]) as cp:
        cp.kubectl("get", "namespaces")
        ...  # cp.kubeconfig, cp.server, cp.token, cp.ca_file

Every process is stopped by PID on exit, also when starting fails half-way.
Only the standard library and the ``openssl`` command are used.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
from typing import Any
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path

from tests.support import processes, waiting
from tests.support.ports import free_port

__all__ = ["ControlPlane", "ControlPlaneError", "KubectlError", "find_assets", "cache_bin_dir",
           "MISSING_ASSETS_HINT"]

REQUIRED_BINARIES = ("kube-apiserver", "etcd", "kubectl")
MISSING_ASSETS_HINT = (
    "no kube-apiserver/etcd/kubectl found: run `make envtest` "
    "(tests/envtest/build.sh) or set KUBEBUILDER_ASSETS to a directory holding them"
)
ADMIN_USER = "envtest-admin"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"


class ControlPlaneError(RuntimeError):
    """A control-plane process failed to start or become ready."""


class KubectlError(subprocess.CalledProcessError):
    """kubectl exited non-zero; the message carries its stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstderr:\n{(self.stderr or '').strip()}"


def cache_bin_dir() -> Path:
    """Where tests/envtest/build.sh caches binaries."""
    root = os.environ.get("SPLITFEED_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "splitfeed")
    return Path(root) / "envtest" / "bin"


def _has_binaries(d: Path, names: Iterable[str] = REQUIRED_BINARIES) -> bool:
    return all((d / n).is_file() and os.access(d / n, os.X_OK) for n in names)


def find_assets() -> Path | None:
    """$KUBEBUILDER_ASSETS, else the build.sh cache, if it holds the binaries; else None.

    Cheap: looks at files only, runs and builds nothing.
    """
    env = os.environ.get("KUBEBUILDER_ASSETS")
    if env and _has_binaries(Path(env)):
        return Path(env).resolve()
    cached = cache_bin_dir()
    if _has_binaries(cached):
        return cached.resolve()
    return None


def _tail(path: Path, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


def _http_get(url: str, timeout: float, context: ssl.SSLContext | None = None,
              headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        with exc:  # an HTTPError holds the open response: close it
            return exc.code, exc.read()


_OPENSSL_CNF = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign, digitalSignature
subjectKeyIdentifier = hash
[v3_srv]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
authorityKeyIdentifier = keyid
"""

_flag_cache: dict[tuple[str, str], bool] = {}


def _supports_flag(binary: Path, flag: str) -> bool:
    """Whether `binary --help` lists `flag` (flags differ across Kubernetes versions)."""
    key = (str(binary), flag)
    if key not in _flag_cache:
        try:
            out = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30)
            _flag_cache[key] = f"{flag} " in (out.stdout + out.stderr) or f"{flag}=" in (out.stdout + out.stderr)
        except (OSError, subprocess.TimeoutExpired):
            _flag_cache[key] = False
    return _flag_cache[key]


class ControlPlane:
    """etcd + kube-apiserver (+ kube-controller-manager) on 127.0.0.1, as a context manager."""

    def __init__(
        self,
        assets_dir: str | os.PathLike[str],
        workdir: str | os.PathLike[str],
        controllers: Sequence[str] | None = None,
        *,
        start_timeout: float = 90.0,
        apiserver_args: Sequence[str] = (),
        controller_manager_args: Sequence[str] = (),
    ) -> None:
        self.assets = Path(assets_dir).resolve()
        self.workdir = Path(workdir).resolve()
        self.controllers = list(controllers) if controllers else None
        self.start_timeout = start_timeout
        self.apiserver_args = list(apiserver_args)
        self.controller_manager_args = list(controller_manager_args)

        self.token = "envtest-admin-" + os.urandom(16).hex()
        self.host = "127.0.0.1"
        self.port: int | None = None
        self.etcd_url: str | None = None
        self.kubeconfig: Path = self.workdir / "kubeconfig"
        self.ca_file: Path = self.workdir / "pki" / "ca.crt"
        self.startup_seconds: dict[str, float] = {}
        # name -> (process, log path); insertion order = start order
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self._log_files: list = []

    # ------------------------------------------------------------------ public API
    @property
    def server(self) -> str:
        if self.port is None:
            raise ControlPlaneError("control plane not started")
        return f"https://{self.host}:{self.port}"

    @property
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.processes.items()}

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment for child processes: KUBECONFIG pointing at this control plane."""
        env = dict(os.environ if base is None else base)
        env["KUBECONFIG"] = str(self.kubeconfig)
        return env

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.assets / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args]
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        proc = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=timeout, env=env)
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc

    def wait_established(self, *crds: str, timeout: float = 60.0) -> None:
        """Until each CRD is Established. Not `kubectl wait --for=condition=established`: on a
        CRD so new that it has no status yet, that exits 1 ("status.conditions accessor error")
        instead of waiting."""
        pending, stderr = list(crds), [""]

        def established() -> bool:
            """Drops each CRD from `pending`, in order, once Established; True when none is left."""
            while pending:
                got = self.kubectl("get", "crd", pending[0], "-o", "json", check=False)
                stderr[0] = got.stderr
                status = json.loads(got.stdout).get("status") or {} if got.returncode == 0 else {}
                conditions = status.get("conditions") or []
                if not any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions):
                    return False
                pending.pop(0)
            return True

        try:
            waiting.wait_for(established, timeout, f"CRDs {', '.join(crds)} Established")
        except AssertionError:
            raise ControlPlaneError(
                f"CRD {pending[0]} not Established after {timeout:.0f} s: {stderr[0]}") from None

    def api_get(self, path: str, timeout: float = 10.0) -> dict:
        """GET a JSON API path with the admin token; ControlPlaneError unless 200."""
        status, body = self._http_get(path, timeout=timeout)
        if status != 200:
            raise ControlPlaneError(f"GET {path}: HTTP {status}: {body[:500]!r}")
        return json.loads(body)

    def _http_get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        """GET with the admin token; returns (status, body) and always closes the socket."""
        return _http_get(self.server + path, timeout, self._ssl_context(),
                         {"Authorization": f"Bearer {self.token}"})

    def start(self) -> "ControlPlane":
        if not _has_binaries(self.assets):
            raise ControlPlaneError(f"{self.assets}: {MISSING_ASSETS_HINT}")
        if self.controllers and not _has_binaries(self.assets, ["kube-controller-manager"]):
            raise ControlPlaneError(f"{self.assets} has no kube-controller-manager: run `make envtest`")
        if shutil.which("openssl") is None:
            raise ControlPlaneError("the `openssl` command is needed to make test certificates")
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._make_pki()
            self._start_etcd()
            self._start_apiserver()
            self._write_kubeconfig()
            if self.controllers:
                self._start_controller_manager()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every process by PID (reverse start order): terminate, wait, kill."""
        for name, proc in reversed(list(self.processes.items())):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    proc.wait(timeout=15)
        for f in self._log_files:
            with contextlib.suppress(OSError):
                f.close()
        self._log_files.clear()

    def __enter__(self) -> "ControlPlane":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ internals
    def _ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def _openssl(self, *args: str) -> None:
        proc = subprocess.run(["openssl", *args], capture_output=True, text=True, cwd=self.workdir / "pki")
        if proc.returncode != 0:
            raise ControlPlaneError(f"openssl {' '.join(args)} failed:\n{proc.stderr}")

    def _make_pki(self) -> None:
        pki = self.workdir / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        (pki / "openssl.cnf").write_text(_OPENSSL_CNF)
        ec = ["-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256"]
        # CA + serving certificate for 127.0.0.1 (so clients can verify, no insecure mode)
        self._openssl("genpkey", *ec, "-out", "ca.key")
        self._openssl("req", "-x509", "-new", "-key", "ca.key", "-out", "ca.crt", "-days", "7",
                      "-subj", "/CN=splitfeed-envtest-ca", "-config", "openssl.cnf", "-extensions", "v3_ca")
        self._openssl("genpkey", *ec, "-out", "apiserver.key")
        self._openssl("req", "-new", "-key", "apiserver.key", "-out", "apiserver.csr",
                      "-subj", "/CN=kube-apiserver", "-config", "openssl.cnf")
        self._openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                      "-CAcreateserial", "-out", "apiserver.crt", "-days", "7",
                      "-extfile", "openssl.cnf", "-extensions", "v3_srv")
        # service-account signing key pair (RSA: accepted by every Kubernetes version)
        self._openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key")
        self._openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub")
        # static token file: token,user,uid,"group1,group2"
        (pki / "tokens.csv").write_text(f'{self.token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
        for f in ("ca.key", "apiserver.key", "sa.key", "tokens.csv"):
            os.chmod(pki / f, 0o600)

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log_path = self.workdir / f"{name}.log"
        logf = open(log_path, "ab")
        self._log_files.append(logf)
        self.logs[name] = log_path
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
            env=env if env is not None else os.environ.copy(),
            preexec_fn=processes.die_with_parent(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None,
        )
        self.processes[name] = proc
        return proc

    def _wait(self, name: str, probe, what: str) -> None:
        """Poll `probe()` until true; fail fast if the process exits; fail on timeout."""
        proc = self.processes[name]
        t0 = time.monotonic()
        last_error: list[object] = [None]

        def ready() -> bool:
            if proc.poll() is not None:
                raise ControlPlaneError(
                    f"{name} exited with code {proc.returncode} before {what}; "
                    f"last lines of {self.logs[name]}:\n{_tail(self.logs[name])}"
                )
            try:
                return bool(probe())
            except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
                last_error[0] = exc
                return False

        try:
            waiting.wait_for(ready, self.start_timeout, f"{name} {what}")
        except AssertionError:
            raise ControlPlaneError(
                f"{name} not {what} after {self.start_timeout:.0f} s (last error: {last_error[0]}); "
                f"last lines of {self.logs[name]}:\n{_tail(self.logs[name])}"
            ) from None
        self.startup_seconds[name] = time.monotonic() - t0

    def _start_etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        peer_url = f"http://127.0.0.1:{peer}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        self._spawn("etcd", [
            str(self.assets / "etcd"),
            "--name=envtest",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={self.etcd_url}",
            f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=envtest={peer_url}",
            "--initial-cluster-state=new",
            "--log-level=warn",
        ], env=env)

        def healthy() -> bool:
            status, body = _http_get(self.etcd_url + "/health", 2)
            return status == 200 and json.loads(body).get("health") == "true"

        self._wait("etcd", healthy, "healthy")

    def _start_apiserver(self) -> None:
        pki = self.workdir / "pki"
        self.port = free_port()
        self._spawn("kube-apiserver", [
            str(self.assets / "kube-apiserver"),
            f"--etcd-servers={self.etcd_url}",
            f"--bind-address={self.host}",
            f"--advertise-address={self.host}",
            f"--secure-port={self.port}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            "--authorization-mode=RBAC",
            f"--token-auth-file={pki / 'tokens.csv'}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            "--service-cluster-ip-range=10.0.0.0/24",  # allocation range only; no traffic
            "--allow-privileged=true",
            "--profiling=false",
            *self.apiserver_args,
        ])
        def ready() -> bool:
            status, body = self._http_get("/readyz", timeout=3)
            if status == 404:  # very old servers: no /readyz
                status, body = self._http_get("/healthz", timeout=3)
            if status != 200:
                raise ControlPlaneError(f"HTTP {status}: {body[-300:]!r}")
            return True

        self._wait("kube-apiserver", ready, "ready (/readyz)")

    def _write_kubeconfig(self) -> None:
        # JSON is valid YAML: every kubeconfig reader accepts it.
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "envtest", "cluster": {
                "server": self.server, "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": ADMIN_USER, "user": {"token": self.token}}],
            "contexts": [{"name": "envtest", "context": {"cluster": "envtest", "user": ADMIN_USER,
                                                          "namespace": "default"}}],
            "current-context": "envtest",
            "preferences": {},
        }
        self.kubeconfig.write_text(json.dumps(cfg, indent=2) + "\n")
        os.chmod(self.kubeconfig, 0o600)

    def _start_controller_manager(self) -> None:
        pki = self.workdir / "pki"
        kcm = self.assets / "kube-controller-manager"
        args = [
            str(kcm),
            f"--kubeconfig={self.kubeconfig}",
            f"--controllers={','.join(self.controllers or [])}",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            "--leader-elect=false",
            "--use-service-account-credentials=false",
            f"--bind-address={self.host}",
            "--secure-port=0",  # no serving at all: nothing to collide with
            "--profiling=false",
        ]
        if _supports_flag(kcm, "--port"):  # <= 1.23 also serves plain HTTP on 10252 by default
            args.append("--port=0")
        args += self.controller_manager_args
        self._spawn("kube-controller-manager", args)

        wants_sa = any(c in ("*", "serviceaccount") for c in self.controllers or [])
        if wants_sa:
            # Ready for pods once the default service account exists.
            def sa_ready() -> bool:
                self.api_get("/api/v1/namespaces/default/serviceaccounts/default")
                return True

            self._wait("kube-controller-manager", sa_ready, "ready (default service account)")
        else:
            # No observable readiness: at least make sure it did not die at once.
            self._wait("kube-controller-manager", lambda: True, "started")


def strip_cel(node: Any) -> Any:
    """Kubernetes 1.20 rejects x-kubernetes-validations (CEL arrived in 1.25)."""
    if isinstance(node, dict):
        return {k: strip_cel(v) for k, v in node.items() if k != "x-kubernetes-validations"}
    if isinstance(node, list):
        return [strip_cel(v) for v in node]
    return node


if __name__ == "__main__":  # manual use: python -m tests.support.controlplane [controllers]
    import tempfile

    assets = find_assets()
    if assets is None:
        sys.exit(MISSING_ASSETS_HINT)
    ctrls = sys.argv[1].split(",") if len(sys.argv) > 1 else None
    with tempfile.TemporaryDirectory(prefix="envtest-") as d, ControlPlane(assets, d, ctrls) as cp:
        print(f"server {cp.server}\nkubeconfig {cp.kubeconfig}\nstartup {cp.startup_seconds}")
        print("Ctrl-C to stop")
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()

