"""A running world's progress: members' counts -> the coordinator's sums -> status.progress.

Pure functions shared by the sidecar (its coordinator sums what members send)
and the operator (it turns the coordinator's `status` answer into the
StreamingJob's `status.progress`), so both read the numbers the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from . import messages, stalls
from .errors import ProtocolError

_SUMMED = ("rows", "rows_per_s", "wait_s", "wall_s")

ROW_COUNTS: dict[str, str] = {"filled_rows": "filledRows", "skipped_rows": "skippedRows"}
"""Per-row outcomes the loaders count (wire field -> status.progress field): summed over
a world's members like _SUMMED, and carried from world to world in status.progress. A new
count (skipped rows, say) is one entry here plus its field in messages.Progress and Status."""
CARRIED = "carried"
"""status.progress.carried: {worldEpoch, <ROW_COUNTS fields>}, the totals of the worlds
before `worldEpoch`, to which that world's live sums are added."""


def checked(message: messages.Progress) -> messages.Progress:
    """A member's `progress` message, its histogram checked (messages.decode checked the rest)."""
    buckets = message.buckets
    if len(buckets) != stalls.NUM_BUCKETS or not all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in buckets):
        raise ProtocolError(f"progress.buckets must be {stalls.NUM_BUCKETS} non-negative integers")
    return message


def world_status(members: Sequence[messages.Progress], *, replicas: int, total_steps: int, resume_step: int,
                 drain_step: int | None, world_epoch: int = -1,
                 stood_in: Sequence[int] = ()) -> messages.Status:
    """The `status` answer: the slowest member's step (synchronous training moves as one), sums of the rest."""
    return messages.Status(
        replicas=replicas,
        reporting=len(members),
        global_step=min((m.global_step for m in members), default=None),
        steps_per_epoch=max((m.steps_per_epoch for m in members), default=0),
        total_steps=total_steps,
        resume_step=resume_step,
        **{k: sum(getattr(m, k) for m in members) for k in _SUMMED},
        **{k: sum(getattr(m, k) for m in members) for k in ROW_COUNTS},
        buckets=stalls.merge([m.buckets for m in members]),
        drain_step=drain_step,
        world_epoch=world_epoch,
        first_batch_at=first_batch_at(members, replicas),
        stood_in=sorted(stood_in) or None,
    )


def first_batch_at(members: Sequence[messages.Progress], replicas: int) -> float | None:
    """When the world's first batch had reached every rank: the last member's time, once
    every replica reported one (a world moves as one, so its slowest member says when)."""
    times = [m.first_batch_at for m in members if m.first_batch_at is not None]
    return float(max(times)) if times and len(times) == len(members) == replicas else None


def _round(value: float | None, digits: int) -> float | None:
    """Short numbers for the status (a printer column shows them as they are)."""
    return None if value is None else round(value, digits)


def row_counts(answer: messages.Status, old: Mapping[str, Any], world_epoch: int) -> dict[str, Any]:
    """The ROW_COUNTS fields of status.progress: world `world_epoch`'s sums plus the totals
    of the worlds before it (`carried`, taken from `old` when the world changes).

    A count only grows within a world (a loader never un-fills a row), so a smaller
    answer (a member not yet heard again) keeps the old total.
    """
    carried = old.get(CARRIED)
    if not isinstance(carried, Mapping) or carried.get("worldEpoch") != world_epoch:
        carried = {"worldEpoch": world_epoch, **{k: int(old.get(k) or 0) for k in ROW_COUNTS.values()}}
    out: dict[str, Any] = {CARRIED: dict(carried)}
    for wire, key in ROW_COUNTS.items():
        out[key] = max(int(old.get(key) or 0), int(carried.get(key) or 0) + int(getattr(answer, wire)))
    return out


def status_progress(answer: messages.Status, old: Mapping[str, Any],
                    world_epoch: int = 0) -> dict[str, Any] | None:
    """status.progress from a coordinator's `status` answer; None when no rank has taken a batch yet.

    globalStep only moves forward (the CRD says so, and a report of a world that
    ended may already be ahead); the row counts add up over the job's worlds.
    """
    step = answer.global_step
    if answer.reporting < (answer.replicas or 1):
        return None  # the slowest member may be the one not heard from yet
    if step is None or step <= answer.resume_step - 1:
        return None
    spe = answer.steps_per_epoch
    step = max(step, int(old.get("globalStep", -1)))
    epoch, in_epoch = divmod(step, spe) if spe > 0 else (0, step)
    summary = stalls.summarize(answer.buckets, float(answer.wait_s), float(answer.wall_s))
    out: dict[str, Any] = {
        "globalStep": step, "epoch": epoch, "step": in_epoch, "stepsPerEpoch": spe,
        "rowsPerSecond": _round(float(answer.rows_per_s), 1),
        "dataStallShare": _round(summary.stall_share, 3),
        "dataReady": {k: v for k, v in (("p50Seconds", _round(summary.p50_s, 6)),
                                        ("p95Seconds", _round(summary.p95_s, 6)),
                                        ("p99Seconds", _round(summary.p99_s, 6))) if v is not None},
    }
    return {**old, **out, **row_counts(answer, old, world_epoch)}
