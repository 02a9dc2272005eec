"""Validating admission webhooks: a StreamingJob, and its scale subresource.

`register` adds them to a Kopf registry; `commands` does so only when a webhook
server is configured (Kopf refuses to start with admission handlers but no
server). The rules are `admission`'s, the same ones the reconciler re-checks
before every reshape. An UPDATE is also judged against the old object
(immutable order-defining fields; a scale or suspend needs spec.checkpoint.uri),
and so is a scale: the guard where the CRD's CEL rules are absent.

With a configured server (configs.Webhook) a job is also judged by the
apiserver itself: a pod built from its template is created with dryRun=All, so
the cluster's PodSpec validation (and admission, e.g. PodSecurity) refuses an
invalid template before the job exists (a 422 is a refusal; other errors admit
the job, whose reconcile reports them). Optionally the requester must be
allowed to create pods in the namespace (a SubjectAccessReview).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from splitfeed.trainer_client.contract import wellknown, specs

from ..objects import admission, planning, redaction
from . import kube

log = logging.getLogger(__name__)

G, V, P = wellknown.GROUP, wellknown.VERSION, wellknown.PLURAL


def register(registry: kopf.OperatorRegistry) -> None:
    kopf.on.validate(G, V, P, id="streamingjob", operations=["CREATE", "UPDATE"],
                     registry=registry)(validate_job)
    kopf.on.validate(G, V, P, subresource="scale", id="scale", operations=["UPDATE"],
                     registry=registry)(validate_scale)


async def validate_job(body: kopf.Body, memo: kopf.Memo, old: Any = None, operation: str | None = None,
                       userinfo: Any = None, warnings: list[str] | None = None, **_: Any) -> None:
    # Kopf's own metadata/status patches must pass even for a job admitted before the rules.
    if operation == "UPDATE" and old and old.get("spec") == body.get("spec"):
        return
    defaults = memo["ctx"].settings.sidecar_defaults
    try:
        if operation == "UPDATE" and old:
            job = admission.review_update(old, body, defaults)
        else:
            job = admission.review_job(body, defaults)
    except admission.Rejected as exc:
        raise kopf.AdmissionError(str(exc), code=422) from exc
    if warnings is not None:  # shown by kubectl as "Warning: ..." (Kopf hands the list in)
        warnings.extend(specs.idle_fields(job.data))
    config = memo.get("config")
    hook = getattr(config, "webhook", None)
    if hook is None:
        return
    client: kube.Kube = memo["ctx"].kube
    if hook.check_pod_permission and isinstance(userinfo, dict) and userinfo.get("username"):
        if not await client.may_create_pods(job.namespace, userinfo):
            raise kopf.AdmissionError(
                f"{userinfo.get('username')} may not create pods in namespace {job.namespace}: the operator "
                "creates a StreamingJob's pods on its creator's behalf, so creating or changing one needs "
                "that permission too", code=403)
    if hook.dry_run_pods and (operation != "UPDATE" or _template_changed(old, job, defaults)):
        await _dry_run(client, job, memo["ctx"].settings)


def _template_changed(old: Any, job: specs.JobSpec, defaults: Any) -> bool:
    """spec.trainer differs from the old object's (one that no longer parses counts as changed)."""
    if not old:
        return True
    try:
        return admission.parse(old, defaults).trainer != job.trainer
    except admission.Rejected:
        return True


async def _dry_run(client: kube.Kube, job: Any, settings: planning.Settings) -> None:
    pod = planning.pod(job, 0, 0, planning.Owner(job.name, "dry-run"), settings)
    meta = pod["metadata"]
    meta.pop("ownerReferences", None)  # the job may not exist yet
    meta["generateName"] = f"{meta.pop('name')}-dry-run-"  # never clashes with a running pod
    try:
        await client.dry_run_pod(pod)
    except kube.KubeError as exc:
        if exc.status == 422:
            raise kopf.AdmissionError(
                "rule 'spec.trainer.template makes a valid pod' failed: the apiserver refuses a pod built "
                f"from it: {redaction.redact_text(exc.message)}", code=422) from exc
        log.warning("%s/%s: dry-run of a pod not conclusive (%s); admitted", job.namespace, job.name,
                    redaction.redact_text(str(exc)))


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
