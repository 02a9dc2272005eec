"""The only module that talks to the Kubernetes API (besides Kopf itself).

Thin async wrappers over the synchronous `kubernetes` client, each call run in a
worker thread (`asyncio.to_thread`) so that Kopf's event loop never blocks.
Every write is idempotent the way the reconciler needs it: create treats
AlreadyExists as done, delete treats NotFound as done. Objects go in and come
out as plain JSON dicts (`_preload_content=False`), the same shape Kopf and
`planning` use. Client errors become `KubeError` here, at one boundary.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping
from typing import Any

import kubernetes

from . import planning

MERGE_PATCH = "application/merge-patch+json"


class KubeError(RuntimeError):
    """An API call failed for a reason the caller cannot treat as success."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(f"HTTP {status}: {message}")


def _decode(resp: Any) -> dict[str, Any]:
    data = resp.data if hasattr(resp, "data") else resp
    return json.loads(data) if data else {}


class Kube:
    """Calls for StreamingJobs and the pods, Services and ConfigMaps of their worlds."""

    def __init__(self, api_client: kubernetes.client.ApiClient) -> None:
        self.api_client = api_client
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.custom = kubernetes.client.CustomObjectsApi(api_client)

    @classmethod
    def connect(cls, kubeconfig: str | None = None) -> "Kube":
        """From a kubeconfig (argument, $KUBECONFIG, ~/.kube/config), else in-cluster.

        The path is always explicit: the client would otherwise read whatever
        $KUBECONFIG said when it was first imported.
        """
        path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
        if os.path.exists(path):
            return cls(kubernetes.config.new_client_from_config(config_file=path))
        config = kubernetes.client.Configuration()
        kubernetes.config.load_incluster_config(client_configuration=config)
        return cls(kubernetes.client.ApiClient(config))

    def close(self) -> None:
        self.api_client.close()

    async def _call(self, fn: Any, *args: Any, ok: tuple[int, ...] = (), **kwargs: Any) -> dict[str, Any] | None:
        """Run one client call in a thread; None for a status listed in `ok`."""
        try:
            resp = await asyncio.to_thread(fn, *args, _preload_content=False, **kwargs)
        except kubernetes.client.ApiException as exc:
            if exc.status in ok:
                return None
            raise KubeError(exc.status or 0, str(exc.body or exc.reason)) from exc
        return _decode(resp)

    # --- StreamingJobs -----------------------------------------------------------------------
    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._call(self.custom.get_namespaced_custom_object, planning.GROUP,
                                planning.VERSION, namespace, planning.PLURAL, name, ok=(404,))

    async def patch_job_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        await self._call(self.custom.patch_namespaced_custom_object_status, planning.GROUP,
                         planning.VERSION, namespace, planning.PLURAL, name, {"status": dict(patch)},
                         _content_type=MERGE_PATCH, ok=(404,))

    # --- world objects -----------------------------------------------------------------------
    async def list_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        """Pods of every world of `job` (filtered again here: some emulators ignore selectors)."""
        selector = planning.selector_string(job)
        out = await self._call(self.core.list_namespaced_pod, namespace, label_selector=selector)
        items = (out or {}).get("items") or []
        return [p for p in items
                if ((p.get("metadata") or {}).get("labels") or {}).get(planning.LABEL_JOB) == job]

    async def create(self, obj: Mapping[str, Any]) -> bool:
        """Create a Pod, Service or ConfigMap; False if it existed (a ConfigMap is then replaced)."""
        kind, ns = obj["kind"], obj["metadata"]["namespace"]
        create = {"Pod": self.core.create_namespaced_pod, "Service": self.core.create_namespaced_service,
                  "ConfigMap": self.core.create_namespaced_config_map}[kind]
        created = await self._call(create, ns, dict(obj), ok=(409,))
        if created is None and kind == "ConfigMap":
            # The data config must match the pods about to start (their checksum env).
            await self._call(self.core.patch_namespaced_config_map, obj["metadata"]["name"], ns,
                             {"data": obj["data"], "metadata": {"annotations": obj["metadata"].get("annotations")}},
                             _content_type=MERGE_PATCH)
        return created is not None

    async def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        await self._call(self.core.patch_namespaced_pod, name, namespace,
                         {"metadata": {"annotations": dict(annotations)}},
                         _content_type=MERGE_PATCH, ok=(404,))

    async def delete_pod(self, namespace: str, name: str) -> bool:
        return await self._call(self.core.delete_namespaced_pod, name, namespace, ok=(404,)) is not None
