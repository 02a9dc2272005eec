"""A StreamingJob being deleted: which of its pods to stop at once. Pure; `handlers` applies it.

Without this, a deleted job's pods run until the garbage collector deletes them (32 s in the
test cluster), and in place (spec.rescale inPlace) the kept pods go on into the next world on
their own meanwhile, so the job's newest checkpoint is not the step its last world drained at.
Deleting them gracefully at once is a preemption (docs/agreement.md): each sidecar's SIGTERM
asks its world to drain at one agreed step and ends it there, even where the world would go
on in place. It adds no finalizer: the handler reacts to the watch events that show the
deletion (a live job carries Kopf's own finalizer, for the status timer, as before).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..objects import planning

DELETED = "DELETED"
"""The watch event of an object that is gone."""
ORPHAN = "orphan"
"""The finalizer `kubectl delete --cascade=orphan` sets: the user keeps the job's pods."""
ENDED = ("Succeeded", "Failed")
"""Pod phases with nothing left to stop."""


def is_deleted(event_type: str | None, job: Mapping[str, Any]) -> bool:
    """The job is gone or being deleted: a DELETED event, or a deletionTimestamp (a finalizer,
    Kopf's or the garbage collector's, holds the object for a while first)."""
    return event_type == DELETED or bool(_meta(job).get("deletionTimestamp"))


def pods_to_stop(job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> dict[str, str | None]:
    """Pod name -> UID of each pod of `job` to delete now (the delete's precondition: a same-named
    successor is left alone; None where the API gave none): those it controls, still running
    and not already being deleted; none where the deletion orphans them."""
    meta = _meta(job)
    uid = meta.get("uid")
    if not uid or ORPHAN in (meta.get("finalizers") or []):
        return {}
    out: dict[str, str | None] = {}
    for pod in pods:
        pod_meta = _meta(pod)
        if (planning.controller_uid(pod) == str(uid) and not pod_meta.get("deletionTimestamp")
                and (pod.get("status") or {}).get("phase") not in ENDED):
            out[str(pod_meta["name"])] = str(pod_meta["uid"]) if pod_meta.get("uid") else None
    return out


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}
