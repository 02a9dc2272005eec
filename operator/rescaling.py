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
Suspended. While Rescaling, the `Rescaling` condition's reason is the step:
CheckpointRequested -> WaitingForCheckpoint -> RemovingOldWorld -> StartingNewWorld.

Where the next world starts (docs/agreement.md): when a drained world is removed,
its sidecars' reports are read once, and status.resumeStep is the step they all
drained at, or absent (the next world's coordinator then picks the newest
complete checkpoint). It is written in the same patch that moves to
RemovingOldWorld, before any pod is deleted, because deleting the pods deletes
the reports; every pod of the next world gets it as SPLITFEED_RESUME_STEP.

Failure policy (like a Kubernetes Job's): a failed world is replaced after an
exponential back-off (status.nextRestartAt, the Rescaling reason BackingOff),
and counts one of spec.maxRestarts; so does every in-place container restart
of the running world (restartPolicy OnFailure, a native sidecar), counted in
status.containerRestarts. A failure while the cluster disrupts the world (a pod
with condition DisruptionTarget, remembered in status.lastDisruption) is not
counted and not delayed. An object the apiserver refuses to create is a
PodCreationFailed condition retried after the same back-off
(status.podCreation, written by `creation_failed`), and the job fails when the
refusal is a 422 (the pod is invalid). Only objects whose controller is this
job (its UID) are looked at, deleted or replaced. A world whose pods have not
all been running for the operator's stall timeout is marked Stalled.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from splitfeed.trainer_client import specs

from . import admission, conditions, planning, redaction

PENDING, RUNNING, RESCALING, SUSPENDED, SUCCEEDED, FAILED = (
    "Pending", "Running", "Rescaling", "Suspended", "Succeeded", "Failed",
)
CHECKPOINT_REQUESTED = "CheckpointRequested"
WAITING_FOR_CHECKPOINT = "WaitingForCheckpoint"
REMOVING_OLD_WORLD = "RemovingOldWorld"
STARTING_NEW_WORLD = "StartingNewWorld"
POLL_S = 2.0
"""How soon to look again while a step waits on pods."""
REPORT_GRACE_S = 15.0
"""How long a pod whose trainer exited non-zero may wait for its still-running sidecar's report.

A sidecar that hits a data error tells the trainer first (which then exits) and writes its
termination report a moment later (sidecar FAILURE_LINGER_S, then exit). Judging the pod in
between would restart the world for an error that restarting cannot fix.
"""


@dataclasses.dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str

    def __post_init__(self) -> None:
        # Events are read by anyone who may list them: never a URI's credentials.
        object.__setattr__(self, "message", redaction.redact_text(self.message))


@dataclasses.dataclass
class Decision:
    """One step. Apply in this order: status, create, annotate, delete."""

    step: str
    status: dict[str, Any] = dataclasses.field(default_factory=dict)
    """A JSON merge patch for the status subresource (None values delete keys)."""
    create: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Objects to create; one that exists already counts as created (a ConfigMap is replaced)."""
    annotate: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    delete: list[str] = dataclasses.field(default_factory=list)
    """Pod names, deleted if they still exist."""
    events: list[Event] = dataclasses.field(default_factory=list)
    requeue_s: float | None = None
    """Look again after this long (the step waits on pods or a deadline); None: nothing pending."""
    permanent_error: str | None = None
    """The spec can never run as it is; the handler raises kopf.PermanentError."""
    notify: tuple[str, str, str] | None = None
    """(coordinator address, token, reason): also send the drain straight to the world's
    coordinator (worlds.request_drain), after the annotations; best effort, it may be lost."""


def _phase(p: Mapping[str, Any]) -> str:
    return str((p.get("status") or {}).get("phase") or "Pending")


def _epoch(p: Mapping[str, Any]) -> int | None:
    try:
        return int(((p.get("metadata") or {}).get("labels") or {})[planning.LABEL_EPOCH])
    except (KeyError, ValueError, TypeError):
        return None


def _name(p: Mapping[str, Any]) -> str:
    return str((p.get("metadata") or {}).get("name"))


def _failed(p: Mapping[str, Any]) -> bool:
    """Failed, or (restartPolicy Never) a regular container has exited non-zero.

    With --sidecar-mode container a dead trainer leaves its sidecar waiting for a
    reconnect that never comes, and the pod Running forever; nothing will restart
    that container, so the pod has failed (docs/pod-contract.md).
    """
    if _phase(p) == FAILED:
        return True
    if ((p.get("spec") or {}).get("restartPolicy") or "Always") != "Never":
        return False
    return any((((cs.get("state") or {}).get("terminated") or {}).get("exitCode") or 0) != 0
               for cs in (p.get("status") or {}).get("containerStatuses") or [])


def _report_pending(p: Mapping[str, Any], now: datetime.datetime) -> bool:
    """A trainer exited non-zero under REPORT_GRACE_S ago and the sidecar has not yet exited."""
    if _phase(p) == FAILED:
        return False
    status = p.get("status") or {}
    sidecar_running = any(
        cs.get("name") == planning.SIDECAR_NAME and not (cs.get("state") or {}).get("terminated")
        for key in ("initContainerStatuses", "containerStatuses") for cs in status.get(key) or [])
    if not sidecar_running:
        return False
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if (term.get("exitCode") or 0) != 0 and term.get("finishedAt"):
            age = (now - conditions.parse_timestamp(term["finishedAt"])).total_seconds()
            if age < REPORT_GRACE_S:
                return True
    return False


def _terminated(p: Mapping[str, Any]) -> bool:
    return _phase(p) in (SUCCEEDED, FAILED) or _failed(p)


def _deleting(p: Mapping[str, Any]) -> bool:
    return bool((p.get("metadata") or {}).get("deletionTimestamp"))


def is_terminal(status: Mapping[str, Any]) -> bool:
    """Succeeded, or Failed for a reason other than an invalid spec (which a fix revives)."""
    phase = status.get("phase")
    conds = status.get("conditions") or []
    return phase == SUCCEEDED or (phase == FAILED and conditions.is_true(conds, conditions.VALIDATED))


class _Ctx:
    """The inputs of one decision plus the status being built."""

    def __init__(self, job: specs.JobSpec, status: Mapping[str, Any], pods: Sequence[Mapping[str, Any]],
                 owner: planning.Owner, settings: planning.Settings, now: datetime.datetime,
                 generation: int | None) -> None:
        self.job, self.status, self.owner, self.settings, self.now = job, status, owner, settings, now
        self.generation = generation
        self.epoch: int | None = status.get("worldEpoch")
        self.pods = list(pods)
        self.world = [p for p in pods if self.epoch is not None and _epoch(p) == self.epoch]
        self.stale = [p for p in pods if p not in self.world]
        self.conds: list[dict[str, Any]] = [dict(c) for c in status.get("conditions") or []]
        self.patch: dict[str, Any] = {}
        self.events: list[Event] = []

    @property
    def table_version(self) -> int | None:
        """The table version the job pinned (status.data.tableVersion), for the next world's pods."""
        data = self.patch.get("data") or self.status.get("data") or {}
        version = data.get("tableVersion")
        return version if isinstance(version, int) else None

    @property
    def resume_step(self) -> int | None:
        """status.resumeStep as this decision leaves it (the patch's None clears it)."""
        value = self.patch["resumeStep"] if "resumeStep" in self.patch else self.status.get("resumeStep")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def cond(self, type_: str, ok: bool, reason: str, message: str) -> None:
        self.conds = conditions.set_condition(self.conds, type_, ok, reason, message, self.now,
                                              self.generation)

    def value(self, key: str) -> Any:
        """status[key] as this decision leaves it."""
        return self.patch[key] if key in self.patch else self.status.get(key)

    @property
    def container_restarts(self) -> int:
        return int(self.value("containerRestarts") or 0)

    def restarts_used(self) -> int:
        """What spec.maxRestarts is spent on: world restarts plus in-place container restarts."""
        return int(self.value("restarts") or 0) + self.container_restarts

    def budget(self) -> str:
        used, inplace = self.restarts_used(), self.container_restarts
        return (f"{used}/{self.job.max_restarts} restarts"
                + (f", {inplace} of them in-place container restarts" if inplace else ""))

    def seconds_until(self, key: str, mapping: Mapping[str, Any] | None = None) -> float:
        """Seconds until the timestamp status[key] (or mapping[key]); 0 when absent or past."""
        raw = (mapping if mapping is not None else self.status).get(key)
        if not isinstance(raw, str):
            return 0.0
        try:
            return max(0.0, (conditions.parse_timestamp(raw) - self.now).total_seconds())
        except ValueError:
            return 0.0

    def creation_wait(self) -> float:
        """Seconds before objects may be created again after a refused creation."""
        return self.seconds_until("retryAt", self.status.get("podCreation") or {})

    def decision(self, step: str, **kw: Any) -> Decision:
        patch = {
            "allowedReplicas": admission.allowed_replicas(self.job),
            "selector": planning.selector_string(self.job.name),
            **conditions.progress(self.pods, self.status),
            **self.patch,
            "conditions": self.conds,
        }
        if self.generation is not None:
            patch["observedGeneration"] = self.generation
        changed = {k: v for k, v in patch.items() if self.status.get(k) != v}
        deletes = sorted(set(kw.pop("delete", [])) | {_name(p) for p in self.stale if not _deleting(p)})
        return Decision(step=step, status=changed, events=self.events, delete=deletes, **kw)


def decide(
    job: specs.JobSpec,
    status: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]],
    *,
    owner: planning.Owner,
    settings: planning.Settings,
    now: datetime.datetime,
    generation: int | None = None,
) -> Decision:
    """The next step for `job` (already parsed; its replica count may still be invalid)."""
    # A pod that carries the job's labels but another controller is never touched.
    pods = [p for p in pods if planning.controller_uid(p) == owner.uid]
    c = _Ctx(job, status, pods, owner, settings, now, generation)
    if is_terminal(status):
        live = [_name(p) for p in c.world if not _terminated(p) and not _deleting(p)]
        return c.decision("Finished", delete=live)
    problem = _validate(c)
    drain = _drain_of(c)
    if drain:
        return _drain_step(c, drain, problem)
    if c.epoch is None or status.get("phase") == SUSPENDED:
        return _idle_step(c, problem)
    return _running_step(c, problem)


def _validate(c: _Ctx) -> admission.Rejected | None:
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


def _token(reason: str, epoch: int) -> str:
    return f"{reason.lower()}-w{epoch}"


def _start_world(c: _Ctx, epoch: int, replicas: int, reason: str) -> Decision:
    """Status first (worldEpoch, replicas), then every object of the world."""
    job = dataclasses.replace(c.job, replicas=replicas)
    c.patch.update(worldEpoch=epoch, replicas=replicas, worldSize=job.world_size)
    if c.status.get("nextRestartAt"):
        c.patch["nextRestartAt"] = None
    c.cond(conditions.READY, False, "PodsStarting", f"world {epoch}: creating {replicas} pods")
    start = "the newest complete checkpoint" if c.resume_step is None else f"step {c.resume_step}"
    c.events.append(Event("Normal", STARTING_NEW_WORLD,
                          f"starting world {epoch} with {replicas} replicas ({reason}), resuming at {start}"))
    world = planning.world(job, epoch, c.owner, c.settings, c.resume_step, c.table_version)
    return c.decision(STARTING_NEW_WORLD, create=world,
                      requeue_s=POLL_S)


def _idle_step(c: _Ctx, problem: admission.Rejected | None) -> Decision:
    """No world runs: never started, or suspended."""
    if c.job.suspend:
        c.patch.update(phase=SUSPENDED, replicas=0, worldSize=0)
        c.cond(conditions.READY, False, "Suspended", "spec.suspend is true; no pods run")
        if c.status.get("phase") != SUSPENDED:
            c.events.append(Event("Normal", "Suspended", "suspended: no world runs"))
        return c.decision("Suspended")
    if problem is not None:
        c.patch["phase"] = FAILED if c.epoch is None else SUSPENDED
        c.cond(conditions.READY, False, "InvalidSpec", str(problem))
        return c.decision("Invalid", permanent_error=str(problem))
    epoch = 0 if c.epoch is None else c.epoch + 1
    c.patch["phase"] = RUNNING
    if c.status.get("phase") == SUSPENDED:
        c.cond(conditions.RESCALING, False, "Resumed", f"resumed from suspension in world {epoch}")
    return _start_world(c, epoch, c.job.replicas, "first world" if c.epoch is None else "resumed")


def _running_step(c: _Ctx, problem: admission.Rejected | None) -> Decision:
    job, epoch, replicas = c.job, int(c.epoch or 0), int(c.status.get("replicas") or 0)
    expected = {planning.pod_name(job.name, epoch, r) for r in range(replicas)}
    present = {_name(p) for p in c.world}
    _note_disruption(c)
    over_budget = _count_container_restarts(c)
    if over_budget is not None:
        return over_budget
    drained = [p for p in c.world if conditions.drained(p)]
    failed = [p for p in c.world if _failed(p) and p not in drained]
    started = any(_phase(p) != PENDING for p in c.world)
    # A world that drains itself loses pods on purpose: an evicted pod is removed once it stops.
    lost = sorted(expected - present) if started and not drained else []
    if failed or lost:
        return _world_failed(c, failed, lost)
    if drained:
        return _world_drained(c, drained, sorted(expected))
    if c.world and len(c.world) >= replicas and all(_phase(p) == SUCCEEDED for p in c.world):
        c.patch["phase"] = SUCCEEDED
        c.cond(conditions.COMPLETE, True, "AllPodsSucceeded", f"every pod of world {epoch} succeeded")
        c.cond(conditions.READY, False, "Completed", "the job has finished")
        _clear_stalled(c)
        c.events.append(Event("Normal", "Succeeded", f"all {replicas} pods of world {epoch} succeeded"))
        return c.decision(SUCCEEDED)
    if job.suspend:
        return _request_drain(c, "Suspend", replicas, "spec.suspend is true")
    if job.replicas != replicas and problem is None:
        return _request_drain(c, "Rescale", job.replicas, f"replicas {replicas} -> {job.replicas}")
    # Steady state: make sure the world is whole (objects may be missing after a restart).
    c.patch["phase"] = RUNNING
    running = sum(_phase(p) == RUNNING for p in c.world)
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
            world = planning.world(dataclasses.replace(job, replicas=replicas), epoch, c.owner, c.settings,
                                   c.resume_step, c.table_version)
            create = [o for o in world if o["kind"] != "Pod" or o["metadata"]["name"] not in present]
    elif not expected - present:
        _creation_succeeded(c, epoch)
    return c.decision(RUNNING, create=create, requeue_s=requeue)


def _creation_succeeded(c: _Ctx, epoch: int) -> None:
    if c.status.get("podCreation"):
        c.patch["podCreation"] = None
    if conditions.is_true(c.conds, conditions.POD_CREATION_FAILED):
        c.cond(conditions.POD_CREATION_FAILED, False, "Created", f"every object of world {epoch} exists")


def _pod_detail(p: Mapping[str, Any]) -> str:
    """Why a pod is not running, from what the kubelet and scheduler wrote."""
    status = p.get("status") or {}
    parts = [_phase(p)]
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            parts.append(f"{cond.get('reason') or 'Unschedulable'}: {cond.get('message') or ''}".strip())
    for key in ("initContainerStatuses", "containerStatuses"):
        for cs in status.get(key) or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") and waiting.get("reason") != "PodInitializing":
                parts.append(f"{cs.get('name')} {waiting['reason']}"
                             + (f" ({waiting['message'][:200]})" if waiting.get("message") else ""))
    return f"{_name(p)}: " + ", ".join(parts)


def _check_stalled(c: _Ctx, running: int, replicas: int) -> None:
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
    details = "; ".join(_pod_detail(p) for p in c.world if _phase(p) != RUNNING) or "pods are missing"
    msg = (f"only {running}/{replicas} pods of world {int(c.epoch or 0)} have been running since "
           f"{conditions.timestamp(since)} (stall timeout {c.settings.stall_timeout_s:g}s): {details}")[:4000]
    if not conditions.is_true(c.conds, conditions.STALLED):
        c.events.append(Event("Warning", "Stalled", msg))
    c.cond(conditions.STALLED, True, "PodsNotRunning", msg)


def _clear_stalled(c: _Ctx) -> None:
    if conditions.is_true(c.conds, conditions.STALLED):
        c.cond(conditions.STALLED, False, "Progressing", f"the pods of world {int(c.epoch or 0)} run")


def _note_disruption(c: _Ctx) -> None:
    """Remember, status first, that the cluster is disrupting this world (DisruptionTarget on a pod).

    A disrupted pod is often deleted before it can be seen as failed; the record
    keeps the world failure that follows from counting against spec.maxRestarts.
    """
    epoch = int(c.epoch or 0)
    known = c.status.get("lastDisruption") or {}
    if known.get("worldEpoch") == epoch:
        return
    for p in c.world:
        cond = _disruption(p)
        if cond is not None:
            c.patch["lastDisruption"] = {"worldEpoch": epoch, "pod": _name(p),
                                         "reason": str(cond.get("reason") or "DisruptionTarget"),
                                         "time": conditions.timestamp(c.now)}
            return


def _count_container_restarts(c: _Ctx) -> Decision | None:
    """In-place restarts (restartCount) of the world's containers spend spec.maxRestarts.

    status.observedContainerRestarts holds the world's total already counted, so
    each restart is counted once (the status patch carries the job's
    resourceVersion: two operators cannot both count it). None unless the
    budget is now spent, in which case the job fails.
    """
    epoch = int(c.epoch or 0)
    seen = c.status.get("observedContainerRestarts") or {}
    before = int(seen.get("count") or 0) if seen.get("worldEpoch") == epoch else 0
    counts = {(_name(p), cs.get("name")): int(cs.get("restartCount") or 0)
              for p in c.world for key in ("initContainerStatuses", "containerStatuses")
              for cs in (p.get("status") or {}).get(key) or []}
    total = sum(counts.values())
    if total <= before:
        return None
    delta = total - before
    c.patch["observedContainerRestarts"] = {"worldEpoch": epoch, "count": total}
    c.patch["containerRestarts"] = c.container_restarts + delta
    which = ", ".join(f"{pod}/{name} ({n})" for (pod, name), n in sorted(counts.items()) if n)
    if c.restarts_used() <= c.job.max_restarts:
        c.events.append(Event("Warning", "ContainerRestarted",
                              f"{delta} in-place container restart{'s' if delta > 1 else ''} in world {epoch} "
                              f"(restartCount: {which}); {c.budget()} of spec.maxRestarts"))
        return None
    msg = (f"containers of world {epoch} restarted in place (restartCount: {which}); restart budget spent "
           f"({c.budget()}, spec.maxRestarts)")
    return _fail(c, "RestartLimitExceeded", msg)


def _fail(c: _Ctx, reason: str, msg: str) -> Decision:
    live = [_name(p) for p in c.world if not _terminated(p) and not _deleting(p)]
    c.patch["phase"] = FAILED
    c.cond(conditions.FAILED, True, reason, msg)
    c.cond(conditions.READY, False, "Failed", msg)
    c.events.append(Event("Warning", "Failed" if reason == "RestartLimitExceeded" else reason, msg))
    return c.decision(FAILED, delete=live)


def _world_failed(c: _Ctx, failed: list[Mapping[str, Any]], lost: list[str]) -> Decision:
    """A lost rank stops every rank: restart the whole world, within spec.maxRestarts."""
    epoch, restarts = int(c.epoch or 0), int(c.status.get("restarts") or 0)
    why = "; ".join(
        [f"pod {_name(p)} failed" + (f" ({err})" if (err := conditions.sidecar_error(p)) else "")
         for p in failed] + [f"pod {n} disappeared" for n in lost]
    )
    c.patch["resumeStep"] = None  # no agreed step: the next world's coordinator picks the newest complete one
    data_error = next(((_name(p), err) for p in failed
                       if (err := conditions.sidecar_error(p, permanent_only=True))), None)
    if data_error is not None:
        msg = (f"pod {data_error[0]} failed: {data_error[1]}; the data cannot feed this job, "
               "so restarting the world cannot help")
        return _fail(c, "DataError", msg)
    if not lost and any(_report_pending(p, c.now) for p in failed):
        c.cond(conditions.READY, False, "AwaitingSidecarReport",
               f"{why}; waiting up to {REPORT_GRACE_S:g}s for the sidecar's report before restarting")
        return c.decision("AwaitingSidecarReport", requeue_s=1.0)
    disruption = c.value("lastDisruption") or {}
    if any(_disrupted(p) for p in failed) or disruption.get("worldEpoch") == epoch:
        # Preempted, evicted or shut down by the cluster (DisruptionTarget): not the job's fault,
        # and one lost rank takes its peers down with it, so the whole failure is the disruption's.
        by = next((f"{_name(p)}: {(_disruption(p) or {}).get('reason') or 'DisruptionTarget'}"
                   for p in failed if _disrupted(p)),
                  f"{disruption.get('pod')}: {disruption.get('reason')}")
        return _replace_world(c, "Disrupted", f"{why}; world {epoch} disrupted by the cluster ({by}); "
                              f"restarting the world without counting it ({c.budget()})", "Warning")
    if c.restarts_used() >= c.job.max_restarts:
        return _fail(c, "RestartLimitExceeded", f"{why}; restart budget spent ({c.budget()}, spec.maxRestarts)")
    c.patch["restarts"] = restarts + 1
    delay = c.settings.backoff_s(restarts + 1)
    at = c.now + datetime.timedelta(seconds=delay)
    if delay > 0:
        c.patch["nextRestartAt"] = conditions.timestamp(at)
    msg = (f"{why}; restarting the world (restart {c.restarts_used()} of {c.job.max_restarts}"
           + (f", not before {conditions.timestamp(at)}: back-off {delay:g}s" if delay > 0 else "") + ")")
    return _replace_world(c, "Restart", msg, "Warning")


def _disruption(p: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((x for x in (p.get("status") or {}).get("conditions") or []
                 if x.get("type") == "DisruptionTarget" and x.get("status") == "True"), None)


def _disrupted(p: Mapping[str, Any]) -> bool:
    """The pod carries condition DisruptionTarget=True: preemption, eviction, node shutdown."""
    return _disruption(p) is not None


def _replace_world(c: _Ctx, reason: str, msg: str, type_: Literal["Normal", "Warning"]) -> Decision:
    """Record a drain already past its checkpoint (status first), then delete the whole world."""
    epoch = int(c.epoch or 0)
    c.patch.update(phase=RESCALING, drain={
        "reason": reason, "step": REMOVING_OLD_WORLD, "token": _token(reason, epoch),
        "requestedAt": conditions.timestamp(c.now), "targetReplicas": int(c.status.get("replicas") or 0),
    })
    event = {"Restart": "WorldFailed", "Disrupted": "WorldDisrupted"}.get(reason, "WorldDrained")
    c.cond(conditions.RESCALING, True, REMOVING_OLD_WORLD, msg)
    c.cond(conditions.READY, False, event, msg)
    c.events.append(Event(type_, event, msg))
    every = [_name(p) for p in c.world if not _deleting(p)]
    return c.decision(REMOVING_OLD_WORLD, delete=every, requeue_s=POLL_S)


def _world_drained(c: _Ctx, drained: list[Mapping[str, Any]], expected: list[str]) -> Decision:
    """Pods drained without a drain of ours: the world stopped itself (a pod got SIGTERM).

    Once every pod has stopped (or checkpoint.timeoutSeconds after the first
    one did), the next world starts at the agreed step; no restart is counted.
    """
    epoch = int(c.epoch or 0)
    why = next((str(r["drainReason"]) for p in drained
                if (r := conditions.final_report(p)) and r.get("drainReason")), "unknown")
    pending = [p for p in c.world if not _terminated(p)]
    if pending:
        finished = [conditions.parse_timestamp(r["_finishedAt"]) for p in drained
                    if (r := conditions.final_report(p)) and r.get("_finishedAt")]
        deadline = min(finished) + datetime.timedelta(seconds=c.job.checkpoint.timeout_seconds) \
            if finished else None
        if deadline is None or c.now < deadline:
            c.patch["phase"] = RUNNING
            c.cond(conditions.READY, False, "WorldDraining",
                   f"{len(drained)}/{len(expected)} pods of world {epoch} drained on their own ({why}); "
                   "waiting for the others" + (f" until {conditions.timestamp(deadline)}" if deadline else ""))
            left = (deadline - c.now).total_seconds() if deadline else POLL_S
            return c.decision("WorldDraining", requeue_s=max(0.5, min(POLL_S, left)))
    agreed = conditions.agreement(c.world, expected) if not pending else conditions.Agreement(
        None, None, f"{len(pending)} pods of world {epoch} had not stopped "
                    f"checkpoint.timeoutSeconds={c.job.checkpoint.timeout_seconds} after the first")
    _choose_resume_step(c, agreed)
    return _replace_world(c, "WorldDrained",
                          f"world {epoch} drained itself (reason {why}); replacing it without counting a "
                          f"restart", "Normal")


def _choose_resume_step(c: _Ctx, agreed: conditions.Agreement) -> None:
    """status.resumeStep for the next world, and the event that says where it starts."""
    old, new = int(c.epoch or 0), int(c.epoch or 0) + 1
    c.patch["resumeStep"] = agreed.step
    if agreed.step is not None:
        c.events.append(Event("Normal", "ResumeStepChosen",
                              f"world {old} drained at step {agreed.step} ({agreed.why}); world {new} "
                              f"resumes exactly there (status.resumeStep={agreed.step})"))
    else:
        c.events.append(Event("Warning", "ResumeFromLatest",
                              f"world {old} has no agreed drain step ({agreed.why}); world {new}'s "
                              "coordinator resumes from the newest complete checkpoint"))


def _request_drain(c: _Ctx, reason: str, target: int, why: str) -> Decision:
    epoch, token = int(c.epoch or 0), _token(reason, int(c.epoch or 0))
    c.patch.update(phase=RESCALING, drain={
        "reason": reason, "step": CHECKPOINT_REQUESTED, "token": token,
        "requestedAt": conditions.timestamp(c.now), "targetReplicas": target,
    })
    msg = f"{why}: asked the {len(c.world)} pods of world {epoch} to checkpoint (token {token})"
    c.cond(conditions.RESCALING, True, CHECKPOINT_REQUESTED, msg)
    c.cond(conditions.READY, False, "Draining", msg)
    c.events.append(Event("Normal", CHECKPOINT_REQUESTED, msg))
    return c.decision(CHECKPOINT_REQUESTED, annotate=_annotations(c, token), requeue_s=POLL_S,
                      notify=_notify(c, token, reason))


def _notify(c: _Ctx, token: str, reason: str) -> tuple[str, str, str] | None:
    """The fast path to the world's coordinator, once replica 0's pod has an IP and still runs."""
    first = planning.pod_name(c.job.name, int(c.epoch or 0), 0)
    pod = next((p for p in c.world if _name(p) == first and not _terminated(p)), None)
    ip = (pod.get("status") or {}).get("podIP") if pod is not None else None
    return (planning.coordinator_at(str(ip)), token, reason.lower()) if ip else None


def _annotations(c: _Ctx, token: str) -> dict[str, dict[str, str]]:
    return {
        _name(p): {planning.ANNOTATION_DRAIN: token}
        for p in c.world
        if not _terminated(p) and not _deleting(p)
        and ((p.get("metadata") or {}).get("annotations") or {}).get(planning.ANNOTATION_DRAIN) != token
    }


def _drain_of(c: _Ctx) -> dict[str, Any] | None:
    """status.drain, or its reconstruction from the Rescaling condition.

    The reconstruction keeps a rescale going on a cluster whose CRD schema prunes
    status.drain: the step is the condition's reason, the request time its
    lastTransitionTime (it stays True for the whole drain).
    """
    if c.status.get("drain"):
        return dict(c.status["drain"])
    cond = conditions.get(c.conds, conditions.RESCALING)
    if c.status.get("phase") != RESCALING or not cond or cond.get("status") != "True":
        return None
    reason = "Suspend" if c.job.suspend else "Rescale"
    return {"reason": reason, "step": cond.get("reason"), "token": _token(reason, int(c.epoch or 0)),
            "requestedAt": cond.get("lastTransitionTime") or conditions.timestamp(c.now),
            "targetReplicas": c.job.replicas}


def _drain_step(c: _Ctx, drain: dict[str, Any], problem: admission.Rejected | None) -> Decision:
    epoch, step = int(c.epoch or 0), drain.get("step")
    if step == STARTING_NEW_WORLD:
        return _finish_start(c, drain)
    if not c.world:
        return _after_removal(c, drain, problem)
    deadline = conditions.parse_timestamp(drain["requestedAt"]) + datetime.timedelta(
        seconds=c.job.checkpoint.timeout_seconds)
    done = sum(_terminated(p) for p in c.world)
    timed_out = c.now >= deadline
    if step == REMOVING_OLD_WORLD or done == len(c.world) or timed_out:
        if step != REMOVING_OLD_WORLD:
            if done == len(c.world):
                c.events.append(Event("Normal", "Drained", f"all {done} pods of world {epoch} finished"))
                replicas = int(c.status.get("replicas") or 0)
                expected = [planning.pod_name(c.job.name, epoch, r) for r in range(replicas)]
                _choose_resume_step(c, conditions.agreement(c.world, expected))
            else:
                c.patch["resumeStep"] = None
                c.events.append(Event("Warning", "CheckpointTimeout",
                    f"{done}/{len(c.world)} pods of world {epoch} finished within "
                    f"checkpoint.timeoutSeconds={c.job.checkpoint.timeout_seconds}; removing the world, "
                    "the next one resumes from the newest complete checkpoint (no status.resumeStep)"))
        drain["step"] = REMOVING_OLD_WORLD
        c.patch["drain"] = drain
        c.cond(conditions.RESCALING, True, REMOVING_OLD_WORLD, f"deleting the pods of world {epoch}")
        live = [_name(p) for p in c.world if not _deleting(p)]
        return c.decision(REMOVING_OLD_WORLD, delete=live, requeue_s=POLL_S / 2)
    drain["step"] = WAITING_FOR_CHECKPOINT
    c.patch["drain"] = drain
    c.cond(conditions.RESCALING, True, WAITING_FOR_CHECKPOINT,
           f"{done}/{len(c.world)} pods of world {epoch} have checkpointed and exited; "
           f"giving up at {conditions.timestamp(deadline)}")
    left = (deadline - c.now).total_seconds()
    return c.decision(WAITING_FOR_CHECKPOINT, annotate=_annotations(c, drain["token"]),
                      requeue_s=max(0.5, min(POLL_S, left)),
                      notify=_notify(c, drain["token"], str(drain.get("reason") or "rescale")))


def _after_removal(c: _Ctx, drain: dict[str, Any], problem: admission.Rejected | None) -> Decision:
    """The old world is gone: stop (suspend) or start the next world."""
    epoch = int(c.epoch or 0)
    if drain.get("step") != REMOVING_OLD_WORLD:
        c.patch["resumeStep"] = None  # the pods vanished before their reports were read
    if c.job.suspend:
        c.patch.update(phase=SUSPENDED, replicas=0, worldSize=0, drain=None)
        c.cond(conditions.RESCALING, False, "Suspended", f"world {epoch} drained and removed")
        c.cond(conditions.READY, False, "Suspended", "spec.suspend is true; no pods run")
        c.events.append(Event("Normal", "Suspended", f"world {epoch} drained and removed"))
        return c.decision("Suspended")
    wait = c.seconds_until("nextRestartAt") if drain.get("reason") == "Restart" else 0.0
    if wait > 0:
        at = c.status["nextRestartAt"]
        c.patch["phase"] = RESCALING
        c.cond(conditions.RESCALING, True, "BackingOff",
               f"world {epoch} failed and is removed; world {epoch + 1} starts at {at} "
               f"(back-off after restart {int(c.status.get('restarts') or 0)}, {c.budget()})")
        c.cond(conditions.READY, False, "BackingOff", f"waiting until {at} before starting world {epoch + 1}")
        return c.decision("BackingOff", requeue_s=min(wait, 30.0))
    target = c.job.replicas if problem is None else int(drain.get("targetReplicas") or 0)
    try:
        admission.check_replicas(c.job, target)
    except admission.Rejected:
        target = int(c.status.get("replicas") or drain.get("targetReplicas") or 1)
    drain["step"] = STARTING_NEW_WORLD
    drain["targetReplicas"] = target
    c.patch.update(phase=RESCALING, drain=drain)
    c.cond(conditions.RESCALING, True, STARTING_NEW_WORLD, f"starting world {epoch + 1} with {target} replicas")
    return _start_world(c, epoch + 1, target, drain.get("reason", "Rescale").lower())


def _finish_start(c: _Ctx, drain: dict[str, Any]) -> Decision:
    """The new world's objects were requested: ensure they exist, then say Running."""
    epoch, replicas = int(c.epoch or 0), int(c.status.get("replicas") or 0)
    present = {_name(p) for p in c.world}
    job = dataclasses.replace(c.job, replicas=replicas)
    create = [] if c.creation_wait() > 0 else [
        o for o in planning.world(job, epoch, c.owner, c.settings, c.resume_step, c.table_version)
        if o["kind"] != "Pod" or o["metadata"]["name"] not in present]
    reason = {"Restart": "WorldRestarted", "Disrupted": "WorldRestarted", "Suspend": "Resumed",
              "WorldDrained": "WorldReplaced"}.get(drain.get("reason", ""), "RescaleComplete")
    msg = f"world {epoch} runs {replicas} replicas (worldSize {job.world_size})"
    c.patch.update(phase=RUNNING, drain=None)
    c.cond(conditions.RESCALING, False, reason, msg)
    c.events.append(Event("Normal", reason, msg))
    return c.decision(RUNNING, create=create)


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


@dataclasses.dataclass(frozen=True)
class CreationFailure:
    """The apiserver refused to create one object of the world (kube.create raised)."""

    kind: str
    name: str
    status: int
    """HTTP status; 0 when no answer came (a timeout, a refused connection)."""
    reason: str
    """The API Status reason (Forbidden, Invalid, ...), or NotOwned: an object of that name
    exists and its controller is not this job."""
    message: str


def _reason_word(reason: str, status: int) -> str:
    word = "".join(ch for ch in reason if ch.isalnum())
    return word if word[:1].isalpha() else (f"HTTP{status}" if status else "NoAnswer")


def creation_failed(
    job: specs.JobSpec,
    status: Mapping[str, Any],
    failure: CreationFailure,
    *,
    settings: planning.Settings,
    now: datetime.datetime,
    generation: int | None = None,
) -> Decision:
    """What a refused creation does to the status (written by the caller; nothing is created).

    A 422 means the object can never be created as built (for a pod: the template
    is invalid for this cluster): the job fails. Anything else (quota, a webhook
    or policy refusing it, a same-named object another controller owns, the
    apiserver unreachable) is condition PodCreationFailed with the API's message,
    and `decide` creates nothing until status.podCreation.retryAt (the restart
    back-off, doubled per failed attempt).
    """
    c = _Ctx(job, status, [], planning.Owner(job.name, ""), settings, now, generation)
    what = f"{failure.kind} {job.namespace}/{failure.name}"
    epoch = int(c.epoch or 0)
    if failure.status == 422:
        msg = (f"the apiserver refuses {what} of world {epoch} as invalid: {failure.message}"
               + ("; fix spec.trainer.template (a new StreamingJob can resume this one's checkpoints "
                  "with spec.checkpoint.resumeFrom)" if failure.kind == "Pod" else ""))
        c.cond(conditions.POD_CREATION_FAILED, True, "Invalid", msg)
        return _fail(c, "InvalidPodTemplate" if failure.kind == "Pod" else "InvalidObject", msg)
    failures = int((status.get("podCreation") or {}).get("failures") or 0) + 1
    delay = settings.backoff_s(failures)
    at = conditions.timestamp(now + datetime.timedelta(seconds=delay))
    reason = _reason_word(failure.reason, failure.status)
    if reason == "NotOwned":
        msg = (f"{what} exists and is not controlled by this StreamingJob ({failure.message}): splitfeed never "
               "overwrites, adopts or deletes it; delete or rename it, or give the job another name")
    else:
        msg = f"could not create {what} for world {epoch}: {reason}: {failure.message}"
    msg += f"; retrying at {at} (attempt {failures + 1}, back-off {delay:g}s)"
    c.patch["podCreation"] = {"failures": failures, "retryAt": at, "reason": reason, "object": what}
    c.cond(conditions.POD_CREATION_FAILED, True, reason, msg)
    c.cond(conditions.READY, False, "PodCreationFailed", msg)
    c.events.append(Event("Warning", "PodCreationFailed", msg))
    return c.decision("PodCreationFailed", requeue_s=min(max(delay, 0.5), 30.0))
