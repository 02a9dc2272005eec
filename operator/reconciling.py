"""Fetch -> decide -> apply, for one StreamingJob: the glue the handlers call.

Every handler (create, update, resume, timer) ends up here. A per-job lock makes
the handlers, which Kopf may run concurrently for one object, take turns; inside
it the job is re-read from the API, so a decision never rests on a stale body.
The status patch is written before any action, which is what lets `rescaling`
re-derive an interrupted step (see its docstring).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
from typing import Any

from splitfeed.trainer_client import worlds

from . import admission, kube, planning, rescaling

MAX_STEPS = 5
"""Steps taken at once while each one changes something and none waits on pods."""

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Context:
    kube: kube.Kube
    settings: planning.Settings
    locks: dict[tuple[str, str], asyncio.Lock] = dataclasses.field(default_factory=dict)

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())


@dataclasses.dataclass
class Outcome:
    body: dict[str, Any] | None
    """The job as last read (for events); None when it is gone."""
    steps: list[str] = dataclasses.field(default_factory=list)
    events: list[rescaling.Event] = dataclasses.field(default_factory=list)
    requeue_s: float | None = None
    permanent_error: str | None = None

    @property
    def waiting(self) -> str:
        return f"waiting in step {self.steps[-1] if self.steps else '?'}"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _changes(d: rescaling.Decision) -> bool:
    return bool(d.status or d.create or d.annotate or d.delete)


async def reconcile(ctx: Context, namespace: str, name: str) -> Outcome:
    async with ctx.lock(namespace, name):
        outcome = Outcome(body=None)
        for _ in range(MAX_STEPS):
            body = await ctx.kube.get_job(namespace, name)
            outcome.body = body
            if body is None or body["metadata"].get("deletionTimestamp"):
                return outcome  # deletion: the garbage collector removes the world
            decision = await _decide(ctx, body)
            await _apply(ctx, namespace, name, decision)
            outcome.steps.append(decision.step)
            outcome.events += decision.events
            outcome.requeue_s = decision.requeue_s
            outcome.permanent_error = decision.permanent_error
            repeated = len(outcome.steps) > 1 and outcome.steps[-2] == decision.step
            if decision.permanent_error or not _changes(decision) or repeated:
                break
        return outcome


async def _decide(ctx: Context, body: dict[str, Any]) -> rescaling.Decision:
    meta, status = body["metadata"], body.get("status") or {}
    generation = meta.get("generation")
    try:
        job = admission.parse(body, ctx.settings.sidecar_defaults)
    except admission.Rejected as exc:
        return rescaling.rejected(status, exc, now=_now(), generation=generation)
    pods = await ctx.kube.list_pods(meta["namespace"], meta["name"])
    owner = planning.Owner(name=meta["name"], uid=meta["uid"])
    return rescaling.decide(job, status, pods, owner=owner, settings=ctx.settings, now=_now(),
                            generation=generation)


async def _apply(ctx: Context, namespace: str, name: str, d: rescaling.Decision) -> None:
    """Status first, then objects, then the coordinator; each call is idempotent."""
    if d.status:
        await ctx.kube.patch_job_status(namespace, name, d.status)
    for obj in d.create:
        await ctx.kube.create(obj)
    for pod, annotations in d.annotate.items():
        await ctx.kube.annotate_pod(namespace, pod, annotations)
    if d.notify is not None:
        # Blocks up to a second on a socket: a worker thread, so Kopf's loop runs on.
        state = await asyncio.to_thread(worlds.request_drain, *d.notify)
        log.log(logging.INFO if state else logging.DEBUG, "%s/%s: drain request to %s: %s", namespace, name,
                d.notify[0], f"acknowledged ({state})" if state else "no answer (the annotation still asks)")
    for pod in d.delete:
        await ctx.kube.delete_pod(namespace, pod)
    if _changes(d):
        log.info("%s/%s: %s (status %s, +%d, ~%d, -%d)", namespace, name, d.step,
                 sorted(d.status), len(d.create), len(d.annotate), len(d.delete))
