"""Live status of a running world: status.progress while it trains, status.lastRescale after a rescale.

Every `spec.statusIntervalSeconds` (and every timer pass while a drain is under
way, so a rescale's timeline is seen to a few seconds) the operator asks the
world's coordinator (replica 0's sidecar) for the sums of its members'
progress (`trainer_client.worlds.request_status`, in a worker thread: a socket
and a one-second wait never run on Kopf's event loop). The operator reads no
data and the trainer does nothing: sidecars read their trainers' counters from
shared memory (docs/observability.md).

The rescale timeline is kept in memory between passes (`Poller.rescales`) and
written to `status.lastRescale` and an event once the new world took its first
batch; an operator restarted mid-rescale writes the marks it saw itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import time
from collections.abc import Mapping
from typing import Any

from splitfeed.trainer_client.contract import messages, progress, specs
from splitfeed.trainer_client.transport import worlds

from ..lifecycle import decisions, endings
from . import kube
from ..objects import planning, views

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 15
LIVE_PHASES = ("Running", "Rescaling")
RESCALE_REPORT = "RescaleReport"
"""The event that carries a rescale's timeline (and status.lastRescale its numbers)."""
STEPS_REDONE = "StepsRedone"
"""The event of a world that replaced a failed, disrupted or self-drained one and trains
steps again: how many, never silent (issue 21)."""
REPLACEMENTS = ("Restart", "Disrupted", "WorldDrained")
"""status.drain reasons of a world replaced without a rescale: tracked for the steps redone."""


def _iso(t: datetime.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse(text: Any) -> datetime.datetime | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def interval_s(body: Mapping[str, Any]) -> float:
    value = (body.get("spec") or {}).get("statusIntervalSeconds")
    return float(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 5 \
        else float(DEFAULT_INTERVAL_S)


def first_batch_time(answer: messages.Status, requested_at: datetime.datetime,
                     now: datetime.datetime) -> datetime.datetime:
    """When the new world's first batch reached every rank: the world's own mark, taken
    within 0.1 s by its sidecars, where it gave one (held between the request and this
    look: the nodes' clocks are not the operator's); else this look, up to a timer pass late."""
    if answer.first_batch_at is None:
        return now
    said = datetime.datetime.fromtimestamp(answer.first_batch_at, datetime.timezone.utc)
    return min(now, max(said, requested_at))


@dataclasses.dataclass
class Timeline:
    """One rescale, as the operator saw it (wall-clock marks)."""

    from_replicas: int
    to_replicas: int
    requested_at: datetime.datetime
    old_epoch: int
    old_step: int = 0
    agreed_at: datetime.datetime | None = None
    gone_at: datetime.datetime | None = None
    reason: str = "Rescale"

    def report(self, first_batch_at: datetime.datetime, resume_step: int) -> dict[str, Any]:
        marks = {"requestedAt": self.requested_at, "checkpointAgreedAt": self.agreed_at,
                 "oldWorldGoneAt": self.gone_at, "firstBatchAt": first_batch_at}
        return {
            "fromReplicas": self.from_replicas, "toReplicas": self.to_replicas,
            **{k: _iso(v) for k, v in marks.items() if v is not None},
            "latencySeconds": round((first_batch_at - self.requested_at).total_seconds(), 1),
            "stepsRedone": max(0, self.old_step - resume_step),
        }


def describe(report: Mapping[str, Any]) -> str:
    """The event message: where the rescale's time went."""
    t0 = _parse(report.get("requestedAt"))

    def since(key: str) -> str:
        t = _parse(report.get(key))
        return f"{(t - t0).total_seconds():.0f} s" if t and t0 else "unseen"

    return (f"rescale {report.get('fromReplicas')} -> {report.get('toReplicas')} replicas took "
            f"{report.get('latencySeconds')} s: checkpoint agreed after {since('checkpointAgreedAt')}, "
            f"old world gone after {since('oldWorldGoneAt')}, new world's first batch after "
            f"{since('firstBatchAt')}; {report.get('stepsRedone')} steps redone")


@dataclasses.dataclass
class Poller:
    """Per-operator memory: when each job was last asked, and rescales under way."""

    last: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    rescales: dict[tuple[str, str], Timeline] = dataclasses.field(default_factory=dict)
    """Rescales, and replacements of a world (REPLACEMENTS), under way."""
    redone: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    """Steps redone by replacements reported since the last `take_redone` (the operator's counter)."""

    def take_redone(self, key: tuple[str, str]) -> int:
        return self.redone.pop(key, 0)

    def track(self, key: tuple[str, str], status: views.Status, now: datetime.datetime) -> None:
        """A rescale's marks from one look at the job's status, the reconciler's or this poller's.

        The reconciler's looks matter: a drain agreed and a new world started within one
        timer pass (seconds, when trainers are quick) never shows this poller a status.drain.
        """
        self._timeline(key, status, now)

    def _timeline(self, key: tuple[str, str], status: views.Status, now: datetime.datetime
                  ) -> Timeline | None:
        drain, epoch = status.drain, status.world_epoch or 0
        timeline = self.rescales.get(key)
        reason = (drain.reason if drain is not None else None) or ""
        if drain is not None and (reason == "Rescale" or reason in REPLACEMENTS) and timeline is None:
            timeline = self.rescales[key] = Timeline(
                from_replicas=status.replicas, to_replicas=drain.target_replicas or 0,
                requested_at=drain.requested_at or now, old_epoch=epoch, reason=reason)
        old_step = status.progress.global_step or 0
        if timeline is not None and epoch == timeline.old_epoch:
            timeline.old_step = max(timeline.old_step, old_step)
        elif timeline is not None and timeline.gone_at is None:
            timeline.gone_at = now  # the operator moved on to the next world
        if timeline is not None and timeline.agreed_at is None:
            # A drain agreed and saved within one pass is seen in the drained pods' reports instead.
            saved = status.saved_at
            if saved is not None and saved >= timeline.requested_at:
                timeline.agreed_at = saved
        return timeline

    def observe(self, key: tuple[str, str], status: Mapping[str, Any], answer: messages.Status | None,
                now: datetime.datetime) -> tuple[dict[str, Any], list[decisions.Event]]:
        """Pure bookkeeping of one pass: the status patch and events it calls for."""
        patch: dict[str, Any] = {}
        events: list[decisions.Event] = []
        found = views.Status.parse(status)
        epoch = found.world_epoch or 0
        timeline = self._timeline(key, found, now)
        if timeline is not None and epoch == timeline.old_epoch and answer is not None \
                and answer.drain_step is not None and timeline.agreed_at is None:
            timeline.agreed_at = now
            timeline.old_step = max(timeline.old_step, answer.drain_step)
        if answer is not None:
            live = progress.status_progress(answer, found.progress.raw, epoch)
            if live is not None:
                live["updatedAt"] = _iso(now)
                patch["progress"] = live
            step, resume = answer.global_step, answer.resume_step
            taken = answer.first_batch_at is not None or (step is not None and step > resume)
            if timeline is not None and epoch != timeline.old_epoch and taken:
                report = timeline.report(first_batch_time(answer, timeline.requested_at, now), resume)
                if timeline.reason == "Rescale":
                    patch["lastRescale"] = report
                    events.append(decisions.Event("Normal", RESCALE_REPORT, describe(report)))
                elif report["stepsRedone"]:
                    self.redone[key] = self.redone.get(key, 0) + report["stepsRedone"]
                    events.append(decisions.Event("Warning", STEPS_REDONE, (
                        f"world {epoch} resumed at global step {resume} after world {timeline.old_epoch} "
                        f"ended ({timeline.reason}) having reached at least step {timeline.old_step}: "
                        f"{report['stepsRedone']} steps are trained again")))
                del self.rescales[key]
        return patch, events

    def due(self, key: tuple[str, str], body: Mapping[str, Any]) -> bool:
        """Time to ask this job's world: every interval, or every pass while a rescale is under way."""
        status = views.Job.parse(body).status
        if status.phase not in LIVE_PHASES:
            return False
        if status.drain is not None or key in self.rescales or endings.condition_waiting(status.raw):
            return True  # a rescale's timeline; the step trainers that returned reached
        return time.monotonic() - self.last.get(key, -1e9) >= interval_s(body)

    async def poll(self, k: kube.Kube, namespace: str, name: str
                   ) -> tuple[dict[str, Any], list[decisions.Event]]:
        """One pass for one job (the operator's timer); the status patch written and the events to post."""
        body = await k.get_job(namespace, name)
        if body is None:
            return {}, []
        key = (namespace, name)
        if not self.due(key, body):
            return {}, []
        self.last[key] = time.monotonic()
        status = views.Job.parse(body).status
        pods = await k.list_pods(namespace, name)
        epoch = status.world_epoch
        in_place = (body.get("spec") or {}).get("rescale") == specs.IN_PLACE
        address = planning.coordinator_of(name, epoch, pods, in_place) if epoch is not None else None
        keypair = await kube.asking_keys(k, namespace, name, str((body.get("metadata") or {}).get("uid") or "")) \
            if address else None
        answer = await asyncio.to_thread(worlds.request_status, address, keys=keypair) \
            if address and keypair else None
        patch, events = self.observe(key, status.raw, answer, datetime.datetime.now(datetime.timezone.utc))
        if patch:
            await k.patch_job_status(namespace, name, patch)
        return patch, events
