"""The only module that talks to the Kubernetes API (besides Kopf itself).

Thin async wrappers over the synchronous `kubernetes` client, each call run in a
worker thread (`asyncio.to_thread`) so that Kopf's event loop never blocks, and
each with a request timeout (connect, read): a hung apiserver is an error the
next reconcile retries, never a stuck handler. Every write is idempotent the way
the reconciler needs it: create treats an object of the same name that this job
controls as done, delete treats NotFound as done. Objects another controller
owns are never replaced or deleted: `create` raises NotOwned, and a pod is
deleted only with its UID as a precondition. Status patches carry the
resourceVersion they were decided on, so two writers cannot both apply one
decision (Conflict). Objects go in and come out as plain JSON dicts
(`_preload_content=False`), the same shape Kopf and `planning` use. Client
errors become `KubeError` here, at one boundary.

tests/chart derives the chart's RBAC from the client calls in this module.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import kubernetes
import urllib3

from splitfeed.trainer_client.contract import wellknown, errors
from splitfeed.trainer_client.transport import keys

from ..objects import planning

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
REQUEST_TIMEOUT_S = (5.0, 30.0)
"""(connect, read) seconds for every API call."""
RETRIES = urllib3.Retry(total=1, connect=1, read=0, status=0, redirect=0)
"""urllib3 retries a GET three times by default, each attempt with the full read timeout: a
half-open connection then held a call for four timeouts. Here a refused connection is tried
once more and a read that timed out is never repeated (the reconcile loop retries), so a call
ends within 2 x connect + read seconds."""
USER_AGENT = "splitfeed-operator/0.1.0"

log = logging.getLogger(__name__)


class KubeError(errors.SplitfeedError, RuntimeError):
    """An API call failed for a reason the caller cannot treat as success."""

    def __init__(self, status: int, message: str, reason: str = "") -> None:
        self.status = status
        self.reason = reason
        self.message = message
        super().__init__(f"HTTP {status}{f' {reason}' if reason else ''}: {message}")


class Conflict(KubeError):
    """A precondition (resourceVersion, UID) no longer holds: re-read and decide again."""


class NotOwned(KubeError):
    """An object of that name exists and its controller is not the job's UID."""


def _decode(resp: Any) -> dict[str, Any]:
    data = resp.data if hasattr(resp, "data") else resp
    return json.loads(data) if data else {}


def _error(exc: BaseException) -> KubeError:
    if isinstance(exc, kubernetes.client.ApiException):
        message, reason = str(exc.body or exc.reason), str(exc.reason or "")
        try:
            body = json.loads(exc.body) if exc.body else {}
            if isinstance(body, dict):
                message, reason = str(body.get("message") or message), str(body.get("reason") or reason)
        except (TypeError, ValueError):
            pass
        return (Conflict if exc.status == 409 else KubeError)(int(exc.status or 0), message, reason)
    # urllib3: timeouts, refused connections, TLS failures. A MaxRetryError's text repeats the
    # pool's repr around the cause; the URL and the cause are what a reader needs.
    if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason is not None:
        return KubeError(0, f"{exc.url}: {type(exc.reason).__name__}: {exc.reason}", "NoAnswer")
    return KubeError(0, f"{type(exc).__name__}: {exc}", "NoAnswer")


class Kube:
    """Calls for StreamingJobs, the pods, Services, ConfigMaps, budgets, keypair Secrets and
    NetworkPolicies of their worlds, admission checks, and the operator's leader Lease."""

    def __init__(self, api_client: kubernetes.client.ApiClient,
                 timeout: tuple[float, float] = REQUEST_TIMEOUT_S) -> None:
        self.api_client = api_client
        api_client.user_agent = USER_AGENT
        self.timeout = timeout
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.custom = kubernetes.client.CustomObjectsApi(api_client)
        self.policy = kubernetes.client.PolicyV1Api(api_client)
        self.authorization = kubernetes.client.AuthorizationV1Api(api_client)
        self.coordination = kubernetes.client.CoordinationV1Api(api_client)
        self.networking = kubernetes.client.NetworkingV1Api(api_client)
        self._warned: set[str] = set()
        self._keys: dict[tuple[str, str], keys.Keypair] = {}

    @classmethod
    def connect(cls, kubeconfig: str | None = None, timeout: tuple[float, float] = REQUEST_TIMEOUT_S) -> "Kube":
        """From a kubeconfig (argument, $KUBECONFIG, ~/.kube/config), else in-cluster.

        The path is always explicit: the client would otherwise read whatever
        $KUBECONFIG said when it was first imported.
        """
        path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
        config = kubernetes.client.Configuration()
        config.retries = RETRIES  # read by the ApiClient's pool manager when it is made
        if os.path.exists(path):
            return cls(kubernetes.config.new_client_from_config(config_file=path, client_configuration=config),
                       timeout)
        kubernetes.config.load_incluster_config(client_configuration=config)
        return cls(kubernetes.client.ApiClient(config), timeout)

    def close(self) -> None:
        """Close the client's sockets too: ApiClient.close() stops only its thread pool, and
        urllib3 2's PoolManager.clear() only forgets its pools, so their connections stayed
        open until garbage collection. A call still running in a thread hands its connection
        back to a closed pool, which closes it."""
        self.api_client.close()
        manager = self.api_client.rest_client.pool_manager
        for key in list(manager.pools.keys()):
            manager.pools[key].close()
        manager.clear()

    async def _call(self, fn: Any, *args: Any, ok: tuple[int, ...] = (), **kwargs: Any) -> dict[str, Any] | None:
        """Run one client call in a thread; None for a status listed in `ok`."""
        try:
            resp = await asyncio.to_thread(fn, *args, _preload_content=False, _request_timeout=self.timeout,
                                           **kwargs)
        except (kubernetes.client.ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            error = _error(exc)
            if error.status and error.status in ok:
                return None
            raise error from exc
        return _decode(resp)

    # --- StreamingJobs -----------------------------------------------------------------------
    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._call(self.custom.get_namespaced_custom_object, wellknown.GROUP,
                                wellknown.VERSION, namespace, wellknown.PLURAL, name, ok=(404,))

    async def patch_job_status(self, namespace: str, name: str, patch: Mapping[str, Any],
                               resource_version: str | None = None) -> None:
        """A merge patch of the status; with `resource_version`, only onto that version (else Conflict)."""
        body: dict[str, Any] = {"status": dict(patch)}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        await self._call(self.custom.patch_namespaced_custom_object_status, wellknown.GROUP,
                         wellknown.VERSION, namespace, wellknown.PLURAL, name, body,
                         _content_type=MERGE_PATCH, ok=(404,))

    # --- world objects -----------------------------------------------------------------------
    async def list_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        """Pods of every world of `job` (filtered again here: some emulators ignore selectors)."""
        selector = planning.selector_string(job)
        out = await self._call(self.core.list_namespaced_pod, namespace, label_selector=selector)
        items = (out or {}).get("items") or []
        return [p for p in items
                if ((p.get("metadata") or {}).get("labels") or {}).get(wellknown.LABEL_JOB) == job]

    async def create(self, obj: Mapping[str, Any]) -> bool | None:
        """Create a Pod, Service, ConfigMap, Secret, PodDisruptionBudget or NetworkPolicy.

        True: created. False: an object of that name exists and the same job (controller
        UID) controls it; a ConfigMap's data and a budget's or policy's spec (a policy's
        replaced whole) are then brought up to date for the pods about to start. None: the
        cluster serves no such kind (policy/v1 budgets before Kubernetes 1.21), skipped.
        Raises NotOwned when another controller owns the name.
        """
        kind, ns, name = obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]
        create, read = {  # (create, read) of each kind
            "Pod": (self.core.create_namespaced_pod, self.core.read_namespaced_pod),
            "Service": (self.core.create_namespaced_service, self.core.read_namespaced_service),
            "ConfigMap": (self.core.create_namespaced_config_map, self.core.read_namespaced_config_map),
            "Secret": (self.core.create_namespaced_secret, self.core.read_namespaced_secret),
            "PodDisruptionBudget": (self.policy.create_namespaced_pod_disruption_budget,
                                    self.policy.read_namespaced_pod_disruption_budget),
            "NetworkPolicy": (self.networking.create_namespaced_network_policy,
                              self.networking.read_namespaced_network_policy)}[kind]
        try:
            created = await self._call(create, ns, dict(obj), ok=(409,))
        except KubeError as exc:
            if kind == "PodDisruptionBudget" and exc.status == 404:
                if kind not in self._warned:
                    self._warned.add(kind)
                    log.warning("the cluster serves no policy/v1 PodDisruptionBudget: worlds run without one")
                return None
            raise
        if created is not None:
            return True
        existing = await self._call(read, name, ns, ok=(404,))
        if existing is None:  # deleted in between: the next reconcile creates it
            return False
        ours, theirs = planning.controller_uid(obj), planning.controller_uid(existing)
        if theirs != ours:
            raise NotOwned(409, f"its controller is {theirs or 'none'}, not StreamingJob {ours}", "NotOwned")
        if kind == "ConfigMap":
            # The data config must match the pods about to start (their checksum env).
            await self._call(self.core.patch_namespaced_config_map, name, ns,
                             {"data": obj["data"], "metadata": {"annotations": obj["metadata"].get("annotations")}},
                             _content_type=MERGE_PATCH)
        elif kind == "PodDisruptionBudget" and existing.get("spec") != obj["spec"]:
            await self._call(self.policy.patch_namespaced_pod_disruption_budget, name, ns,
                             {"spec": obj["spec"]}, _content_type=MERGE_PATCH)
        elif kind == "NetworkPolicy" and existing.get("spec") != obj["spec"]:
            log.info("%s/%s: NetworkPolicy %s is not the operator's: its spec replaced", ns, name, name)
            await self._call(self.networking.patch_namespaced_network_policy, name, ns,
                             [{"op": "replace", "path": "/spec", "value": obj["spec"]}], _content_type=JSON_PATCH)
        return False

    async def job_keys(self, namespace: str, owner: planning.Owner, *, create: bool = False) -> keys.Keypair | None:
        """The job's CURVE keypair from its Secret (planning.keys_secret), which `create` makes
        first where there is none; None without one. Kept once read: the Secret is immutable
        and its name holds the job's UID."""
        name = planning.keys_secret_name(owner.name, owner.uid)
        cached = self._keys.get((namespace, name))
        if cached is not None:
            return cached
        found = await self._call(self.core.read_namespaced_secret, name, namespace, ok=(404,))
        if found is None and create:
            await self.create(planning.keys_secret(namespace, owner, keys.generate()))
            found = await self._call(self.core.read_namespaced_secret, name, namespace, ok=(404,))
        if found is None:
            return None
        theirs = planning.controller_uid(found)
        if theirs != owner.uid:
            raise NotOwned(409, f"Secret {name}: its controller is {theirs or 'none'}, not StreamingJob "
                                f"{owner.uid}", "NotOwned")
        keypair = planning.keypair_of(found)
        self._keys[(namespace, name)] = keypair
        return keypair

    async def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        await self._call(self.core.patch_namespaced_pod, name, namespace,
                         {"metadata": {"annotations": dict(annotations)}},
                         _content_type=MERGE_PATCH, ok=(404,))

    async def label_pod(self, namespace: str, name: str, labels: Mapping[str, str]) -> None:
        await self._call(self.core.patch_namespaced_pod, name, namespace, {"metadata": {"labels": dict(labels)}},
                         _content_type=MERGE_PATCH, ok=(404,))

    async def delete_pod(self, namespace: str, name: str, uid: str | None = None) -> bool:
        """Delete the pod; with `uid`, only that very pod (a same-named successor is left alone)."""
        body = {"preconditions": {"uid": uid}} if uid else None
        return await self._call(self.core.delete_namespaced_pod, name, namespace, body=body,
                                ok=(404, 409)) is not None

    # --- admission ---------------------------------------------------------------------------
    async def dry_run_pod(self, pod: Mapping[str, Any]) -> None:
        """Let the apiserver validate (and admit) a pod without creating it; KubeError if refused."""
        await self._call(self.core.create_namespaced_pod, pod["metadata"]["namespace"], dict(pod),
                         dry_run="All")

    async def may_create_pods(self, namespace: str, user: Mapping[str, Any]) -> bool:
        """SubjectAccessReview: may `user` (an admission request's userInfo) create pods in `namespace`?"""
        spec: dict[str, Any] = {
            "user": user.get("username"), "groups": user.get("groups"), "uid": user.get("uid"),
            "extra": user.get("extra"),
            "resourceAttributes": {"namespace": namespace, "verb": "create", "resource": "pods"},
        }
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                  "spec": {k: v for k, v in spec.items() if v is not None}}
        out = await self._call(self.authorization.create_subject_access_review, review)
        return bool(((out or {}).get("status") or {}).get("allowed"))

    # --- the leader Lease --------------------------------------------------------------------
    async def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._call(self.coordination.read_namespaced_lease, name, namespace, ok=(404,))

    async def create_lease(self, lease: Mapping[str, Any]) -> bool:
        """False if a Lease of that name exists already (someone else was first)."""
        return await self._call(self.coordination.create_namespaced_lease, lease["metadata"]["namespace"],
                                dict(lease), ok=(409,)) is not None

    async def replace_lease(self, lease: Mapping[str, Any]) -> bool:
        """An update carrying the resourceVersion it was read at; False on a conflict."""
        meta = lease["metadata"]
        return await self._call(self.coordination.replace_namespaced_lease, meta["name"], meta["namespace"],
                                dict(lease), ok=(409,)) is not None


async def asking_keys(k: Kube, namespace: str, name: str, uid: str) -> keys.Keypair | None:
    """The job's keypair to ask its world's coordinator with; None (logged) when it cannot be
    read: every such ask is best effort, and the pod annotation is the sure path."""
    try:
        return await k.job_keys(namespace, planning.Owner(name=name, uid=uid))
    except (KubeError, errors.UserError) as exc:
        log.warning("%s/%s: cannot read the job's keypair Secret: %s", namespace, name, exc)
        return None
