"""Trainers that end a world themselves: an early stop is a normal end, a lone early rank a failure.

Pure; one policy of the life cycle (`lifecycle._running_step` asks it once failures and
drains are ruled out). Most training scripts stop at a `max_steps` and simply return,
often without `client.close()` (issue 21). The sidecar of such a trainer is never told
that nothing more will be asked of it: as a plain container (`--sidecar-mode container`)
it serves on, its pod Running for ever; as a native sidecar the kubelet stops it (SIGTERM,
then SIGKILL after the grace period), its report perhaps lost. So the operator judges by
the trainer containers themselves:

- every trainer of the world exited 0: the world is finished. The sidecars get
  STOP_GRACE_S to end on their own (a `close()`, the job's last step, a drain of their
  own); then the step the trainers reached, k, is read from every sidecar's report, or
  from a live status poll made after the last trainer returned (`live.Poller.due` polls
  while the Ready reason is TrainersStopped), waiting at most REPORT_WAIT_S more for
  either; the job is `Succeeded` with condition Complete (reason TrainersStopped) and an
  event saying "trainers stopped at global step k of K", and the pods that still run are
  deleted. Checkpoints are not touched: the newest complete one resumes the run (a job
  with `spec.checkpoint.resumeFrom`).
- some trainers exited 0 while the others still run (a DDP peer gone: the rest wait in a
  collective): after `spec.checkpoint.timeoutSeconds` from the first return the job fails
  (reason RanksStoppedEarly) naming both sides. When the others failed instead (gloo
  raises at once when a peer's connection closes), it fails at once, uncounted: a world
  restarted from its checkpoint would stop the same way.
"""

from __future__ import annotations

from splitfeed.trainer_client.contract import wellknown

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from ..objects import conditions, planning, views
from .decisions import POLL_S, SUCCEEDED, Ctx, Decision, Event, fail

TRAINERS_STOPPED = "TrainersStopped"
"""Condition reason (Ready while the world ends, Complete once it has) and event reason."""
RANKS_STOPPED_EARLY = "RanksStoppedEarly"
"""Failed reason: some ranks returned while their peers still trained."""
STOP_GRACE_S = 5.0
"""After the last trainer returned, how long its sidecars get to end on their own (a `close()`
makes them end at once, a drain within a step) before the operator ends the world."""
REPORT_WAIT_S = 15.0
"""Then, how long more to wait for the step reached (every sidecar's report, or a live status
poll made after the return) before ending the world with the best step known."""


def trainers(pod: views.Pod) -> list[views.Container]:
    """The pod's `trainer` containers (else every regular container but the sidecar)."""
    named = [c for c in pod.containers if not c.init and c.name == wellknown.TRAINER_NAME]
    return named or [c for c in pod.containers if not c.init and c.name != wellknown.SIDECAR_NAME]


def returned(pod: views.Pod) -> bool:
    """Every trainer container of the pod exited 0 (and none is restarted: exit 0 never is)."""
    found = trainers(pod)
    if pod.phase == SUCCEEDED:
        return True
    return bool(found) and all(c.terminated and c.exit_code == 0 for c in found)


def returned_at(pod: views.Pod) -> datetime.datetime | None:
    """When the pod's last trainer container exited (the kubelet's finishedAt)."""
    times = [conditions.parse_timestamp(c.finished_at) for c in trainers(pod) if c.terminated and c.finished_at]
    return max(times, default=None)


def ranks_of(c: Ctx, pods: Sequence[views.Pod]) -> str:
    """"rank 1 (pod x-w0-1)", "ranks 2-3 (pod x-w0-1)", joined: the global ranks a pod runs."""
    per = c.job.gpus_per_replica
    out = []
    for p in sorted(pods, key=lambda p: p.name):
        if p.replica is None:
            out.append(f"pod {p.name}")
            continue
        first = p.replica * per
        out.append(f"rank {first}" if per == 1 else f"ranks {first}-{first + per - 1}")
        out[-1] += f" (pod {p.name})"
    return ", ".join(out)


@dataclasses.dataclass(frozen=True)
class Reached:
    """The global step the world's trainers reached (k), of the job's total (K), and whence."""

    step: int | None
    total: int | None
    source: str

    @property
    def early(self) -> bool:
        """Short of the job's last step, or not known to have reached it."""
        return self.step is None or self.total is None or self.step < self.total

    def words(self) -> str:
        k = "an unknown step" if self.step is None else f"global step {self.step}"
        return f"trainers stopped at {k} of {self.total if self.total is not None else 'an unknown total'}"


def reached(c: Ctx, since: datetime.datetime | None) -> Reached | None:
    """k from every pod's sidecar report, else from status.progress polled after `since`; None
    while neither is known. Reports are exact (each sidecar counts what its ranks took); the
    live status is the slowest member's step, final once the trainers are gone."""
    total = _total(c)
    steps = [r.global_step for p in c.world if (r := p.final_report) is not None and r.global_step is not None]
    if c.world and len(steps) == len(c.world):
        return Reached(min(steps), total, "the sidecars' reports")
    live = c.found.progress
    step, updated = live.global_step, live.updated_at
    if step is not None and updated is not None and since is not None and updated > since:
        return Reached(step, total, f"the world's live status at {conditions.timestamp(updated)}")
    return None


def _total(c: Ctx) -> int | None:
    """K: the job's global steps, from the reports' or the live status' steps per epoch."""
    spe = max([r.steps_per_epoch or 0 for p in c.world if (r := p.final_report)]
              + [c.found.progress.steps_per_epoch])
    return spe * c.job.data.epochs if spe > 0 else None


def _reached_end(c: Ctx) -> bool:
    """Some sidecar's report, or the live status, says the job's last step was taken."""
    total = _total(c)
    steps = [r.global_step for p in c.world if (r := p.final_report) and r.global_step is not None]
    live = c.found.progress.global_step
    if live is not None:
        steps.append(live)
    return total is not None and any(s >= total for s in steps)


def _best(c: Ctx) -> Reached:
    """What is known when waiting is over: the last live status, however old."""
    found = reached(c, datetime.datetime.min.replace(tzinfo=datetime.timezone.utc))
    if found is not None:
        return dataclasses.replace(found, source=found.source + ", the last one seen")
    return Reached(None, _total(c), "no report and no live status")


def world_ended(c: Ctx) -> Decision | None:
    """Every trainer of the world returned (exit 0), or some did and the others still run."""
    back = [p for p in c.world if returned(p)]
    if not back or len(c.world) < c.found.replicas:
        return None
    if any(p.deleting or p.disruption is not None for p in c.world):
        return None  # a pod deleted or evicted (a preemption): its world drains itself, or fails
    others = [p for p in c.world if p not in back]
    if others:
        return _some_returned(c, back, others)
    times = [t for p in back if (t := returned_at(p)) is not None]
    since = max(times, default=None)
    live = [p for p in c.world if p.live]
    found = reached(c, since)
    if live:
        wait_until = (since or c.now) + datetime.timedelta(seconds=STOP_GRACE_S)
        if found is None or c.now < wait_until:
            give_up = wait_until + datetime.timedelta(seconds=REPORT_WAIT_S)
            if c.now < give_up:
                c.cond(conditions.READY, False, TRAINERS_STOPPED,
                       f"every trainer of world {c.world_epoch} returned (exit 0) by "
                       f"{conditions.timestamp(since or c.now)}; {len(live)} sidecar(s) still run: waiting for "
                       f"them to end or for the step reached, until {conditions.timestamp(give_up)}")
                left = ((wait_until if c.now < wait_until else give_up) - c.now).total_seconds()
                return c.decision(TRAINERS_STOPPED, requeue_s=max(0.5, min(POLL_S / 2, left)))
            found = _best(c)
    elif found is None or not found.early:
        # Every pod succeeded: the job's last step, or no report to say otherwise (an old live
        # status says nothing of where the trainers stopped): lifecycle's AllPodsSucceeded.
        return None
    return _succeeded(c, found, live)


def _succeeded(c: Ctx, found: Reached, live: list[views.Pod]) -> Decision:
    epoch = c.world_epoch
    what = found.words()
    if found.early:
        msg = (f"{what} ({found.source}): every trainer of world {epoch} returned (exit 0), so the job ends "
               "there; its newest complete checkpoint (status.lastCheckpoint) resumes it in a job with "
               "spec.checkpoint.resumeFrom")
    else:
        msg = f"every trainer of world {epoch} finished the job's last step ({what}, {found.source})"
    c.patch["phase"] = SUCCEEDED
    c.cond(conditions.COMPLETE, True, TRAINERS_STOPPED, msg)
    c.cond(conditions.READY, False, "Completed", "the job has finished")
    if conditions.is_true(c.conds, conditions.STALLED):
        c.cond(conditions.STALLED, False, "Progressing", f"the trainers of world {epoch} returned")
    c.events.append(Event("Normal", TRAINERS_STOPPED, msg))
    return c.decision(SUCCEEDED, delete=[p.name for p in live])


def _some_returned(c: Ctx, back: list[views.Pod], others: list[views.Pod]) -> Decision | None:
    timeout = c.job.checkpoint.timeout_seconds
    times = [t for p in back if (t := returned_at(p)) is not None]
    first = min(times, default=c.now)
    if c.now < first + datetime.timedelta(seconds=STOP_GRACE_S):
        return None  # the others may be returning too (a normal end): say nothing yet
    deadline = first + datetime.timedelta(seconds=timeout)
    msg = (f"{ranks_of(c, back)} of world {c.world_epoch} returned (exit 0) at {conditions.timestamp(first)} "
           f"while {ranks_of(c, others)} still ran")
    if c.now < deadline:
        c.cond(conditions.READY, False, RANKS_STOPPED_EARLY,
               f"{msg}; the job fails at {conditions.timestamp(deadline)} (spec.checkpoint.timeoutSeconds="
               f"{timeout}) unless they return too")
        return c.decision(RANKS_STOPPED_EARLY, requeue_s=max(0.5, min(POLL_S, (deadline - c.now).total_seconds())))
    return fail(c, RANKS_STOPPED_EARLY,
                f"{msg} {timeout} s later (spec.checkpoint.timeoutSeconds): a rank that stops early leaves its "
                "DDP peers waiting in a collective; stop every rank at the same step")


def returned_then_failed(c: Ctx, failed: Sequence[views.Pod], lost: Sequence[str]) -> Decision | None:
    """Some trainers returned (exit 0) and then the others failed (their collectives lost a peer):
    the job fails naming both, uncounted, instead of a restart that would stop the same way."""
    if lost or not failed:
        return None
    back = [p for p in c.world if p not in failed and returned(p) and not p.drained]
    if not back or any(p.disruption is not None for p in c.world):
        return None
    if (views.Disruption.parse(c.value("lastDisruption")) or views.Disruption()).world_epoch == c.world_epoch:
        return None
    if _reached_end(c):
        return None  # the world had reached its end: a failure after it is an ordinary one
    first_back = min((t for p in back if (t := returned_at(p)) is not None), default=None)
    failed_at = [conditions.parse_timestamp(x.finished_at) for p in failed for x in trainers(p)
                 if x.terminated and x.exit_code != 0 and x.finished_at]
    if first_back is None or not failed_at or min(failed_at) < first_back:
        return None  # a rank failed first: an ordinary world failure
    return fail(c, RANKS_STOPPED_EARLY,
                f"{ranks_of(c, back)} of world {c.world_epoch} returned (exit 0) at "
                f"{conditions.timestamp(first_back)} while {ranks_of(c, failed)} still trained, and then failed "
                "(a collective lost its peer): a rank that stops early stops its DDP peers; stop every rank at "
                "the same step. Not restarted: the same code would stop the same way")


def condition_waiting(status: Mapping[str, Any]) -> bool:
    """The world's trainers returned and the operator waits for the step reached (live.Poller.due)."""
    ready = conditions.get(status.get("conditions") or [], conditions.READY) or {}
    return ready.get("reason") == TRAINERS_STOPPED and ready.get("status") == "False"
