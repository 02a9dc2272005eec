"""Drains: rescale, suspend, and a world that drains itself; and where the next world starts.

Pure; one policy of the life cycle (`lifecycle.decide` chooses it while
status.drain is set, or when a running world must change). While Rescaling, the
`Rescaling` condition's reason is the step:
CheckpointRequested -> WaitingForCheckpoint -> RemovingOldWorld -> StartingNewWorld.

Where the next world starts (docs/agreement.md): when a drained world is removed,
its sidecars' reports are read once, and status.resumeStep is the step they all
drained at, or absent (the next world's coordinator then picks the newest
complete checkpoint). It is written in the same patch that moves to
RemovingOldWorld, before any pod is deleted, because deleting the pods deletes
the reports; every pod of the next world gets it as SPLITFEED_RESUME_STEP.
"""

from __future__ import annotations

from splitfeed.trainer_client.contract import wellknown

import dataclasses
import datetime
from typing import Literal

from ..objects import admission, conditions, planning, views
from .decisions import (
    CHECKPOINT_REQUESTED,
    POLL_S,
    REMOVING_OLD_WORLD,
    RESCALING,
    RUNNING,
    STARTING_NEW_WORLD,
    SUCCEEDED,
    SUSPENDED,
    WAITING_FOR_CHECKPOINT,
    Ctx,
    Decision,
    Event,
    start_world,
    token,
)


SIDECAR_LOST = "DrainSurvivedLostSidecar"
"""The event of a drain whose member pod lost its sidecar (exited, not restarted) after the
world agreed on its step, and whose trainers still committed that step (issue 21)."""

NOT_IN_PLACE = {"inPlace": None, "askedAt": None}
"""Merged into a status.drain patch that replaces a change in place (a merge patch keeps keys it omits)."""


def replace_world(c: Ctx, reason: str, msg: str, type_: Literal["Normal", "Warning"]) -> Decision:
    """Record a drain already past its checkpoint (status first), then delete the whole world."""
    epoch = c.world_epoch
    c.patch.update(phase=RESCALING, drain={
        "reason": reason, "step": REMOVING_OLD_WORLD, "token": token(reason, epoch),
        "requestedAt": conditions.timestamp(c.now), "targetReplicas": c.found.replicas,
        **NOT_IN_PLACE,
    })
    event = {"Restart": "WorldFailed", "Disrupted": "WorldDisrupted"}.get(reason, "WorldDrained")
    c.cond(conditions.RESCALING, True, REMOVING_OLD_WORLD, msg)
    c.cond(conditions.READY, False, event, msg)
    c.events.append(Event(type_, event, msg))
    every = [p.name for p in c.world if not p.deleting]
    return c.decision(REMOVING_OLD_WORLD, delete=every, requeue_s=POLL_S)


def world_drained(c: Ctx, drained: list[views.Pod], expected: list[str]) -> Decision:
    """Pods drained without a drain of ours: the world stopped itself (a pod got SIGTERM).

    Once every pod has stopped (or checkpoint.timeoutSeconds after the first
    one did), the next world starts at the agreed step; no restart is counted.
    """
    epoch = c.world_epoch
    why = next((r.drain_reason for p in drained if (r := p.final_report) and r.drain_reason), "unknown")
    pending = [p for p in c.world if not p.terminated]
    if pending:
        finished = [conditions.parse_timestamp(r.finished_at) for p in drained
                    if (r := p.final_report) and r.finished_at]
        deadline = min(finished) + datetime.timedelta(seconds=c.job.checkpoint.timeout_seconds) \
            if finished else None
        if deadline is None or c.now < deadline:
            c.patch["phase"] = RUNNING
            c.cond(conditions.READY, False, "WorldDraining",
                   f"{len(drained)}/{len(expected)} pods of world {epoch} drained on their own ({why}); "
                   "waiting for the others" + (f" until {conditions.timestamp(deadline)}" if deadline else ""))
            left = (deadline - c.now).total_seconds() if deadline else POLL_S
            return c.decision("WorldDraining", requeue_s=max(0.5, min(POLL_S, left)))
    agreed = conditions.agreement(views.final_reports(c.world), expected) if not pending else conditions.Agreement(
        None, None, f"{len(pending)} pods of world {epoch} had not stopped "
                    f"checkpoint.timeoutSeconds={c.job.checkpoint.timeout_seconds} after the first")
    _choose_resume_step(c, agreed)
    return replace_world(c, "WorldDrained",
                         f"world {epoch} drained itself (reason {why}); replacing it without counting a "
                         f"restart", "Normal")


def _choose_resume_step(c: Ctx, agreed: conditions.Agreement) -> None:
    """status.resumeStep for the next world, and the event that says where it starts."""
    old, new = c.world_epoch, c.world_epoch + 1
    c.patch["resumeStep"] = agreed.step
    if agreed.stood_in:
        c.events.append(Event("Warning", SIDECAR_LOST, (
            f"the sidecar of {', '.join(agreed.stood_in)} died during world {old}'s drain and left no report; "
            f"its trainers reached the agreed step {agreed.step} and committed it through the world's "
            f"coordinator: world {new} resumes exactly there, 0 steps redone")))
    if agreed.step is not None:
        c.events.append(Event("Normal", "ResumeStepChosen",
                              f"world {old} drained at step {agreed.step} ({agreed.why}); world {new} "
                              f"resumes exactly there (status.resumeStep={agreed.step})"))
    else:
        c.events.append(Event("Warning", "ResumeFromLatest",
                              f"world {old} has no agreed drain step ({agreed.why}); world {new}'s "
                              "coordinator resumes from the newest complete checkpoint"))


def request_drain(c: Ctx, reason: str, target: int, why: str) -> Decision:
    epoch = c.world_epoch
    drain_token = token(reason, epoch)
    c.patch.update(phase=RESCALING, drain={
        "reason": reason, "step": CHECKPOINT_REQUESTED, "token": drain_token,
        "requestedAt": conditions.timestamp(c.now), "targetReplicas": target,
    })
    msg = f"{why}: asked the {len(c.world)} pods of world {epoch} to checkpoint (token {drain_token})"
    c.cond(conditions.RESCALING, True, CHECKPOINT_REQUESTED, msg)
    c.cond(conditions.READY, False, "Draining", msg)
    c.events.append(Event("Normal", CHECKPOINT_REQUESTED, msg))
    return c.decision(CHECKPOINT_REQUESTED, annotate=_annotations(c, drain_token), requeue_s=POLL_S,
                      notify=notify(c, drain_token, reason))


def notify(c: Ctx, drain_token: str, reason: str) -> tuple[str, str, str] | None:
    """The fast path to the world's coordinator, once replica 0's pod has an IP and still runs."""
    first = planning.pod_name_of(c.job, c.world_epoch, 0)
    pod = next((p for p in c.world if p.name == first and not p.terminated), None)
    ip = pod.pod_ip if pod is not None else None
    world = planning.world_layout(c.job, c.world_epoch)
    return (world.coordinator_at(str(ip)), drain_token, reason.lower()) if ip else None


def _annotations(c: Ctx, drain_token: str) -> dict[str, dict[str, str]]:
    return {p.name: {wellknown.ANNOTATION_DRAIN: drain_token}
            for p in c.world if p.live and p.drain_token != drain_token}


def drain_of(c: Ctx) -> views.Drain | None:
    """status.drain (parsed with the status), or its reconstruction from the Rescaling condition.

    The reconstruction keeps a rescale going on a cluster whose CRD schema prunes
    status.drain: the step is the condition's reason, the request time its
    lastTransitionTime (it stays True for the whole drain).
    """
    if c.found.drain is not None:
        return c.found.drain
    cond = conditions.get(c.conds, conditions.RESCALING)
    if c.found.phase != RESCALING or not cond or cond.get("status") != "True":
        return None
    reason = "Suspend" if c.job.suspend else "Rescale"
    return views.Drain(reason=reason, step=cond.get("reason"), token=token(reason, c.world_epoch),
                       requested_at=views.parse_time(cond.get("lastTransitionTime")) or c.now,
                       target_replicas=c.job.replicas)


def requested_at(c: Ctx, drain: views.Drain) -> datetime.datetime:
    """When the drain was asked for; now for one whose status lost it (the next write keeps it)."""
    return drain.requested_at or c.now


def drain_step(c: Ctx, drain: views.Drain, problem: admission.Rejected | None) -> Decision:
    epoch, step = c.world_epoch, drain.step
    if step == STARTING_NEW_WORLD:
        return _finish_start(c, drain)
    if not c.world:
        if c.job.in_place and c.stale:  # pods are named by replica: the next world's must not meet them
            c.cond(conditions.RESCALING, True, REMOVING_OLD_WORLD,
                   f"waiting for {len(c.stale)} pods of earlier worlds to be gone")
            return c.decision(REMOVING_OLD_WORLD, requeue_s=POLL_S / 2)
        return _after_removal(c, drain, problem)
    if step != REMOVING_OLD_WORLD and finished_first(c):
        return _job_finished(c, drain)
    requested = requested_at(c, drain)
    drain = dataclasses.replace(drain, requested_at=requested)  # written back below: a lost time is fixed once
    deadline = requested + datetime.timedelta(seconds=c.job.checkpoint.timeout_seconds)
    done = sum(finished(p) for p in c.world)
    timed_out = c.now >= deadline
    if step == REMOVING_OLD_WORLD or done == len(c.world) or timed_out:
        if step != REMOVING_OLD_WORLD:
            if done == len(c.world):
                c.events.append(Event("Normal", "Drained", f"all {done} pods of world {epoch} finished"))
                expected = [planning.pod_name_of(c.job, epoch, r) for r in range(c.found.replicas)]
                _choose_resume_step(c, conditions.agreement(views.final_reports(c.world), expected))
            else:
                c.patch["resumeStep"] = None
                c.events.append(Event("Warning", "CheckpointTimeout",
                    f"{done}/{len(c.world)} pods of world {epoch} finished within "
                    f"checkpoint.timeoutSeconds={c.job.checkpoint.timeout_seconds}{_unfinished(c)}; removing "
                    "the world, the next one resumes from the newest complete checkpoint (no status.resumeStep)"))
        c.patch["drain"] = dataclasses.replace(drain, step=REMOVING_OLD_WORLD).patch()
        c.cond(conditions.RESCALING, True, REMOVING_OLD_WORLD, f"deleting the pods of world {epoch}")
        live = [p.name for p in c.world if not p.deleting]
        return c.decision(REMOVING_OLD_WORLD, delete=live, requeue_s=POLL_S / 2)
    c.patch["drain"] = dataclasses.replace(drain, step=WAITING_FOR_CHECKPOINT).patch()
    c.cond(conditions.RESCALING, True, WAITING_FOR_CHECKPOINT,
           f"{done}/{len(c.world)} pods of world {epoch} have checkpointed and exited; "
           f"giving up at {conditions.timestamp(deadline)}")
    left = (deadline - c.now).total_seconds()
    return c.decision(WAITING_FOR_CHECKPOINT, annotate=_annotations(c, drain.token),
                      requeue_s=max(0.5, min(POLL_S, left)),
                      notify=notify(c, drain.token, drain.reason or "rescale"))


def _unfinished(c: Ctx) -> str:
    """Which pods had not finished, and whose sidecar had died (its trainers could not commit
    the drain step unless the world's coordinator stood in for them): for the event."""
    waiting = [p for p in c.world if not finished(p)]
    dead = [p.name for p in waiting if any(ct.name == wellknown.SIDECAR_NAME and ct.terminated
                                           for ct in p.containers)]
    names = f" (not finished: {', '.join(p.name for p in waiting)})" if waiting else ""
    return names + (f"; the sidecar of {', '.join(dead)} died during the drain" if dead else "")


def finished(pod: views.Pod) -> bool:
    """The pod's part of a drain is over: it stopped, or it failed and its trainers stopped too.
    A pod whose sidecar died while its trainers run (restartPolicy Never: it has failed) is
    waited for: its trainers may still reach the drain step and commit it through the world's
    coordinator (docs/agreement.md, "A sidecar that cannot restart")."""
    return pod.stopped or (pod.terminated and not any(
        not ct.init and ct.name != wellknown.SIDECAR_NAME and not ct.terminated for ct in pod.containers))


def finished_first(c: Ctx) -> bool:
    """Every pod of the world ran the job to its last step before the drain cut it: the
    request came too late, or the operator that asked died before any pod heard of it.
    Then the job is complete; a next world would train it again from the newest checkpoint."""
    if not c.world or len(c.world) < (c.found.replicas or 0) or not all(p.phase == SUCCEEDED for p in c.world):
        return False
    reports = [r for p in c.world if (r := p.final_report) is not None]
    if len(reports) < len(c.world) or any(r.drained for r in reports):
        return False
    total = max(r.steps_per_epoch or 0 for r in reports) * c.job.data.epochs
    return total > 0 and all((r.global_step or 0) >= total for r in reports)


def _job_finished(c: Ctx, drain: views.Drain) -> Decision:
    epoch, reason = c.world_epoch, (drain.reason or "Rescale").lower()
    return job_finished(c, f"every pod of world {epoch} ran the job to its last step before the {reason} drain cut it")


def job_finished(c: Ctx, msg: str, delete: list[str] | None = None) -> Decision:
    """The job reached its last step while a drain or change was under way: it is complete."""
    c.patch.update(phase=SUCCEEDED, drain=None)
    c.cond(conditions.RESCALING, False, "JobFinished", msg)
    c.cond(conditions.COMPLETE, True, "AllPodsSucceeded", msg)
    c.cond(conditions.READY, False, "Completed", "the job has finished")
    c.events.append(Event("Normal", "Succeeded", f"{msg}: the job is complete"))
    return c.decision(SUCCEEDED, delete=delete or [])


def _after_removal(c: Ctx, drain: views.Drain, problem: admission.Rejected | None) -> Decision:
    """The old world is gone: stop (suspend) or start the next world."""
    epoch = c.world_epoch
    if drain.step != REMOVING_OLD_WORLD:
        c.patch["resumeStep"] = None  # the pods vanished before their reports were read
    if c.job.suspend:
        c.patch.update(phase=SUSPENDED, replicas=0, worldSize=0, drain=None)
        c.cond(conditions.RESCALING, False, "Suspended", f"world {epoch} drained and removed")
        c.cond(conditions.READY, False, "Suspended", "spec.suspend is true; no pods run")
        c.events.append(Event("Normal", "Suspended", f"world {epoch} drained and removed"))
        return c.decision("Suspended")
    wait = c.seconds_to(c.found.next_restart_at) if drain.reason == "Restart" else 0.0
    if wait > 0:
        at = c.status["nextRestartAt"]  # as written: a time with its zone (found.next_restart_at)
        c.patch["phase"] = RESCALING
        c.cond(conditions.RESCALING, True, "BackingOff",
               f"world {epoch} failed and is removed; world {epoch + 1} starts at {at} "
               f"(back-off after restart {c.found.restarts}, {c.budget()})")
        c.cond(conditions.READY, False, "BackingOff", f"waiting until {at} before starting world {epoch + 1}")
        return c.decision("BackingOff", requeue_s=min(wait, 30.0))
    target = c.job.replicas if problem is None else (drain.target_replicas or 0)
    try:
        admission.check_replicas(c.job, target)
    except admission.Rejected:
        target = c.found.replicas or drain.target_replicas or 1
    c.patch.update(phase=RESCALING,
                   drain=dataclasses.replace(drain, step=STARTING_NEW_WORLD, target_replicas=target).patch())
    c.cond(conditions.RESCALING, True, STARTING_NEW_WORLD, f"starting world {epoch + 1} with {target} replicas")
    return start_world(c, epoch + 1, target, (drain.reason or "Rescale").lower())


def _finish_start(c: Ctx, drain: views.Drain) -> Decision:
    """The new world's objects were requested: ensure they exist, then say Running."""
    epoch, replicas = c.world_epoch, c.found.replicas
    present = {p.name for p in c.world}
    create = [] if c.creation_wait() > 0 else [
        o for o in c.world_objects(epoch, replicas)
        if o["kind"] != "Pod" or o["metadata"]["name"] not in present]
    reason = {"Restart": "WorldRestarted", "Disrupted": "WorldRestarted", "Suspend": "Resumed",
              "WorldDrained": "WorldReplaced"}.get(drain.reason or "", "RescaleComplete")
    world_size = dataclasses.replace(c.job, replicas=replicas).world_size
    msg = f"world {epoch} runs {replicas} replicas (worldSize {world_size})"
    c.patch.update(phase=RUNNING, drain=None)
    c.cond(conditions.RESCALING, False, reason, msg)
    c.events.append(Event("Normal", reason, msg))
    return c.decision(RUNNING, create=create)
