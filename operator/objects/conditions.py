"""metav1.Condition lists and the sidecar reports folded into a StreamingJob's status.

Pure helpers for the life cycle (`lifecycle`, `rescaling`, `restarting`): setting a condition keeps its lastTransitionTime when
its status does not change (so an unchanged world produces an unchanged status
and no patch), and sidecar termination messages (docs/pod-contract.md, "What the
sidecar reports") become status.progress / status.lastCheckpoint, and after a
drain the step the whole world agreed on (status.resumeStep). A termination
message is parsed here, once, into a `wellknown.SidecarReport` (`final_report`,
`sidecar_reports`, which views.Pod calls); every other reader works on those.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from splitfeed.trainer_client.contract import wellknown

from . import redaction

# Condition types on a StreamingJob.
VALIDATED = "Validated"
READY = "Ready"
RESCALING = "Rescaling"
COMPLETE = "Complete"
FAILED = "Failed"
POD_CREATION_FAILED = "PodCreationFailed"
"""An object of the world (a pod, its ConfigMap, Service or budget) could not be created."""
STALLED = "Stalled"
"""The running world's pods have not all been running for the operator's stall timeout."""


def timestamp(now: datetime.datetime) -> str:
    """RFC 3339 in UTC, seconds precision: what metav1.Time serialises to."""
    return now.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_timestamp(value: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


def get(conditions: Sequence[Mapping[str, Any]], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def is_true(conditions: Sequence[Mapping[str, Any]], type_: str) -> bool:
    c = get(conditions, type_)
    return c is not None and c.get("status") == "True"


def set_condition(
    conditions: Sequence[Mapping[str, Any]],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: datetime.datetime,
    generation: int | None = None,
) -> list[dict[str, Any]]:
    """A new list with `type_` set; other conditions and their order are kept."""
    text = "True" if status else "False"
    old = get(conditions, type_)
    since = old.get("lastTransitionTime") if old and old.get("status") == text else None
    new: dict[str, Any] = {
        "type": type_,
        "status": text,
        "reason": reason,
        "message": redaction.redact_text(message)[:32768],
        "lastTransitionTime": since or timestamp(now),
    }
    if generation is not None:
        new["observedGeneration"] = generation
    out = [dict(c) for c in conditions if c.get("type") != type_]
    index = next((i for i, c in enumerate(conditions) if c.get("type") == type_), len(out))
    out.insert(index, new)
    return out


def _sidecar_statuses(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The pod's container statuses of its sidecar (a native sidecar's, or a plain container's)."""
    status = pod.get("status") or {}
    return [cs for key in ("initContainerStatuses", "containerStatuses") for cs in status.get(key) or []
            if cs.get("name") == wellknown.SIDECAR_NAME]


def _report(state: Mapping[str, Any] | None) -> wellknown.SidecarReport | None:
    """The report in a container state's termination message, parsed once, with its `finishedAt`."""
    term = (state or {}).get("terminated") or {}
    message = term.get("message")
    if not isinstance(message, str) or not message:
        return None
    finished = term.get("finishedAt")
    return wellknown.SidecarReport.parse(message, finished_at=finished if isinstance(finished, str) else None)


def sidecar_reports(pod: Mapping[str, Any]) -> list[wellknown.SidecarReport]:
    """The reports of the pod's sidecar runs (current and last state); what is not a report is left out."""
    return [r for cs in _sidecar_statuses(pod) for key in ("state", "lastState")
            if (r := _report(cs.get(key))) is not None]


def final_report(pod: Mapping[str, Any]) -> wellknown.SidecarReport | None:
    """The report of the sidecar's current, terminated run; None while it runs or without one.

    Only `state`, never `lastState`: an earlier run's report says nothing about
    what the sidecar that last served the pod's ranks committed.
    """
    for cs in _sidecar_statuses(pod):
        if (cs.get("state") or {}).get("terminated"):
            return _report(cs.get("state"))
    return None


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What a world's reports say about where the next world may start."""

    step: int | None
    """The agreed step every pod of the world drained at; None: the next world resumes from latest."""
    reason: str | None
    """The drainReason of the first report that has one (every member got it from one commit)."""
    why: str
    """Why `step` is None, or which pods agreed; for events."""
    stood_in: tuple[str, ...] = ()
    """Pods that left no report (their sidecar died) whose ranks committed `step` through the
    world's coordinator (its `completeStep`; docs/agreement.md, "A sidecar that cannot restart")."""


def agreement(finals: Mapping[str, wellknown.SidecarReport | None], expected: Sequence[str]) -> Agreement:
    """The step the world of `expected` pods drained at, if every one of them says the same.

    `finals`: each present pod's final report (views.Pod.final_report) by pod name.
    One pod without a report, not drained, or with another step, and nothing is
    known for sure about its ranks: the next world must not be told an exact
    step that may be incomplete (its sidecars would fail on it), so it resumes
    from the newest complete checkpoint instead. Except pods without a report
    when the world's coordinator counted the step committed by every member
    (`_stood_in`): their sidecar died and their trainers committed through it.
    """
    steps: dict[int, list[str]] = {}
    reasons: list[str] = []
    silent: list[str] = []
    for name in expected:
        if name not in finals:
            return Agreement(None, None, f"pod {name} is gone, its ranks' checkpoint is unknown")
        report = finals[name]
        if report is None:
            silent.append(name)
            continue
        if not report.drained or report.agreed_step is None:
            return Agreement(None, None, f"pod {name} did not drain at an agreed step")
        steps.setdefault(report.agreed_step, []).append(name)
        if report.drain_reason is not None:
            reasons.append(report.drain_reason)
    if not steps:
        return Agreement(None, None, f"pod {silent[0]} left no sidecar report" if silent else "the world had no pods")
    if len(steps) > 1:
        detail = "; ".join(f"step {s}: {', '.join(names)}" for s, names in sorted(steps.items()))
        return Agreement(None, None, f"the pods disagree on the agreed step ({detail})")
    (step,) = steps
    reason = reasons[0] if reasons else None
    if silent:
        return _stood_in(finals, silent, step, reason)
    return Agreement(step, reason, f"all {len(expected)} pods drained at step {step}")


def _stood_in(finals: Mapping[str, wellknown.SidecarReport | None], silent: list[str], step: int,
              reason: str | None) -> Agreement:
    """Every pod that reported drained at `step`; the `silent` ones lost their sidecar. `step` is
    still the world's when its coordinator (replica 0's report, `completeStep`) counted it
    committed by every member: their ranks committed it through the coordinator."""
    names = ", ".join(silent)
    complete = {r.complete_step for r in finals.values() if r is not None and r.complete_step is not None}
    if complete != {step}:
        return Agreement(None, None, f"pods {names} left no sidecar report, and the world's coordinator did not "
                                     f"count step {step} committed by every member")
    return Agreement(step, reason, f"every pod drained at step {step}; the sidecar of {names} died, and its "
                                   "trainers committed the step through the world's coordinator", tuple(silent))


def sidecar_error(reports: Iterable[wellknown.SidecarReport], *, permanent_only: bool = False) -> str | None:
    """The error a pod's sidecar exited with (its `reports`, views.Pod.reports); with `permanent_only`,
    only one that restarting cannot fix (the report's `permanent`, e.g. a missing table)."""
    return next((r.error for r in reports if r.error and (r.permanent or not permanent_only)), None)


def progress(reports: Iterable[wellknown.SidecarReport], status: Mapping[str, Any]) -> dict[str, Any]:
    """status.progress / status.lastCheckpoint updates (only ever forward), and
    status.data.tableVersion once a sidecar reported the version it pinned; or {}.
    `reports`: every report of the job's pods (views.Pod.reports)."""
    out: dict[str, Any] = {}
    old_progress = status.get("progress") or {}
    old_ckpt = status.get("lastCheckpoint") or {}
    best_progress: dict[str, Any] | None = None
    best_ckpt: dict[str, Any] | None = None
    for r in reports:
        if r.global_step is not None and r.global_step > (best_progress or old_progress).get("globalStep", -1):
            best_progress = {"globalStep": r.global_step, "epoch": r.epoch, "step": r.step,
                             "stepsPerEpoch": r.steps_per_epoch}
        pinned = (status.get("data") or {}).get("tableVersion")
        if r.table_version is not None and pinned is None:
            out["data"] = {**(status.get("data") or {}), "tableVersion": r.table_version}
        ck = r.last_checkpoint
        if ck is not None and ck.step > (best_ckpt or old_ckpt).get("step", -1):
            best_ckpt = {"step": ck.step, "epoch": ck.epoch, "worldSize": ck.world_size}
            if r.finished_at:
                best_ckpt["time"] = r.finished_at
    if best_progress:
        out["progress"] = {**old_progress, **{k: v for k, v in best_progress.items() if v is not None}}
    if best_ckpt:
        out["lastCheckpoint"] = {k: v for k, v in best_ckpt.items() if v is not None}
    return out
