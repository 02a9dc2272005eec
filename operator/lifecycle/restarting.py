"""Failures: when a world is restarted, when not counted, and when the job fails.

Pure; one policy of the life cycle (`lifecycle.decide` runs it on a running
world). Like a Kubernetes Job's: a failed world is replaced after an exponential
back-off (status.nextRestartAt, the Rescaling reason BackingOff), and counts one
of spec.maxRestarts; so does every in-place container restart of the running
world (restartPolicy OnFailure, a native sidecar), counted in
status.containerRestarts. A failure while the cluster disrupts the world (a pod
with condition DisruptionTarget, remembered in status.lastDisruption) is not
counted and not delayed. An object the apiserver refuses to create is a
PodCreationFailed condition retried after the same back-off (status.podCreation,
written by `creation_failed`), and the job fails when the refusal is a 422 (the
pod is invalid).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any

from splitfeed.trainer_client.contract import specs

from ..objects import conditions, planning, views
from .decisions import Ctx, Decision, Event, fail
from .rescaling import replace_world

REPORT_GRACE_S = 15.0
"""How long a pod whose trainer exited non-zero may wait for its still-running sidecar's report.

A sidecar that hits a data error tells the trainer first (which then exits) and writes its
termination report a moment later (sidecar FAILURE_LINGER_S, then exit). Judging the pod in
between would restart the world for an error that restarting cannot fix.
"""


def note_disruption(c: Ctx) -> None:
    """Remember, status first, that the cluster is disrupting this world (DisruptionTarget on a pod).

    A disrupted pod is often deleted before it can be seen as failed; the record
    keeps the world failure that follows from counting against spec.maxRestarts.
    """
    epoch = c.world_epoch
    known = c.found.disruption
    if known is not None and known.world_epoch == epoch:
        return
    for p in c.world:
        cond = p.disruption
        if cond is not None:
            c.patch["lastDisruption"] = {"worldEpoch": epoch, "pod": p.name,
                                         "reason": str(cond.get("reason") or "DisruptionTarget"),
                                         "time": conditions.timestamp(c.now)}
            return


def count_container_restarts(c: Ctx) -> Decision | None:
    """In-place restarts (restartCount) of the world's containers spend spec.maxRestarts.

    status.observedContainerRestarts holds the world's total already counted, so
    each restart is counted once (the status patch carries the job's
    resourceVersion: two operators cannot both count it). None unless the
    budget is now spent, in which case the job fails.
    """
    epoch = c.world_epoch
    seen = c.found.counted_restarts
    before = seen.count if seen.world_epoch == epoch else 0
    counts = {(p.name, cs.name): cs.restart_count for p in c.world for cs in p.containers}
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
    return fail(c, "RestartLimitExceeded", msg)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a failure of pods means before anything is replaced (`judge`)."""

    why: str
    """The failed and vanished pods, said once."""
    stop: Decision | None = None
    """The job fails (a data error, the budget spent), or waits for a sidecar's report."""
    disruption: str | None = None
    """The cluster disrupted the world (who and why): replaced without counting."""


def judge(c: Ctx, failed: list[views.Pod], lost: list[str]) -> Verdict:
    """The rules every failure goes through, whatever is then replaced (the whole world here, a
    member's pod alone in place: operator/lifecycle/inplace.py): a data error fails the job, a failed
    trainer waits for its sidecar's report, a disruption is not counted, a spent budget fails it."""
    why = "; ".join(
        [f"pod {p.name} failed" + (f" ({err})" if (err := conditions.sidecar_error(p.reports)) else "")
         for p in failed] + [f"pod {n} disappeared" for n in lost]
    )
    data_error = next(((p.name, err) for p in failed
                       if (err := conditions.sidecar_error(p.reports, permanent_only=True))), None)
    if data_error is not None:
        msg = (f"pod {data_error[0]} failed: {data_error[1]}; the data cannot feed this job, "
               "so restarting the world cannot help")
        return Verdict(why, stop=fail(c, "DataError", msg))
    if not lost and any(p.report_pending(c.now, REPORT_GRACE_S) for p in failed):
        c.cond(conditions.READY, False, "AwaitingSidecarReport",
               f"{why}; waiting up to {REPORT_GRACE_S:g}s for the sidecar's report before restarting")
        return Verdict(why, stop=c.decision("AwaitingSidecarReport", requeue_s=1.0))
    disruption = views.Disruption.parse(c.value("lastDisruption")) or views.Disruption()  # as this decision leaves it
    if any(p.disruption is not None for p in failed) or disruption.world_epoch == c.world_epoch:
        # Preempted, evicted or shut down by the cluster (DisruptionTarget): not the job's fault,
        # and one lost rank takes its peers down with it, so the whole failure is the disruption's.
        return Verdict(why, disruption=next((f"{p.name}: {(p.disruption or {}).get('reason') or 'DisruptionTarget'}"
                                             for p in failed if p.disruption is not None),
                                            f"{disruption.pod}: {disruption.reason}"))
    if c.restarts_used() >= c.job.max_restarts:
        return Verdict(why, stop=fail(c, "RestartLimitExceeded",
                                      f"{why}; restart budget spent ({c.budget()}, spec.maxRestarts)"))
    return Verdict(why)


def world_failed(c: Ctx, failed: list[views.Pod], lost: list[str]) -> Decision:
    """A lost rank stops every rank: restart the whole world, within spec.maxRestarts."""
    epoch, restarts = c.world_epoch, c.found.restarts
    c.patch["resumeStep"] = None  # no agreed step: the next world's coordinator picks the newest complete one
    verdict = judge(c, failed, lost)
    why = verdict.why
    if verdict.stop is not None:
        return verdict.stop
    if verdict.disruption is not None:
        return replace_world(c, "Disrupted", f"{why}; world {epoch} disrupted by the cluster ({verdict.disruption}); "
                             f"restarting the world without counting it ({c.budget()})", "Warning")
    c.patch["restarts"] = restarts + 1
    delay = c.settings.backoff_s(restarts + 1)
    at = c.now + datetime.timedelta(seconds=delay)
    if delay > 0:
        c.patch["nextRestartAt"] = conditions.timestamp(at)
    msg = (f"{why}; restarting the world (restart {c.restarts_used()} of {c.job.max_restarts}"
           + (f", not before {conditions.timestamp(at)}: back-off {delay:g}s" if delay > 0 else "") + ")")
    return replace_world(c, "Restart", msg, "Warning")


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
    c = Ctx(job, status, [], planning.Owner(job.name, ""), settings, now, generation)
    what = f"{failure.kind} {job.namespace}/{failure.name}"
    epoch = c.world_epoch
    if failure.status == 422:
        msg = (f"the apiserver refuses {what} of world {epoch} as invalid: {failure.message}"
               + ("; fix spec.trainer.template (a new StreamingJob can resume this one's checkpoints "
                  "with spec.checkpoint.resumeFrom)" if failure.kind == "Pod" else ""))
        c.cond(conditions.POD_CREATION_FAILED, True, "Invalid", msg)
        return fail(c, "InvalidPodTemplate" if failure.kind == "Pod" else "InvalidObject", msg)
    failures = (c.found.pod_creation or views.PodCreation()).failures + 1
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
