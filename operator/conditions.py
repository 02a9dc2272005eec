"""metav1.Condition lists and the sidecar reports folded into a StreamingJob's status.

Pure helpers for the life cycle (`lifecycle`, `rescaling`, `restarting`): setting a condition keeps its lastTransitionTime when
its status does not change (so an unchanged world produces an unchanged status
and no patch), and sidecar termination messages (docs/pod-contract.md, "What the
sidecar reports") become status.progress / status.lastCheckpoint, and after a
drain the step the whole world agreed on (status.resumeStep).
"""

from __future__ import annotations

from splitfeed.trainer_client import contract

import dataclasses
import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

from . import planning, redaction

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


def sidecar_reports(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Parsed termination messages of the pod's sidecar (native or plain container)."""
    status = pod.get("status") or {}
    found = []
    for key in ("initContainerStatuses", "containerStatuses"):
        for cs in status.get(key) or []:
            if cs.get("name") != contract.SIDECAR_NAME:
                continue
            for state_key in ("state", "lastState"):
                term = ((cs.get(state_key) or {}).get("terminated")) or {}
                message = term.get("message")
                if not message:
                    continue
                try:
                    report = json.loads(message.strip().splitlines()[-1])
                except (ValueError, IndexError):
                    continue
                if isinstance(report, dict):
                    report["_finishedAt"] = term.get("finishedAt")
                    found.append(report)
    return found


def final_report(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    """The report of the sidecar's current, terminated run; None while it runs or without one.

    Only `state`, never `lastState`: an earlier run's report says nothing about
    what the sidecar that last served the pod's ranks committed.
    """
    status = pod.get("status") or {}
    for key in ("initContainerStatuses", "containerStatuses"):
        for cs in status.get(key) or []:
            if cs.get("name") == contract.SIDECAR_NAME and (cs.get("state") or {}).get("terminated"):
                reports = sidecar_reports({"status": {key: [{**cs, "lastState": {}}]}})
                return reports[0] if reports else None
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


def agreement(pods: Sequence[Mapping[str, Any]], expected: Sequence[str]) -> Agreement:
    """The step the world of `expected` pods drained at, if every one of them says the same.

    One pod without a report, not drained, or with another step, and nothing is
    known for sure about its ranks: the next world must not be told an exact
    step that may be incomplete (its sidecars would fail on it), so it resumes
    from the newest complete checkpoint instead.
    """
    by_name = {str((p.get("metadata") or {}).get("name")): p for p in pods}
    steps: dict[int, list[str]] = {}
    reasons: list[str] = []
    for name in expected:
        pod = by_name.get(name)
        report = final_report(pod) if pod is not None else None
        if pod is None:
            return Agreement(None, None, f"pod {name} is gone, its ranks' checkpoint is unknown")
        if report is None:
            return Agreement(None, None, f"pod {name} left no sidecar report")
        step = report.get("agreedStep")
        if report.get("drained") is not True or not isinstance(step, int) or isinstance(step, bool):
            return Agreement(None, None, f"pod {name} did not drain at an agreed step")
        steps.setdefault(step, []).append(name)
        if isinstance(report.get("drainReason"), str):
            reasons.append(report["drainReason"])
    if not steps:
        return Agreement(None, None, "the world had no pods")
    if len(steps) > 1:
        detail = "; ".join(f"step {s}: {', '.join(names)}" for s, names in sorted(steps.items()))
        return Agreement(None, None, f"the pods disagree on the agreed step ({detail})")
    (step,) = steps
    return Agreement(step, reasons[0] if reasons else None, f"all {len(expected)} pods drained at step {step}")


def sidecar_error(pod: Mapping[str, Any], *, permanent_only: bool = False) -> str | None:
    """The error the pod's sidecar exited with; with `permanent_only`, only one that
    restarting cannot fix (the report's `permanent`, e.g. a missing table)."""
    for report in sidecar_reports(pod):
        if report.get("error") and (report.get("permanent") is True or not permanent_only):
            return str(report["error"])
    return None


def progress(
    pods: Sequence[Mapping[str, Any]], status: Mapping[str, Any]
) -> dict[str, Any]:
    """status.progress / status.lastCheckpoint updates (only ever forward), and
    status.data.tableVersion once a sidecar reported the version it pinned; or {}."""
    out: dict[str, Any] = {}
    old_progress = status.get("progress") or {}
    old_ckpt = status.get("lastCheckpoint") or {}
    best_progress: dict[str, Any] | None = None
    best_ckpt: dict[str, Any] | None = None
    for pod in pods:
        for r in sidecar_reports(pod):
            step = r.get("globalStep")
            if isinstance(step, int) and step > (best_progress or old_progress).get("globalStep", -1):
                best_progress = {"globalStep": step, "epoch": r.get("epoch"), "step": r.get("step"),
                                 "stepsPerEpoch": r.get("stepsPerEpoch")}
            version = r.get("tableVersion")
            pinned = (status.get("data") or {}).get("tableVersion")
            if isinstance(version, int) and not isinstance(version, bool) and pinned is None:
                out["data"] = {**(status.get("data") or {}), "tableVersion": version}
            ck = r.get("lastCheckpoint")
            if isinstance(ck, dict) and isinstance(ck.get("step"), int):
                if ck["step"] > (best_ckpt or old_ckpt).get("step", -1):
                    best_ckpt = {k: ck.get(k) for k in ("step", "epoch", "worldSize")}
                    if r.get("_finishedAt"):
                        best_ckpt["time"] = r["_finishedAt"]
    if best_progress:
        out["progress"] = {**old_progress, **{k: v for k, v in best_progress.items() if v is not None}}
    if best_ckpt:
        out["lastCheckpoint"] = {k: v for k, v in best_ckpt.items() if v is not None}
    return out
