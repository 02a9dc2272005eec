"""operator/cluster/kube.py, leader election and the reconcile loop's guarantees, without an apiserver.

- every API call has a request timeout (a server that never answers is an error in seconds);
- Kopf's own watches and requests have timeouts (handlers.configure);
- the webhook server serves renewed certificate files without a restart;
- the leader Lease: one holder, taken over only after it stopped renewing;
- a status patch decided on an old version is dropped and decided again (no double count);
- a refused creation becomes a condition, never an exception loop.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import copy
import datetime
import json
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import kopf
import kubernetes
import pytest

from splitfeed.operator.cluster import configs, handlers, kube, leader, reconciling
from splitfeed.operator.objects import planning
from splitfeed.operator.lifecycle import rescaling
from splitfeed.trainer_client.transport import keys
from tests.support.builders import manifest
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[2]


# --- timeouts ----------------------------------------------------------------------------------

class Silent:
    """A listening socket that accepts connections and never answers: a hung apiserver."""

    def __init__(self) -> None:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(16)
        self.srv.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.srv.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(OSError):
                self.held.append(self.srv.accept()[0])

    def connections(self) -> int:
        """Every connection made so far: those still in the listen backlog (the accepting
        thread may not have run yet on a loaded machine) are taken here first."""
        with contextlib.suppress(OSError):
            while True:
                self.held.append(self.srv.accept()[0])  # until the 0.2 s timeout: the backlog is empty
        return len(self.held)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        for s in self.held:
            s.close()
        self.srv.close()


@contextlib.contextmanager
def silent_server() -> Any:
    server = Silent()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_every_call_gives_up_on_a_silent_apiserver():
    with silent_server() as silent:
        client = kube.Kube(kubernetes.client.ApiClient(kubernetes.client.Configuration(host=silent.url)),
                           timeout=(0.5, 0.5))
        pod = planning.pod(__import__("splitfeed.trainer_client.contract.specs", fromlist=["x"]).parse_job(manifest()),
                           0, 0, planning.Owner("resnet", "uid-1"), planning.Settings())
        calls = [client.get_job("ns", "resnet"), client.list_pods("ns", "resnet"), client.create(pod),
                 client.patch_job_status("ns", "resnet", {"phase": "Running"}, "7"),
                 client.delete_pod("ns", "resnet-w0-0", "uid"), client.get_lease("ns", "lease")]
        try:
            for call in calls:
                start = time.monotonic()
                with pytest.raises(kube.KubeError) as info:
                    await call
                assert time.monotonic() - start < 5 and info.value.status == 0
        finally:
            client.close()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_closing_the_client_closes_its_connections():
    """A keep-alive apiserver: after Kube.close() the server reads EOF on the connection the
    client used, without waiting for garbage collection (CI saw the socket reported unclosed
    tests later, when a collection happened to run)."""
    import http.server

    closed = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep the connection open between requests

        def do_GET(self) -> None:
            body = json.dumps({"metadata": {"name": "resnet"}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def finish(self) -> None:
            super().finish()
            closed.set()  # handle() returned: the client closed its end

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = kube.Kube(kubernetes.client.ApiClient(kubernetes.client.Configuration(
        host=f"http://127.0.0.1:{server.server_address[1]}")), timeout=(2, 2))
    try:
        assert (await client.get_job("ns", "resnet"))["metadata"]["name"] == "resnet"
        assert not closed.wait(0.5), "the server closed a keep-alive connection on its own"
        client.close()
        assert closed.wait(5), "Kube.close() left the connection open"
    finally:
        client.close()
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_no_client_method_is_called_around_the_timeout():
    """Every API call goes through Kube._call, which sets _request_timeout."""
    tree = ast.parse((ROOT / "operator" / "cluster" / "kube.py").read_text())
    direct = [ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Attribute)
              and isinstance(node.func.value.value, ast.Name) and node.func.value.value.id == "self"
              and node.func.value.attr in ("core", "custom", "policy", "authorization", "coordination")]
    assert direct == []
    assert "_request_timeout=self.timeout" in (ROOT / "operator" / "cluster" / "kube.py").read_text()


@pytest.mark.asyncio
async def test_kopf_watches_and_requests_have_timeouts_and_certificates_are_rechecked(tmp_path):
    settings = kopf.OperatorSettings()
    webhook = configs.Webhook(port=0, certfile=str(tmp_path / "c"), pkeyfile=str(tmp_path / "k"), cert_check_s=3)
    memo = kopf.Memo(config=configs.OperatorConfig(webhook=webhook), kube=object())
    await handlers.configure(settings=settings, memo=memo)
    assert (settings.watching.server_timeout, settings.watching.client_timeout) == (300, 330)
    assert settings.watching.connect_timeout == settings.networking.connect_timeout == 5
    assert settings.networking.request_timeout == 35
    assert settings.watching.inactivity_timeout == 70
    assert settings.admission.server.file_check_interval == 3


@pytest.mark.asyncio
async def test_the_command_line_timeouts_reach_kopf_and_the_client(tmp_path):
    import argparse

    from splitfeed.operator import commands

    parser = argparse.ArgumentParser()
    commands.operator(parser.add_subparsers().add_parser, "operator")
    args = parser.parse_args(["operator", "--api-timeout", "3", "--watch-timeout", "8"])
    config = commands.config_from_args(args)
    settings = kopf.OperatorSettings()
    await handlers.configure(settings=settings, memo=kopf.Memo(config=config, kube=object()))
    assert settings.watching.inactivity_timeout == 8
    assert settings.networking.request_timeout == 5 + 3
    with silent_server() as silent:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": silent.url}}], "users": [{"name": "u", "user": {}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
        client = kube.Kube.connect(str(kubeconfig), (config.timeouts.connect_s, 0.5))
        try:
            with pytest.raises(kube.KubeError, match="ReadTimeoutError"):
                await client.get_job("ns", "resnet")
            # A GET: urllib3 would repeat it 3 times by default, each attempt on a new connection
            # after the full read timeout. Counted, not timed: a loaded machine stretches a call.
            assert silent.connections() == 1
        finally:
            client.close()


class HangingStore:
    """Renewals that never answer (a half-open connection) once `hang` is set."""

    def __init__(self) -> None:
        self.inner, self.hang = LeaseStore(), False

    async def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        if self.hang:
            await asyncio.Event().wait()
        return await self.inner.get_lease(namespace, name)

    async def create_lease(self, lease: dict[str, Any]) -> bool:
        return await self.inner.create_lease(lease)

    async def replace_lease(self, lease: dict[str, Any]) -> bool:
        return await self.inner.replace_lease(lease)


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_holder_whose_renewal_hangs_gives_up_the_lead_by_its_renew_deadline():
    """Not after the call's own timeout, which may be longer than the Lease's duration."""
    store = HangingStore()
    config = configs.LeaderElection(namespace="ops", duration_s=3, renew_s=0.1, renew_deadline_s=1)
    a = leader.Elector(store, config, me="a")  # type: ignore[arg-type]
    await a.acquire()
    store.hang = True
    start = time.monotonic()
    await asyncio.wait_for(a.hold(), 10)
    assert time.monotonic() - start < config.duration_s


# --- the webhook's certificate is reloaded ---------------------------------------------------

def make_cert(d: Path, cn: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "tls.key"),
                    "-out", str(d / "tls.crt"), "-days", "1", "-subj", f"/CN={cn}",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)


def served_cn(port: int) -> str:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, ctx.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    pem = ssl.DER_cert_to_PEM_cert(der)
    out = subprocess.run(["openssl", "x509", "-noout", "-subject"], input=pem, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip().rsplit("=", 1)[-1].strip()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_the_webhook_serves_renewed_certificate_files_without_a_restart(tmp_path):
    live, old, new = tmp_path / "live", tmp_path / "old", tmp_path / "new"
    make_cert(old, "old-cert")
    make_cert(new, "new-cert")
    live.mkdir()
    for name in ("tls.crt", "tls.key"):
        (live / name).write_bytes((old / name).read_bytes())
    port = reconciling_free_port()
    settings = kopf.OperatorSettings()
    webhook = configs.Webhook(port=port, addr="127.0.0.1", host="127.0.0.1", certfile=str(live / "tls.crt"),
                              pkeyfile=str(live / "tls.key"), cert_check_s=0.2)
    await handlers.configure(settings=settings, memo=kopf.Memo(config=configs.OperatorConfig(webhook=webhook),
                                                               kube=object()))

    async def fn(*_: Any, **__: Any) -> Any:
        return {}

    served = settings.admission.server(fn)

    async def serve() -> None:
        async for _ in served:
            pass

    task = asyncio.create_task(serve())
    try:
        async def serves(cn: str, *passing: type[Exception]) -> bool:
            with contextlib.suppress(*passing):
                return await asyncio.to_thread(served_cn, port) == cn
            return False

        await until(lambda: serves("old-cert", OSError), 20, "the server to serve the first certificate")
        # A Secret volume swaps both files (cert-manager renewed the certificate).
        for name in ("tls.crt", "tls.key"):
            (live / name).write_bytes((new / name).read_bytes())
        await until(lambda: serves("new-cert", OSError, ssl.SSLError), 20, "the renewed certificate to be served")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await task


def reconciling_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- leader election -------------------------------------------------------------------------

class LeaseStore:
    """Leases with resourceVersions, as the API keeps them (an update must carry the current one)."""

    def __init__(self) -> None:
        self.leases: dict[str, dict[str, Any]] = {}
        self.version = 0

    async def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.leases.get(name))

    async def create_lease(self, lease: dict[str, Any]) -> bool:
        if lease["metadata"]["name"] in self.leases:
            return False
        return self._store(lease)

    async def replace_lease(self, lease: dict[str, Any]) -> bool:
        current = self.leases.get(lease["metadata"]["name"])
        if current is None or current["metadata"]["resourceVersion"] != lease["metadata"].get("resourceVersion"):
            return False
        return self._store(lease)

    def _store(self, lease: dict[str, Any]) -> bool:
        self.version += 1
        lease = copy.deepcopy(lease)
        lease["metadata"]["resourceVersion"] = str(self.version)
        self.leases[lease["metadata"]["name"]] = lease
        return True

    def holder(self) -> str:
        return self.leases["splitfeed-operator"]["spec"]["holderIdentity"]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.asyncio
async def test_one_holder_and_a_takeover_only_after_it_stopped_renewing():
    store, clock = LeaseStore(), Clock()
    config = configs.LeaderElection(namespace="ops", duration_s=15)
    a = leader.Elector(store, config, me="a", clock=clock)  # type: ignore[arg-type]
    b = leader.Elector(store, config, me="b", clock=clock)  # type: ignore[arg-type]
    assert await a.try_once() and store.holder() == "a"
    assert not await b.try_once()
    clock.t += 10
    assert await a.try_once()  # a renews: the record changes, b's wait starts over
    clock.t += 14
    assert not await b.try_once()
    clock.t += 1
    assert not await b.try_once()  # b has seen the renewed record for 15 s? not yet: it saw it 1 s ago
    clock.t += 15
    assert await b.try_once() and store.holder() == "b"
    lease = store.leases["splitfeed-operator"]["spec"]
    assert lease["leaseTransitions"] == 1 and lease["leaseDurationSeconds"] == 15
    assert not await a.try_once()  # a comes back: b holds it and renews


@pytest.mark.asyncio
async def test_a_released_lease_is_taken_at_once_and_a_lost_one_stops_its_holder():
    store, clock = LeaseStore(), Clock()
    config = configs.LeaderElection(namespace="ops", duration_s=15, renew_s=0.01, renew_deadline_s=10)
    a = leader.Elector(store, config, me="a", clock=clock)  # type: ignore[arg-type]
    b = leader.Elector(store, config, me="b", clock=clock)  # type: ignore[arg-type]
    await a.acquire()
    await a.release()
    assert await b.try_once() and store.holder() == "b"
    # a believes it leads; b holds the Lease: a's next renewal fails and hold() returns.
    await asyncio.wait_for(a.hold(), 2)


# --- the reconcile loop: conflicts and refusals ---------------------------------------------

class FakeKube:
    """A job and its pods, with resourceVersion checks on the status (like the apiserver)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = copy.deepcopy(body)
        self.body["metadata"]["resourceVersion"] = "1"
        self.pods: dict[str, dict[str, Any]] = {}
        self.refuse: tuple[int, str, str] | None = None
        self.before_patch: Any = None
        self.patches: list[dict[str, Any]] = []
        self.keypair: Any = None

    async def job_keys(self, namespace: str, owner: planning.Owner, *, create: bool = False) -> Any:
        """The job's keypair Secret (kube.Kube.job_keys), made on the first pod's creation."""
        if create and self.keypair is None:
            self.keypair = keys.generate()
        return self.keypair

    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.body)

    async def patch_job_status(self, namespace: str, name: str, patch: dict[str, Any],
                               resource_version: str | None = None) -> None:
        if self.before_patch is not None:
            hook, self.before_patch = self.before_patch, None
            hook(self)
        if resource_version is not None and resource_version != self.body["metadata"]["resourceVersion"]:
            raise kube.Conflict(409, "the object has been modified", "Conflict")
        self.patches.append(patch)
        status = self.body.setdefault("status", {})
        for k, v in patch.items():
            if v is None:
                status.pop(k, None)
            else:
                status[k] = copy.deepcopy(v)
        self.bump()

    def bump(self) -> None:
        self.body["metadata"]["resourceVersion"] = str(int(self.body["metadata"]["resourceVersion"]) + 1)

    async def list_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        return copy.deepcopy(list(self.pods.values()))

    async def create(self, obj: dict[str, Any]) -> bool:
        if obj["kind"] == "Pod" and self.refuse is not None:
            raise kube.KubeError(*self.refuse)
        if obj["kind"] == "Pod":
            pod = copy.deepcopy(obj)
            pod["metadata"]["uid"] = f"uid-{pod['metadata']['name']}"
            pod["status"] = {"phase": "Running"}
            self.pods.setdefault(obj["metadata"]["name"], pod)
        return True

    async def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        self.pods[name]["metadata"].setdefault("annotations", {}).update(annotations)

    async def delete_pod(self, namespace: str, name: str, uid: str | None = None) -> bool:
        pod = self.pods.get(name)
        if pod is None or (uid and pod["metadata"]["uid"] != uid):
            return False
        del self.pods[name]
        return True


def context(fake: FakeKube) -> reconciling.Context:
    return reconciling.Context(kube=fake, settings=planning.Settings(restart_backoff_s=0))  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_a_status_decided_on_an_old_version_is_dropped_and_decided_again():
    """A stale decision (restarts 0 -> 1) must not overwrite a newer count (2): lost or double counts."""
    fake = FakeKube(manifest(replicas=1, maxRestarts=5))
    ctx = context(fake)
    await reconciling.reconcile(ctx, "ns", "resnet")
    assert fake.body["status"]["phase"] == "Running" and "resnet-w0-0" in fake.pods
    fake.pods["resnet-w0-0"]["status"]["phase"] = "Failed"

    def second_writer(f: FakeKube) -> None:
        # Between our read and our write, another writer counted two failures.
        f.body["status"]["restarts"] = 2
        f.bump()
    fake.before_patch = second_writer
    await reconciling.reconcile(ctx, "ns", "resnet")
    assert [p["restarts"] for p in fake.patches if "restarts" in p] == [3]  # never the stale 1
    assert fake.body["status"]["restarts"] == 3


@pytest.mark.asyncio
async def test_a_refused_pod_becomes_a_condition_and_an_invalid_one_fails_the_job():
    fake = FakeKube(manifest(replicas=2))
    fake.refuse = (403, 'pods "resnet-w0-0" is forbidden: exceeded quota: team', "Forbidden")
    outcome = await reconciling.reconcile(context(fake), "ns", "resnet")
    conds = {c["type"]: c for c in fake.body["status"]["conditions"]}
    assert conds["PodCreationFailed"]["reason"] == "Forbidden"
    assert "exceeded quota: team" in conds["PodCreationFailed"]["message"]
    assert "PodCreationFailed" in [e.reason for e in outcome.events] and fake.pods == {}
    fake.refuse = (422, 'Pod "resnet-w0-0" is invalid: spec.containers[0].image: Required value', "Invalid")
    fake.body["status"]["podCreation"]["retryAt"] = "2000-01-01T00:00:00Z"
    await reconciling.reconcile(context(fake), "ns", "resnet")
    assert fake.body["status"]["phase"] == "Failed"
    assert {c["type"]: c for c in fake.body["status"]["conditions"]}["Failed"]["reason"] == "InvalidPodTemplate"


@pytest.mark.asyncio
async def test_deletes_name_the_uid_that_was_seen():
    fake = FakeKube(manifest(replicas=1))
    ctx = context(fake)
    await reconciling.reconcile(ctx, "ns", "resnet")
    stale = copy.deepcopy(fake.pods["resnet-w0-0"])
    stale["metadata"].update(name="resnet-w7-0", uid="uid-old")
    stale["metadata"]["labels"]["splitfeed.io/world-epoch"] = "7"
    fake.pods["resnet-w7-0"] = stale
    seen: list[tuple[str, str | None]] = []
    real = fake.delete_pod

    async def recording(namespace: str, name: str, uid: str | None = None) -> bool:
        seen.append((name, uid))
        return await real(namespace, name, uid)
    fake.delete_pod = recording  # type: ignore[method-assign]
    await reconciling.reconcile(ctx, "ns", "resnet")
    assert seen == [("resnet-w7-0", "uid-old")]


def test_decide_runs_off_the_event_loop():
    src = (ROOT / "operator" / "cluster" / "reconciling.py").read_text()
    assert "asyncio.to_thread(_decide_now" in src
    assert datetime.timedelta  # keep the import honest


def test_the_watch_server_timeout_is_an_integer_the_apiserver_can_parse():
    """Kopf puts it into the URL as timeoutSeconds; "300.0" is a 400 from a real apiserver."""
    assert isinstance(configs.ApiTimeouts().watch_server_s, int)


class ClosableStore(LeaseStore):
    def close(self) -> None:
        pass


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_the_operator_stops_with_exit_1_when_its_lease_is_taken_and_hands_it_back_on_a_clean_stop(
        monkeypatch):
    from splitfeed.operator import commands

    store = ClosableStore()
    monkeypatch.setattr(kube.Kube, "connect", classmethod(lambda cls, kubeconfig=None, timeout=None: store))
    stopped = asyncio.Event()

    async def fake_operator(*, stop_flag: asyncio.Event, **_: Any) -> None:
        await stop_flag.wait()
        stopped.set()
    monkeypatch.setattr(kopf, "operator", fake_operator)
    config = configs.OperatorConfig(leader=configs.LeaderElection(namespace="ops", renew_s=0.05,
                                                                  renew_deadline_s=1))
    task = asyncio.create_task(commands._main(config))
    await until(lambda: "splitfeed-operator" in store.leases, 10, "the Lease taken", interval=0.02)
    lease = store.leases["splitfeed-operator"]
    lease["spec"]["holderIdentity"] = "someone-else"  # taken over (this one was presumed dead)
    store.version += 1
    lease["metadata"]["resourceVersion"] = str(store.version)
    assert await asyncio.wait_for(task, 10) == 1 and stopped.is_set()
    assert store.holder() == "someone-else"  # a lost Lease is not "released"

    async def returns(**_: Any) -> None:
        return None
    monkeypatch.setattr(kopf, "operator", returns)
    store.leases.clear()
    assert await asyncio.wait_for(commands._main(config), 10) == 0
    assert store.holder() == ""  # handed back
