"""Fetch -> decide -> apply, for one StreamingJob: the glue the handlers call.

Every handler (create, update, resume, timer) ends up here. A per-job lock makes
the handlers, which Kopf may run concurrently for one object, take turns; inside
it the job is re-read from the API, so a decision never rests on a stale body.
The status patch is written before any action, which is what lets `lifecycle`
re-derive an interrupted step (see its docstring), and only onto the
resourceVersion the decision was taken on: a decision about a job that changed
meanwhile (another writer, a second operator) is dropped and taken again, so a
counter such as status.restarts can never be bumped twice for one failure. The
decision itself (parsing, planning a world) runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
from collections.abc import Callable
from typing import Any

from splitfeed.trainer_client.contract import errors, messages
from splitfeed.trainer_client.transport import keys, worlds

from ..objects import admission, planning, redaction, views
from . import kube
from ..lifecycle import deciding

MAX_STEPS = 5
"""Steps taken at once while each one changes something and none waits on pods."""
MAX_CONFLICTS = 3
"""Decisions re-taken at once because the job changed under them (HTTP 409)."""

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
    events: list[deciding.Event] = dataclasses.field(default_factory=list)
    requeue_s: float | None = None
    permanent_error: str | None = None

    @property
    def waiting(self) -> str:
        return f"waiting in step {self.steps[-1] if self.steps else '?'}"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _changes(d: deciding.Decision) -> bool:
    return bool(d.status or d.create or d.annotate or d.delete or d.label)


Seen = Callable[[views.Status, datetime.datetime], None]
"""Told of each read of the job's status as it is made (a rescale's timeline, operator/cluster/live.py)."""


async def reconcile(ctx: Context, namespace: str, name: str, seen: Seen | None = None) -> Outcome:
    async with ctx.lock(namespace, name):
        outcome = Outcome(body=None)
        conflicts = 0
        for _ in range(MAX_STEPS + MAX_CONFLICTS):
            body = await ctx.kube.get_job(namespace, name)
            outcome.body = body
            job = views.Job.parse(body) if body is not None else None
            if job is None or job.deleting:
                return outcome  # deletion: the garbage collector removes the world
            if seen is not None:  # at once: a status this pass is about to replace still counts
                seen(job.status, _now())
            decision, uids = await _decide(ctx, job)
            try:
                await _apply(ctx, job, decision, uids)
            except kube.Conflict:
                # The job changed since it was read: nothing was applied. Decide again on what is there now.
                conflicts += 1
                log.info("%s/%s: the job changed under step %s; deciding again", namespace, name, decision.step)
                if conflicts >= MAX_CONFLICTS:
                    outcome.requeue_s = 1.0
                    break
                continue
            except _Refused as refused:
                outcome.steps.append(decision.step)
                outcome.events += decision.events
                decision = await _record_refusal(ctx, namespace, name, refused.failure)
                outcome.steps.append(decision.step)
                outcome.events += decision.events
                outcome.requeue_s = decision.requeue_s
                break
            outcome.steps.append(decision.step)
            outcome.events += decision.events
            outcome.requeue_s = decision.requeue_s
            outcome.permanent_error = decision.permanent_error
            repeated = len(outcome.steps) > 1 and outcome.steps[-2] == decision.step
            if decision.permanent_error or not _changes(decision) or repeated or len(outcome.steps) >= MAX_STEPS:
                break
        return outcome


def _decide_now(settings: planning.Settings, job: views.Job, pods: list[dict[str, Any]],
                now: datetime.datetime, next_world: messages.Status | None = None) -> deciding.Decision:
    """Parse and decide: pure work, run in a worker thread."""
    status, generation = job.status.raw, job.generation
    try:
        spec = admission.parse(job.raw, settings.sidecar_defaults)
    except admission.Rejected as exc:
        return deciding.rejected(status, exc, now=now, generation=generation)
    owner = planning.Owner(name=job.name, uid=job.uid)
    return deciding.decide(spec, status, pods, owner=owner, settings=settings, now=now, generation=generation,
                            next_world=next_world)


async def _decide(ctx: Context, job: views.Job) -> tuple[deciding.Decision, dict[str, str]]:
    """The decision, and the UIDs of the pods it saw (a delete removes exactly those)."""
    pods = await ctx.kube.list_pods(job.namespace, job.name)
    uids = {str(p["metadata"]["name"]): str(p["metadata"].get("uid")) for p in pods
            if (p["metadata"].get("uid"))}
    # A socket and a short wait: a worker thread, like the planning below.
    answer = None
    if _changing_in_place(job):
        keypair = await kube.asking_keys(ctx.kube, job.namespace, job.name, job.uid)
        answer = await asyncio.to_thread(_ask_next_world, job, pods, keypair) if keypair else None
    # Planning a world of many pods is CPU work: never on Kopf's event loop.
    decision = await asyncio.to_thread(_decide_now, ctx.settings, job, pods, _now(), answer)
    return decision, uids


NEXT_WORLD_WAIT_S = 0.3
"""How long a look at a change in place waits for the next world's coordinator (it looks again soon)."""


def _changing_in_place(job: views.Job) -> bool:
    drain = job.status.drain
    return drain is not None and drain.in_place and job.status.world_epoch is not None


def _ask_next_world(job: views.Job, pods: list[dict[str, Any]], keypair: keys.Keypair) -> messages.Status | None:
    """During a change in place: the next world's coordinator's `status` answer, once it serves
    (replica 0's pod, the port of the next world); None otherwise (operator/lifecycle/inplace.py)."""
    epoch = job.status.world_epoch
    if not _changing_in_place(job) or epoch is None:
        return None
    address = planning.coordinator_of(job.name, epoch + 1, pods, in_place=True)
    return worlds.request_status(address, timeout_s=NEXT_WORLD_WAIT_S, keys=keypair) if address else None


class _Refused(errors.SplitfeedError):
    def __init__(self, failure: deciding.CreationFailure) -> None:
        super().__init__(f"{failure.kind} {failure.name}: {failure.reason}")
        self.failure = failure


async def _record_refusal(ctx: Context, namespace: str, name: str,
                          failure: deciding.CreationFailure) -> deciding.Decision:
    """Write what a refused creation means (condition PodCreationFailed, or Failed on a 422)."""
    log.warning("%s/%s: could not create %s %s: %s (HTTP %s)", namespace, name, failure.kind, failure.name,
                redaction.redact_text(failure.message), failure.status)
    body = await ctx.kube.get_job(namespace, name)
    if body is None:
        return deciding.Decision(step="Gone")
    job = views.Job.parse(body)
    try:
        spec = admission.parse(body, ctx.settings.sidecar_defaults)
    except admission.Rejected as exc:
        return deciding.rejected(job.status.raw, exc, now=_now(), generation=job.generation)
    d = deciding.creation_failed(spec, job.status.raw, failure, settings=ctx.settings, now=_now(),
                                  generation=job.generation)
    try:
        await ctx.kube.patch_job_status(namespace, name, d.status, job.resource_version)
    except kube.Conflict:
        log.info("%s/%s: the job changed; the refusal is recorded at the next attempt", namespace, name)
    return d


async def _apply(ctx: Context, job: views.Job, d: deciding.Decision, uids: dict[str, str]) -> None:
    """Status first (only onto the version decided on), then objects, then the coordinator;
    each call is idempotent. Raises kube.Conflict before anything is done, or _Refused."""
    namespace, name = job.namespace, job.name
    if d.status:
        await ctx.kube.patch_job_status(namespace, name, d.status, job.resource_version)
    if any(obj["kind"] == "Pod" for obj in d.create):
        # Its pods mount it (planning.keys_volume): made before the first of them, once per job.
        owner = planning.Owner(name=name, uid=job.uid)
        try:
            await ctx.kube.job_keys(namespace, owner, create=True)
        except kube.KubeError as exc:
            secret = planning.keys_secret_name(name, job.uid)
            raise _Refused(deciding.CreationFailure("Secret", secret, exc.status, exc.reason, exc.message)) from exc
        except errors.UserError as exc:  # a damaged Secret of that name: said, and retried
            secret = planning.keys_secret_name(name, job.uid)
            raise _Refused(deciding.CreationFailure("Secret", secret, 0, "Invalid", str(exc))) from exc
    for obj in d.create:
        try:
            await ctx.kube.create(obj)
        except kube.NotOwned as exc:
            raise _Refused(deciding.CreationFailure(obj["kind"], obj["metadata"]["name"], 409, "NotOwned",
                                                     exc.message)) from exc
        except kube.KubeError as exc:
            raise _Refused(deciding.CreationFailure(obj["kind"], obj["metadata"]["name"], exc.status,
                                                     exc.reason, exc.message)) from exc
    for pod, annotations in d.annotate.items():
        await ctx.kube.annotate_pod(namespace, pod, annotations)
    for pod, labels in d.label.items():
        await ctx.kube.label_pod(namespace, pod, labels)
    if d.notify is not None:
        # Blocks up to a second on a socket: a worker thread, so Kopf's loop runs on.
        keypair = await kube.asking_keys(ctx.kube, job.namespace, job.name, job.uid)
        state = await asyncio.to_thread(worlds.request_drain, *d.notify, replicas=d.notify_replicas,
                                        lost=list(d.notify_lost) or None, keys=keypair) if keypair else None
        log.log(logging.INFO if state else logging.DEBUG, "%s/%s: drain request to %s: %s", namespace, name,
                d.notify[0], f"acknowledged ({state})" if state else "no answer (the annotation still asks)")
    for pod in d.delete:
        await ctx.kube.delete_pod(namespace, pod, uids.get(pod))
    if _changes(d):
        log.info("%s/%s: %s (status %s, +%d, ~%d, -%d)", namespace, name, d.step,
                 sorted(d.status), len(d.create), len(d.annotate), len(d.delete))
