"""metav1.Condition lists and the sidecar reports folded into a StreamingJob's status.

Pure helpers for `rescaling`: setting a condition keeps its lastTransitionTime when
its status does not change (so an unchanged world produces an unchanged status
and no patch), and sidecar termination messages (docs/pod-contract.md, "What the
sidecar reports") become status.progress / status.lastCheckpoint.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

from . import planning

# Condition types on a StreamingJob.
VALIDATED = "Validated"
READY = "Ready"
RESCALING = "Rescaling"
COMPLETE = "Complete"
FAILED = "Failed"


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
        "message": message[:32768],
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
            if cs.get("name") != planning.SIDECAR_NAME:
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
    """status.progress / status.lastCheckpoint updates (only ever forward), or {}."""
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
