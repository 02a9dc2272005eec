"""Validating admission webhooks: a StreamingJob, and its scale subresource.

`register` adds them to a Kopf registry; `commands` does so only when a webhook
server is configured (Kopf refuses to start with admission handlers but no
server). The rules are `admission`'s, the same ones the reconciler re-checks
before every reshape. An UPDATE is also judged against the old object
(immutable order-defining fields; a scale or suspend needs spec.checkpoint.uri),
and so is a scale: the guard where the CRD's CEL rules are absent.
"""

from __future__ import annotations

from typing import Any

import kopf

from . import admission, planning

G, V, P = planning.GROUP, planning.VERSION, planning.PLURAL


def register(registry: kopf.OperatorRegistry) -> None:
    kopf.on.validate(G, V, P, id="streamingjob", operations=["CREATE", "UPDATE"],
                     registry=registry)(validate_job)
    kopf.on.validate(G, V, P, subresource="scale", id="scale", operations=["UPDATE"],
                     registry=registry)(validate_scale)


def validate_job(body: kopf.Body, memo: kopf.Memo, old: Any = None, operation: str | None = None,
                 **_: Any) -> None:
    # Kopf's own metadata/status patches must pass even for a job admitted before the rules.
    if operation == "UPDATE" and old and old.get("spec") == body.get("spec"):
        return
    defaults = memo["ctx"].settings.sidecar_defaults
    try:
        if operation == "UPDATE" and old:
            admission.review_update(old, body, defaults)
        else:
            admission.review_job(body, defaults)
    except admission.Rejected as exc:
        raise kopf.AdmissionError(str(exc), code=422) from exc


async def validate_scale(body: kopf.Body, namespace: str | None, name: str | None,
                         memo: kopf.Memo, **_: Any) -> None:
    replicas = (body.get("spec") or {}).get("replicas")
    job = await memo["ctx"].kube.get_job(namespace or body["metadata"]["namespace"],
                                         name or body["metadata"]["name"])
    if job is None or not isinstance(replicas, int):
        return  # nothing to judge against; the apiserver reports the missing object itself
    try:
        admission.review_scale(job, replicas)
    except admission.Rejected as exc:
        raise kopf.AdmissionError(str(exc), code=422) from exc
