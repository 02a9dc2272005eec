"""A rescale in place (spec.rescale inPlace): the pods that stay keep running; only the world changes.

Pure; one policy of the life cycle (`rescaling.drain_step` hands a drain marked
`inPlace` here). From world e of N replicas to world e+1 of M:

1. `request`: status.drain first (reason Rescale, `inPlace`, target M), then the pods
   of replicas N..M-1 are created for world e+1 while world e still trains (their
   sidecars wait for world e+1's coordinator, their trainers import meanwhile).
2. Once those pods are Ready (their sidecar's readiness probe: every trainer imported
   and said hello), or READY_WAIT_S after the request, world e is asked to drain
   with the count M (the `splitfeed.io/drain` and `splitfeed.io/drain-replicas`
   annotations, and a `drain_request` to its coordinator); `status.drain.askedAt`.
3. Replica 0's sidecar starts world e+1's coordinator on the other port of a pair
   (trainer_client.layout.WorldLayout.next) once every member committed the drain
   step; the operator learns it from that coordinator's `status` answer
   (`Ctx.next_world`, fetched by `reconciling`): its world epoch, its replicas, its
   resume step. Then, in one decision: status (worldEpoch e+1, replicas, resumeStep),
   the kept pods' world label moved on, pods of replicas >= M deleted (they drained
   and ended on their own).

Anything else falls back to what `recreate` does: a pod that fails restarts the whole
world (`restarting.world_failed`, counted against spec.maxRestarts), and no change
within checkpoint.timeoutSeconds (after the new pods' time to start) replaces the
world from the newest complete checkpoint. A second change of spec.replicas during the change
asks again with the new count; the coordinator takes the newest one it was asked for
before the drain step is committed, and the world that results is what the status says.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from splitfeed.trainer_client.contract import wellknown, messages

from ..objects import admission, conditions, planning, views
from . import rescaling, restarting
from .decisions import (
    CHECKPOINT_REQUESTED,
    FAILED,
    POLL_S,
    REMOVING_OLD_WORLD,
    RESCALING,
    RUNNING,
    SUCCEEDED,
    WAITING_FOR_CHECKPOINT,
    Ctx,
    Decision,
    Event,
    token,
)

READY_WAIT_S = 60.0
"""How long a scale-up waits for its new pods to be Ready before it asks the world to drain
anyway (the new world then waits for them at its first step)."""
LOOK_S = 0.5
"""How soon to look again while a change is under way: the operator learns the new world
from its coordinator, so the sooner it looks, the sooner the status says so."""


def changing(drain: views.Drain) -> bool:
    """status.drain is a change in place still under way (not one that fell back to a replacement)."""
    return drain.in_place and drain.step in (CHECKPOINT_REQUESTED, WAITING_FOR_CHECKPOINT)


def request(c: Ctx, target: int) -> Decision:
    """spec.replicas changed: record the change, create the new replicas' pods now."""
    epoch = c.world_epoch
    drain = views.Drain(reason="Rescale", step=CHECKPOINT_REQUESTED, token=token("Rescale", epoch),
                        requested_at=c.now, target_replicas=target, in_place=True)
    c.patch.update(phase=RESCALING)
    msg = (f"replicas {c.found.replicas} -> {target} in place: world {epoch}'s pods of replicas "
           f"0..{min(c.found.replicas, target) - 1} stay and change world at the agreed step")
    c.events.append(Event("Normal", "RescalingInPlace", msg))
    return step(c, drain, None)


def step(c: Ctx, drain: views.Drain, problem: admission.Rejected | None) -> Decision:
    """One look at a change in place: done, failed, timed out, or waiting (and asking)."""
    epoch = c.world_epoch
    target = drain.target_replicas
    if problem is None and not c.job.suspend and c.job.replicas != target:
        target = c.job.replicas  # a second scale during the change: ask for the newest
    elif target is None:
        target = c.found.replicas  # lost, and no valid count to ask for: the world keeps its own
    drain = dataclasses.replace(drain, target_replicas=target, requested_at=rescaling.requested_at(c, drain))
    answer = c.next_world
    if answer is not None and answer.world_epoch == epoch + 1:
        return _changed(c, answer)
    if _finished(c):
        return _finished_decision(c)
    # A member whose sidecar died after the drain was asked is waited for, as a recreate drain
    # waits (rescaling.finished): its trainers may still commit the drain step through the
    # world's coordinator; if they cannot, no next world comes and the deadline below applies.
    failed = [p for p in c.world + c.ahead if p.failed and not (drain.asked_at is not None and _stranded(p))]
    lost = _lost(c, target)
    if failed or lost:  # the world is restarted as a whole (the next world's pods go with it)
        return restarting.world_failed(c, failed, lost)
    requested = rescaling.requested_at(c, drain)
    deadline = requested + datetime.timedelta(seconds=c.job.checkpoint.timeout_seconds + READY_WAIT_S)
    if c.now >= deadline:
        return _abandon(c, drain, f"world {epoch + 1} did not start in place by {conditions.timestamp(deadline)} "
                                  f"(checkpoint.timeoutSeconds={c.job.checkpoint.timeout_seconds} after the "
                                  f"new pods' {READY_WAIT_S:g} s to start)")
    if c.job.suspend and drain.asked_at is None:
        return _suspended_before_asking(c)
    create = _ahead_pods(c, target)
    # Every new replica's own pod (a same-named pod of an earlier world may still be going).
    ready = all(any(p.replica == r and p.phase == RUNNING and p.ready for p in c.ahead)
                for r in range(c.found.replicas, target))
    asking = drain.asked_at is not None or ready or c.now >= requested + datetime.timedelta(seconds=READY_WAIT_S)
    c.patch.update(phase=RESCALING, drain=drain.patch())
    if not asking:
        c.cond(conditions.RESCALING, True, CHECKPOINT_REQUESTED,
               f"starting the pods of replicas {c.found.replicas}..{target - 1} for world {epoch + 1} "
               f"while world {epoch} trains ({sum(p.ready for p in c.ahead)}/"
               f"{max(0, target - c.found.replicas)} ready: their trainers imported)")
        c.cond(conditions.READY, True, "AllPodsRunning", f"world {epoch} trains while its next world starts")
        return c.decision(CHECKPOINT_REQUESTED, create=create, requeue_s=LOOK_S)
    if drain.asked_at is None:
        drain = dataclasses.replace(drain, asked_at=c.now)
        c.events.append(Event("Normal", CHECKPOINT_REQUESTED,
                              f"asked world {epoch} to drain and go on in place with {target} replicas "
                              f"(token {drain.token})"))
    c.patch["drain"] = dataclasses.replace(drain, step=WAITING_FOR_CHECKPOINT).patch()
    c.cond(conditions.RESCALING, True, WAITING_FOR_CHECKPOINT,
           f"world {epoch} drains; world {epoch + 1} follows in place with {target} replicas; "
           f"giving up at {conditions.timestamp(deadline)}")
    c.cond(conditions.READY, False, "Draining", f"world {epoch} drains to change in place")
    return c.decision(WAITING_FOR_CHECKPOINT, create=create, annotate=_annotations(c, drain.token, target),
                      notify=rescaling.notify(c, drain.token, "Rescale"), notify_replicas=target, requeue_s=LOOK_S)


def _suspended_before_asking(c: Ctx) -> Decision:
    """spec.suspend while a scale-up waits for its new pods, before world e was asked to change:
    its coordinator knows of no change, so the change becomes the suspend's drain (one drain; the
    resumed world has the newest spec.replicas) and the pods created ahead go. Waiting on would
    let the world train on, unasked, for up to READY_WAIT_S: to its end, if it is near."""
    ahead = [p.name for p in c.ahead if not p.deleting]
    d = rescaling.request_drain(c, "Suspend", c.found.replicas,
                                f"spec.suspend is true (the change in place to {c.job.replicas} replicas had not "
                                f"asked world {c.world_epoch} yet)")
    status = {**d.status, "drain": {**d.status["drain"], **rescaling.NOT_IN_PLACE}}
    return dataclasses.replace(d, status=status, delete=sorted(set(d.delete) | set(ahead)))


def relabel(c: Ctx) -> dict[str, dict[str, str]]:
    """The kept pods whose world label is behind the world they run (after an operator crash)."""
    return {p.name: {wellknown.LABEL_EPOCH: str(c.world_epoch)} for p in c.world if p.epoch != c.world_epoch}


def _changed(c: Ctx, answer: messages.Status) -> Decision:
    """The next world's coordinator serves: say so, move the kept pods on, delete those that left."""
    old, new = c.world_epoch, c.world_epoch + 1
    replicas, resume = answer.replicas, answer.resume_step
    job = dataclasses.replace(c.job, replicas=replicas)
    kept = [p for p in c.world if p.replica is not None and p.replica < replicas]
    added = [p for p in c.ahead if p.replica is not None and p.replica < replicas]
    gone = [p.name for p in c.world + c.ahead if p not in kept and p not in added and not p.deleting]
    c.patch.update(phase=RUNNING, drain=None, worldEpoch=new, replicas=replicas, worldSize=job.world_size,
                   resumeStep=resume)
    msg = (f"world {old} drained at global step {resume}; world {new} goes on there in place with "
           f"{replicas} replicas ({len(kept)} pods kept, {len(added)} added, {len(gone)} removed)")
    c.cond(conditions.RESCALING, False, "RescaledInPlace", msg)
    c.cond(conditions.READY, True, "AllPodsRunning", f"world {new} runs in place")
    stood_in = stood_in_pods(c, answer)
    # Announced as a recreate drain announces it (rescaling.SIDECAR_LOST), once: this decision
    # moves status.worldEpoch on, so no later look takes it again.
    if stood_in:
        c.events.append(Event("Warning", rescaling.SIDECAR_LOST, (
            f"the sidecar of {', '.join(stood_in)} died during world {old}'s change in place and left no "
            f"report; every member committed the agreed step {resume} (its trainers through the world's "
            f"coordinator): world {new} resumes exactly there, 0 steps redone")))
    c.events.append(Event("Normal", "ResumeStepChosen",
                          f"world {old} drained at step {resume}; world {new} resumes exactly there "
                          f"(status.resumeStep={resume})"))
    c.events.append(Event("Normal", "RescaledInPlace", msg))
    present = {p.name for p in c.pods}
    objects = planning.world(job, new, c.owner, c.settings, resume, c.table_version)
    create = [o for o in objects if o["kind"] != "Pod" or o["metadata"]["name"] not in present]
    label = {p.name: {wellknown.LABEL_EPOCH: str(new)} for p in kept}
    return c.decision(RUNNING, create=create, delete=gone, label=label)


def stood_in_pods(c: Ctx, answer: messages.Status) -> list[str]:
    """The pods of world e whose dead sidecar world e's coordinator stood in for at the drain step:
    those the next world's coordinator names (`stood_in`: it knows, even where the next world
    serves before a pod's status shows the dead sidecar), and those this look sees stranded."""
    named = {planning.pod_name_of(c.job, c.world_epoch, r) for r in answer.stood_in or []
             if isinstance(r, int) and not isinstance(r, bool) and 1 <= r < c.found.replicas}
    return sorted(named | {p.name for p in c.world if _stranded(p)})


def _stranded(p: views.Pod) -> bool:
    """A member's pod whose sidecar (a plain container that cannot restart) died and left no
    report while its trainers did not fail (docs/agreement.md, "A sidecar that cannot restart").
    Not replica 0: its sidecar is the world's coordinator, and the world cannot change without it."""
    if p.phase == FAILED or not p.replica or p.final_report is not None:
        return False
    sidecar = [ct for ct in p.containers if not ct.init and ct.name == wellknown.SIDECAR_NAME]
    others = [ct for ct in p.containers if not ct.init and ct.name != wellknown.SIDECAR_NAME]
    return (any(ct.terminated and ct.exit_code != 0 for ct in sidecar)
            and all(not ct.terminated or ct.exit_code == 0 for ct in others))


def _finished(c: Ctx) -> bool:
    """The job reached its last step during the change: the world ran to the end before it
    drained (the request came late), drained at the last step itself (the agreement cuts at the
    job's end: no next world follows), or the next world ran to the end before the operator saw
    it serve."""
    if not c.world or any(p.phase != SUCCEEDED or p.final_report is None for p in c.world):
        return False
    reports = [p.final_report for p in c.world if p.final_report is not None]
    total = max(r.steps_per_epoch or 0 for r in reports) * c.job.data.epochs
    return total > 0 and all((r.global_step or 0) >= total and not r.error for r in reports)


def _finished_decision(c: Ctx) -> Decision:
    return rescaling.job_finished(c, f"world {c.world_epoch} ran the job to its last step during a change in place",
                                  delete=[p.name for p in c.ahead if not p.stopped and not p.deleting])


def _lost(c: Ctx, target: int) -> list[str]:
    """Pods of the world that vanished while it changes (a leaving pod that ended may go)."""
    present = {p.name for p in c.world}
    return [name for r in range(min(c.found.replicas, target))
            if (name := planning.pod_name_of(c.job, c.world_epoch, r)) not in present]


def _ahead_pods(c: Ctx, target: int) -> list[dict[str, Any]]:
    """The new replicas' pods of the next world that do not exist yet."""
    if target <= c.found.replicas or c.creation_wait() > 0:
        return []
    job = dataclasses.replace(c.job, replicas=target)
    present = {p.name for p in c.pods}
    return [planning.pod(job, c.world_epoch + 1, r, c.owner, c.settings, None, c.table_version)
            for r in range(c.found.replicas, target)
            if planning.pod_name_of(job, c.world_epoch + 1, r) not in present]


def _annotations(c: Ctx, drain_token: str, target: int) -> dict[str, dict[str, str]]:
    want = {wellknown.ANNOTATION_DRAIN: drain_token, wellknown.ANNOTATION_DRAIN_REPLICAS: str(target)}
    return {p.name: want for p in c.world if p.live
            and (p.drain_token, p.drain_replicas) != (drain_token, str(target))}


def _abandon(c: Ctx, drain: views.Drain, why: str) -> Decision:
    """The change in place cannot finish: replace the world as `recreate` would, from the
    newest complete checkpoint (a failure counts against spec.maxRestarts as usual)."""
    epoch = c.world_epoch
    msg = f"{why}; replacing world {epoch} and its next world's pods (from the newest complete checkpoint)"
    c.patch.update(phase=RESCALING, resumeStep=None, drain={
        "reason": "Rescale", "step": REMOVING_OLD_WORLD, "token": drain.token,
        "requestedAt": conditions.timestamp(rescaling.requested_at(c, drain)),
        "targetReplicas": drain.target_replicas, **rescaling.NOT_IN_PLACE})
    c.cond(conditions.RESCALING, True, REMOVING_OLD_WORLD, msg)
    c.cond(conditions.READY, False, "InPlaceFailed", msg)
    c.events.append(Event("Warning", "InPlaceFailed", msg))
    every = [p.name for p in c.world + c.ahead if not p.deleting]
    return c.decision(REMOVING_OLD_WORLD, delete=every, requeue_s=POLL_S / 2)


# -- a member's pod failed: replace it alone (issue 22 item 3) -------------------------------------

REPLACE = "Replace"
"""status.drain.reason while a failed member's pod is replaced in place."""
REPLACING_POD = "ReplacingPod"
"""status.drain.step (and the Rescaling reason) meanwhile."""


def replacing(drain: views.Drain) -> bool:
    """status.drain is a failed member's pod being replaced in place (`replace_failed`)."""
    return drain.in_place and drain.reason == REPLACE and drain.step == REPLACING_POD


def replace_failed(c: Ctx, failed: list[views.Pod], lost: list[str]) -> Decision | None:
    """Member pods (replica >= 1) of a world that runs in place failed or vanished: replace them
    alone; None where the whole world is replaced instead (`recreate`, or replica 0's pod, whose
    sidecar is the world's coordinator, among them). The failure is judged as a whole world's
    (restarting.judge: a data error fails the job, a disruption is not counted, the budget), but
    not delayed by the restart back-off: the other pods wait for it.

    Status first (status.drain: reason Replace, the replicas in its token; status.restarts), then
    the failed pods are deleted (stable names: the new pod can only be created once the old one
    is gone) and the world's coordinator is told (`drain_request` with `lost`): world e ends
    without a drain, and its other pods go on in place to world e+1 from the newest complete
    checkpoint; `replace_step` creates the new pods and follows world e+1's coordinator.
    """
    gone = _member_replicas(c, failed, lost) if c.job.in_place else None
    if gone is None:
        return None
    c.patch["resumeStep"] = None  # no agreed step: world e+1's coordinator picks the newest complete one
    verdict = restarting.judge(c, failed, lost)
    if verdict.stop is not None:
        return verdict.stop
    epoch = c.world_epoch
    if verdict.disruption is None:
        c.patch["restarts"] = c.found.restarts + 1
        counted = f"restart {c.restarts_used()} of {c.job.max_restarts}"
    else:
        counted = f"disrupted by the cluster ({verdict.disruption}), not counted: {c.budget()}"
    names = ", ".join(planning.pod_name_of(c.job, epoch, r) for r in gone)
    msg = (f"{verdict.why}; replacing {names} alone: the other pods of world {epoch} go on in place in "
           f"world {epoch + 1} from the newest complete checkpoint ({counted})")
    c.events.append(Event("Warning", "PodReplacedInPlace", msg))
    drain = views.Drain(reason=REPLACE, step=REPLACING_POD, token=_replace_token(epoch, gone), requested_at=c.now,
                        target_replicas=c.found.replicas, in_place=True)
    return _replacing(c, drain, gone, msg)


def replace_step(c: Ctx, drain: views.Drain) -> Decision:
    """One look while failed members' pods are replaced in place: done once world e+1's
    coordinator serves and every new pod exists; a further failure, or no world e+1 within
    checkpoint.timeoutSeconds after the new pods' time to start, replaces the whole world."""
    epoch = c.world_epoch
    gone = _replaced_replicas(drain.token, c.found.replicas)
    requested = rescaling.requested_at(c, drain)
    drain = dataclasses.replace(drain, requested_at=requested)
    fresh = [p for p in c.ahead if p.replica in gone]
    answer = c.next_world
    if answer is not None and answer.world_epoch == epoch + 1 and len(fresh) == len(gone):
        return _replaced(c, answer, gone)
    present = {p.name for p in c.world}
    failed = [p for p in c.world if p.failed and p.replica not in gone] + [p for p in c.ahead if p.failed]
    lost = [n for r in range(c.found.replicas)
            if r not in gone and (n := planning.pod_name_of(c.job, epoch, r)) not in present]
    if failed or lost:  # another pod: the world is restarted as a whole (the new pods go with it)
        return restarting.world_failed(c, failed, lost)
    deadline = requested + datetime.timedelta(seconds=c.job.checkpoint.timeout_seconds + READY_WAIT_S)
    if c.now >= deadline:
        return _abandon(c, drain, f"world {epoch + 1} did not start in place by {conditions.timestamp(deadline)} "
                                  f"after pods of world {epoch} failed")
    return _replacing(c, drain, gone, None)


def _replacing(c: Ctx, drain: views.Drain, gone: list[int], msg: str | None) -> Decision:
    """Delete the failed pods, create their successors once they are gone, and tell world e's
    coordinator (again: it may have missed it; it deduplicates by token)."""
    epoch = c.world_epoch
    job = dataclasses.replace(c.job, replicas=c.found.replicas)
    present = {p.name for p in c.pods}
    create = [planning.pod(job, epoch + 1, r, c.owner, c.settings, None, c.table_version) for r in gone
              if planning.pod_name_of(job, epoch + 1, r) not in present] if c.creation_wait() <= 0 else []
    delete = [p.name for p in c.world if p.replica in gone and not p.deleting]
    c.patch.update(phase=RESCALING, drain=drain.patch())
    msg = msg or (f"replacing the pods of replicas {gone} of world {epoch} alone; world {epoch + 1} follows in "
                  f"place from the newest complete checkpoint")
    c.cond(conditions.RESCALING, True, REPLACING_POD, msg)
    c.cond(conditions.READY, False, REPLACING_POD, msg)
    return c.decision(REPLACING_POD, create=create, delete=delete, notify=rescaling.notify(c, drain.token, REPLACE),
                      notify_replicas=c.found.replicas, notify_lost=tuple(gone), requeue_s=LOOK_S)


def _replaced(c: Ctx, answer: messages.Status, gone: list[int]) -> Decision:
    """World e+1's coordinator serves and the new pods exist: say so, move the kept pods on."""
    old, new = c.world_epoch, c.world_epoch + 1
    job = dataclasses.replace(c.job, replicas=c.found.replicas)
    kept = [p for p in c.world if p.replica not in gone and not p.deleting]
    c.patch.update(phase=RUNNING, drain=None, worldEpoch=new, resumeStep=None)
    msg = (f"world {new} goes on in place from global step {answer.resume_step} (the newest complete "
           f"checkpoint) with {len(kept)} pods of world {old} kept and replicas {gone} replaced")
    c.cond(conditions.RESCALING, False, "PodReplacedInPlace", msg)
    c.cond(conditions.READY, True, "AllPodsRunning", f"world {new} runs in place")
    c.events.append(Event("Normal", "WorldResumedInPlace", msg))
    present = {p.name for p in c.pods}
    objects = planning.world(job, new, c.owner, c.settings, None, c.table_version)
    create = [o for o in objects if o["kind"] != "Pod" or o["metadata"]["name"] not in present]
    return c.decision(RUNNING, create=create, label={p.name: {wellknown.LABEL_EPOCH: str(new)} for p in kept})


def _member_replicas(c: Ctx, failed: list[views.Pod], lost: list[str]) -> list[int] | None:
    """The replicas of `failed` and `lost` when all are members (>= 1) and replica 0's pod runs
    on; None otherwise (the whole world is replaced)."""
    epoch = c.world_epoch
    by_name = {planning.pod_name_of(c.job, epoch, r): r for r in range(c.found.replicas)}
    replicas = [p.replica for p in failed] + [by_name.get(n) for n in lost]
    first = next((p for p in c.world if p.name == planning.pod_name_of(c.job, epoch, 0)), None)
    if (first is None or first.failed or first.deleting or first.phase != RUNNING
            or any(r is None or r < 1 or r >= c.found.replicas for r in replicas)):
        return None
    return sorted({r for r in replicas if r is not None})


def _replace_token(epoch: int, replicas: list[int]) -> str:
    """`replace-w3-r1.2`: the drain token names the replicas being replaced (status.drain has no
    other field for them)."""
    return f"{token(REPLACE, epoch)}-r{'.'.join(str(r) for r in replicas)}"


def _replaced_replicas(drain_token: str, replicas: int) -> list[int]:
    """The replicas `_replace_token` named (those of this world; none from a damaged token)."""
    _, sep, named = drain_token.rpartition("-r")
    found = {int(r) for r in named.split(".") if r.isdigit()} if sep else set()
    return sorted(r for r in found if 1 <= r < replicas)
