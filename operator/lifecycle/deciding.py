"""The world life cycle as one pure function: what to do next, given what is observed.

`decide(job, status, pods, ...)` looks at the StreamingJob's spec and status and at the
pods that exist now, and returns one step: objects to create, pods to annotate or
delete, a status merge patch, events, and when to look again. It keeps no memory
of its own; everything it needs to resume is in `status` (notably `status.drain`),
and the caller writes the status patch *before* acting. So an operator restarted
at any point re-derives the same step (or the next one) and finishes the job:
every action is idempotent (create-or-ignore, delete-if-exists, annotate with a
token derived from the world epoch).

Phases: Pending -> Running -> (Rescaling -> Running)* -> Succeeded | Failed, and
Suspended. This module starts the first world, keeps a running one whole, notices
success, a stall and an invalid spec, and hands over to a policy:
`endings` (trainers that returned before the job's last step),
`rescaling` (drains: rescale, suspend, a world that drains itself; where the next
world starts) and `restarting` (failures, restarts and their budget, refused
creations). Pods and status are parsed once into `views`. Only objects whose
controller is this job (its UID) are looked at, deleted or replaced. A world whose
pods have not all been running for the operator's stall timeout is marked Stalled.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from splitfeed.trainer_client.contract import messages, specs

from ..objects import admission, conditions, planning, views
from . import endings, inplace, rescaling, restarting
from .decisions import (
    FAILED,
    PENDING,
    RUNNING,
    SUCCEEDED,
    SUSPENDED,
    Ctx,
    Decision,
    Event,
    is_terminal,
    start_world,
)
from .restarting import REPORT_GRACE_S, CreationFailure, creation_failed

__all__ = [
    "CreationFailure", "Decision", "Event", "REPORT_GRACE_S", "creation_failed", "decide", "is_terminal",
    "rejected",
]


def decide(
    job: specs.JobSpec,
    status: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]],
    *,
    owner: planning.Owner,
    settings: planning.Settings,
    now: datetime.datetime,
    generation: int | None = None,
    next_world: messages.Status | None = None,
) -> Decision:
    """The next step for `job` (already parsed; its replica count may still be invalid).
    `next_world`: during an in-place change, the next world's coordinator's `status` answer."""
    # A pod that carries the job's labels but another controller is never touched.
    owned = [p for p in views.parse_pods(pods) if p.controller == owner.uid]
    c = Ctx(job, status, owned, owner, settings, now, generation, next_world)
    if is_terminal(status):
        return c.decision("Finished", delete=[p.name for p in c.world if not p.stopped and not p.deleting])
    problem = _validate(c)
    drain = rescaling.drain_of(c)
    if drain is not None and inplace.replacing(drain):  # a failed member's pod, replaced alone
        return inplace.replace_step(c, drain)
    if drain is not None and inplace.changing(drain):
        return inplace.step(c, drain, problem)
    if drain is not None:
        return rescaling.drain_step(c, drain, problem)
    if c.epoch is None or c.found.phase == SUSPENDED:
        return _idle_step(c, problem)
    return _running_step(c, problem)


def _validate(c: Ctx) -> admission.Rejected | None:
    """The Validated condition; a warning event only when its message changes."""
    try:
        admission.check_job(c.job)
        admission.check_replicas(c.job, c.job.replicas)
    except admission.Rejected as exc:
        old = conditions.get(c.conds, conditions.VALIDATED)
        if not old or old.get("message") != str(exc):
            c.events.append(Event("Warning", "InvalidSpec", str(exc)))
        c.cond(conditions.VALIDATED, False, "InvalidSpec", str(exc))
        return exc
    c.cond(conditions.VALIDATED, True, "Valid", "the spec passes every admission rule")
    return None


def _idle_step(c: Ctx, problem: admission.Rejected | None) -> Decision:
    """No world runs: never started, or suspended."""
    if c.job.suspend:
        c.patch.update(phase=SUSPENDED, replicas=0, worldSize=0)
        c.cond(conditions.READY, False, "Suspended", "spec.suspend is true; no pods run")
        if c.found.phase != SUSPENDED:
            c.events.append(Event("Normal", "Suspended", "suspended: no world runs"))
        return c.decision("Suspended")
    if problem is not None:
        c.patch["phase"] = FAILED if c.epoch is None else SUSPENDED
        c.cond(conditions.READY, False, "InvalidSpec", str(problem))
        return c.decision("Invalid", permanent_error=str(problem))
    epoch = 0 if c.epoch is None else c.epoch + 1
    c.patch["phase"] = RUNNING
    if c.found.phase == SUSPENDED:
        c.cond(conditions.RESCALING, False, "Resumed", f"resumed from suspension in world {epoch}")
    return start_world(c, epoch, c.job.replicas, "first world" if c.epoch is None else "resumed")


def _running_step(c: Ctx, problem: admission.Rejected | None) -> Decision:
    job, epoch, replicas = c.job, c.world_epoch, c.found.replicas
    expected = {planning.pod_name_of(job, epoch, r) for r in range(replicas)}
    present = {p.name for p in c.world}
    restarting.note_disruption(c)
    over_budget = restarting.count_container_restarts(c)
    if over_budget is not None:
        return over_budget
    drained = [p for p in c.world if p.drained]
    failed = [p for p in c.world if p.failed and p not in drained]
    started = any(p.phase != PENDING for p in c.world)
    # A world that drains itself loses pods on purpose: an evicted pod is removed once it stops.
    lost = sorted(expected - present) if started and not drained else []
    if failed or lost:
        return (endings.returned_then_failed(c, failed, lost) or inplace.replace_failed(c, failed, lost)
                or restarting.world_failed(c, failed, lost))
    if drained:
        return rescaling.world_drained(c, drained, sorted(expected))
    ended = endings.world_ended(c)  # trainers that returned: an early stop, or a rank without its peers
    if ended is not None:
        return ended
    if c.world and len(c.world) >= replicas and all(p.phase == SUCCEEDED for p in c.world):
        c.patch["phase"] = SUCCEEDED
        c.cond(conditions.COMPLETE, True, "AllPodsSucceeded", f"every pod of world {epoch} succeeded")
        c.cond(conditions.READY, False, "Completed", "the job has finished")
        _clear_stalled(c)
        c.events.append(Event("Normal", "Succeeded", f"all {replicas} pods of world {epoch} succeeded"))
        return c.decision(SUCCEEDED)
    if job.suspend:
        return rescaling.request_drain(c, "Suspend", replicas, "spec.suspend is true")
    if job.replicas != replicas and problem is None:
        if job.in_place:
            return inplace.request(c, job.replicas)
        return rescaling.request_drain(c, "Rescale", job.replicas, f"replicas {replicas} -> {job.replicas}")
    # Steady state: make sure the world is whole (objects may be missing after a restart).
    c.patch["phase"] = RUNNING
    running = sum(p.phase == RUNNING for p in c.world)
    if running == replicas:
        c.cond(conditions.READY, True, "AllPodsRunning", f"{running}/{replicas} pods of world {epoch} running")
        _clear_stalled(c)
    else:
        c.cond(conditions.READY, False, "PodsPending", f"{running}/{replicas} pods of world {epoch} running")
        _check_stalled(c, running, replicas)
    create: list[dict[str, Any]] = []
    requeue: float | None = None
    if not started and expected - present:
        wait = c.creation_wait()
        if wait > 0:
            requeue = wait
        else:
            create = [o for o in c.world_objects(epoch, replicas)
                      if o["kind"] != "Pod" or o["metadata"]["name"] not in present]
    elif not expected - present:
        _creation_succeeded(c, epoch)
    return c.decision(RUNNING, create=create, requeue_s=requeue, label=inplace.relabel(c))


def _creation_succeeded(c: Ctx, epoch: int) -> None:
    if c.found.pod_creation is not None:
        c.patch["podCreation"] = None
    if conditions.is_true(c.conds, conditions.POD_CREATION_FAILED):
        c.cond(conditions.POD_CREATION_FAILED, False, "Created", f"every object of world {epoch} exists")


def _check_stalled(c: Ctx, running: int, replicas: int) -> None:
    """Stalled when the world's pods have not all run for settings.stall_timeout_s.

    The operator has no view of training itself; what it sees is whether the
    world's pods run (the Ready condition's lastTransitionTime is when they last
    stopped all running, or when the world started). Pending pods (unschedulable,
    an image that cannot be pulled, a container in CrashLoopBackOff) are named.
    """
    ready = conditions.get(c.conds, conditions.READY) or {}
    try:
        since = conditions.parse_timestamp(str(ready.get("lastTransitionTime")))
    except ValueError:
        return
    waited = (c.now - since).total_seconds()
    if waited < c.settings.stall_timeout_s:
        return
    details = "; ".join(p.detail() for p in c.world if p.phase != RUNNING) or "pods are missing"
    msg = (f"only {running}/{replicas} pods of world {c.world_epoch} have been running since "
           f"{conditions.timestamp(since)} (stall timeout {c.settings.stall_timeout_s:g}s): {details}")[:4000]
    if not conditions.is_true(c.conds, conditions.STALLED):
        c.events.append(Event("Warning", "Stalled", msg))
    c.cond(conditions.STALLED, True, "PodsNotRunning", msg)


def _clear_stalled(c: Ctx) -> None:
    if conditions.is_true(c.conds, conditions.STALLED):
        c.cond(conditions.STALLED, False, "Progressing", f"the pods of world {c.world_epoch} run")


def rejected(
    status: Mapping[str, Any],
    problem: admission.Rejected,
    *,
    now: datetime.datetime,
    generation: int | None = None,
) -> Decision:
    """A spec that does not even parse: say so; fail it unless a world already runs.

    A running world is left alone (the webhook normally prevents this; without
    it, a bad edit must not kill a training run).
    """
    conds = status.get("conditions") or []
    old = conditions.get(conds, conditions.VALIDATED)
    new = conditions.set_condition(conds, conditions.VALIDATED, False, "InvalidSpec", str(problem), now, generation)
    patch: dict[str, Any] = {"conditions": new}
    if status.get("worldEpoch") is None:
        patch["phase"] = FAILED
    events = [] if old and old.get("message") == str(problem) else [Event("Warning", "InvalidSpec", str(problem))]
    changed = {k: v for k, v in patch.items() if status.get(k) != v}
    return Decision(step="Invalid", status=changed, events=events, permanent_error=str(problem))
