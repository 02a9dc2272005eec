"""Kopf handlers for StreamingJobs: decorators that hand over to `reconciling`.

Imported by `commands` (or `kopf run -m splitfeed.operator.cluster.handlers`). The
admission webhooks live in `webhooks`, imported only when a webhook server is
configured, because Kopf refuses to start with admission handlers and no server.
"""

from __future__ import annotations

from splitfeed.trainer_client.contract import wellknown

import logging
from functools import partial
from typing import Any, cast

import kopf

from . import configs, deleting, kube, live, metrics, reconciling
from ..lifecycle import deciding
from ..objects import planning

G, V, P = wellknown.GROUP, wellknown.VERSION, wellknown.PLURAL
TIMER_INTERVAL_S = 3.0
"""Every live job is looked at this often: pod phase changes arrive through it."""
WATCH_CLIENT_MARGIN_S = 30.0
"""Kopf drops a watch connection still open this long after the apiserver should have ended it."""
API_RETRY_S = 5.0
"""A reconcile the API did not answer is tried again this soon (Kopf's default for errors is 60 s)."""


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config: configs.OperatorConfig = memo.get("config") or configs.OperatorConfig()
    prefix = wellknown.GROUP  # Kopf's own annotations and finalizer live under the API group
    settings.persistence.finalizer = f"{prefix}/kopf-finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=prefix)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=prefix, key="last-handled-configuration")
    settings.posting.level = 20  # logging.INFO: our events, not Kopf's debug chatter
    t = config.timeouts
    settings.watching.server_timeout = t.watch_server_s
    settings.watching.client_timeout = t.watch_server_s + WATCH_CLIENT_MARGIN_S
    settings.watching.connect_timeout = t.connect_s
    # A silent stream (half-open: no event, no bookmark) is dropped after this, not after the
    # client timeout above (the apiserver sends a bookmark every minute; a Kopf too old to know
    # the setting ignores it, and the client timeout is the bound).
    settings.watching.inactivity_timeout = t.watch_inactivity_s
    settings.networking.connect_timeout = t.connect_s
    settings.networking.request_timeout = t.connect_s + t.request_s
    if config.webhook is not None:
        w = config.webhook
        # Kopf re-reads the files every file_check_interval and restarts its server with new ones.
        settings.admission.server = kopf.WebhookServer(
            addr=w.addr, port=w.port, host=w.host, certfile=w.certfile, pkeyfile=w.pkeyfile, cafile=w.cafile,
            file_check_interval=w.cert_check_s)
        settings.admission.managed = w.managed
    if "metrics" not in memo:
        memo["metrics"] = metrics.OperatorMetrics()
        if config.metrics_port:
            memo["metrics"].serve(config.metrics_port)
        memo["live"] = live.Poller()
    if "ctx" not in memo:
        memo["ctx"] = reconciling.Context(kube=memo.get("kube") or kube.Kube.connect(
            config.kubeconfig, (config.timeouts.connect_s, config.timeouts.request_s)),
                                          settings=config.planning)


async def _reconcile(memo: kopf.Memo, namespace: str | None, name: str, *, wait: bool) -> None:
    assert namespace is not None  # StreamingJob is a namespaced resource
    try:
        # A rescale quicker than a timer pass is seen only in the reconciler's reads.
        seen = partial(memo["live"].track, (namespace, name)) if "live" in memo else None
        outcome = await reconciling.reconcile(memo["ctx"], namespace, name, seen)
    except kube.KubeError as exc:
        # An unanswered or refused API call is an ordinary event for a controller: one log line
        # and a retry soon. As a plain exception Kopf would log urllib3's whole chained
        # traceback on every attempt and wait its 60 s error back-off.
        if "metrics" in memo:
            memo["metrics"].reconciled(namespace, name, "error", [])
        raise kopf.TemporaryError(f"the Kubernetes API: {exc}", delay=API_RETRY_S) from None
    if "metrics" in memo:
        memo["metrics"].reconciled(namespace, name, "error" if outcome.permanent_error else "ok",
                                   [e.reason for e in outcome.events])
    if outcome.body is not None:
        for e in outcome.events:
            # kopf.event reads only the reference fields, which a plain dict has.
            kopf.event(cast(kopf.Body, outcome.body), type=e.type, reason=e.reason, message=e.message)
    if outcome.permanent_error and wait:
        raise kopf.PermanentError(outcome.permanent_error)
    if wait and outcome.requeue_s is not None:
        raise kopf.TemporaryError(outcome.waiting, delay=outcome.requeue_s)


@kopf.on.resume(G, V, P)
@kopf.on.create(G, V, P)
@kopf.on.update(G, V, P, field="spec")
async def reconcile_on_change(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    await _reconcile(memo, namespace, name, wait=True)


@kopf.on.event(G, V, P)
async def stop_when_deleted(type: str | None, body: kopf.Body, namespace: str | None, name: str,
                            memo: kopf.Memo, **_: Any) -> None:
    """`kubectl delete sj`: its pods are deleted gracefully at once, a preemption that ends each
    world at one agreed step (operator/cluster/deleting.py). Watch events need no finalizer; a failure
    here leaves the pods to the garbage collector."""
    if namespace is None or not deleting.is_deleted(type, body) or "ctx" not in memo:
        return
    ctx: reconciling.Context = memo["ctx"]
    try:
        stop = deleting.pods_to_stop(body, await ctx.kube.list_pods(namespace, name))
        for pod, uid in stop.items():
            await ctx.kube.delete_pod(namespace, pod, uid)
    except kube.KubeError as exc:
        logging.getLogger(__name__).warning("%s/%s: deleted; its pods are left to the garbage collector: %s",
                                            namespace, name, exc)
        return
    if stop:
        logging.getLogger(__name__).info("%s/%s: deleted; stopping its pods %s (each world drains)",
                                         namespace, name, ", ".join(sorted(stop)))


def _live(status: kopf.Status, **_: Any) -> bool:
    return not deciding.is_terminal(status)


@kopf.timer(G, V, P, interval=TIMER_INTERVAL_S, when=_live)
async def reconcile_periodically(namespace: str | None, name: str, memo: kopf.Memo, body: kopf.Body,
                                 **_: Any) -> None:
    await _reconcile(memo, namespace, name, wait=False)
    # `body` is Kopf's last-seen copy: enough to tell whether a poll is due without an API call.
    if "live" in memo and namespace is not None and memo["live"].due((namespace, name), body):
        await _live_status(memo, namespace, name)


async def _live_status(memo: kopf.Memo, namespace: str, name: str) -> None:
    """status.progress and status.lastRescale of a running world (operator/cluster/live.py); never fails the timer."""
    ctx: reconciling.Context = memo["ctx"]
    try:
        async with ctx.lock(namespace, name):
            patch, events = await memo["live"].poll(ctx.kube, namespace, name)
    except (kube.KubeError, KeyError, TypeError, ValueError) as exc:  # the API, or an answer we cannot read
        logging.getLogger(__name__).info("%s/%s: live status not written: %s", namespace, name, exc)
        return
    memo["metrics"].rescaled(namespace, name, patch)
    memo["metrics"].redone(namespace, name, memo["live"].take_redone((namespace, name)))
    if events:
        body = await ctx.kube.get_job(namespace, name)
        for e in events if body is not None else []:
            kopf.event(cast(kopf.Body, body), type=e.type, reason=e.reason, message=e.message)


@kopf.on.probe(id="worlds")
def worlds(memo: kopf.Memo, **_: Any) -> int:
    """Liveness detail: how many jobs this operator has a lock for (i.e. has reconciled)."""
    ctx = memo.get("ctx")
    return len(ctx.locks) if ctx else 0
