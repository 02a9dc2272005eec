"""Pods, a StreamingJob and its status, parsed once into small typed views.

Pure. The life cycle (`lifecycle`, `restarting`, `rescaling`, `inplace`) asks these
views questions (has the pod failed, is its sidecar's report still on its way, which
world is it in, which drain is under way) instead of walking raw API mappings in each
rule; the parsing of a raw pod or status, with its defaults for absent fields, happens
here and only here, its sidecar's termination reports included (typed
`wellknown.SidecarReport`s, which `conditions.progress`, `conditions.agreement` and the
rules read). `reconciling` and `live` read a StreamingJob through `Job`; its spec has
one parser, `specs.parse_job`. The raw mapping stays on the view for what reads whole
objects. The status is still written as a JSON merge patch (`Drain.patch` for
status.drain), in the wire format the CRD declares.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from splitfeed.trainer_client.contract import wellknown

from . import conditions, planning

PENDING, RUNNING, SUCCEEDED, FAILED = "Pending", "Running", "Succeeded", "Failed"


@dataclasses.dataclass(frozen=True)
class Container:
    """One entry of a pod's initContainerStatuses or containerStatuses."""

    name: str
    init: bool
    """From initContainerStatuses (a native sidecar) rather than containerStatuses."""
    terminated: bool
    """Its current state is `terminated`."""
    exit_code: int
    """The terminated state's exit code; 0 while it has not terminated."""
    finished_at: str | None
    waiting_reason: str | None
    waiting_message: str | None
    restart_count: int


def _exit_code(value: Any) -> int:
    if value is None:
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        return 1  # a code that is not a number is not success


def _containers(status: Mapping[str, Any]) -> tuple[Container, ...]:
    out = []
    for key in ("initContainerStatuses", "containerStatuses"):
        for cs in status.get(key) or []:
            state = cs.get("state") or {}
            term = state.get("terminated") or {}
            waiting = state.get("waiting") or {}
            out.append(Container(
                name=str(cs.get("name")), init=key == "initContainerStatuses",
                terminated=bool(state.get("terminated")), exit_code=_exit_code(term.get("exitCode")),
                finished_at=term.get("finishedAt") or None, waiting_reason=waiting.get("reason") or None,
                waiting_message=waiting.get("message") or None,
                restart_count=int(cs.get("restartCount") or 0)))
    return tuple(out)


def _epoch(labels: Mapping[str, Any]) -> int | None:
    return _label_int(labels, wellknown.LABEL_EPOCH)


def _label_int(labels: Mapping[str, Any], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError, TypeError):
        return None


@dataclasses.dataclass(frozen=True, eq=False)
class Pod:
    """What the life cycle reads of one pod. Compared by identity: one view per pod per decision."""

    name: str
    phase: str
    epoch: int | None
    """The world the pod belongs to (its splitfeed.io/world-epoch label); None if unlabelled."""
    replica: int | None
    """Its splitfeed.io/replica label; None if unlabelled."""
    controller: str | None
    """The UID of the object that controls the pod."""
    deleting: bool
    restart_policy: str
    pod_ip: str | None
    drain_token: str | None
    """Its splitfeed.io/drain annotation."""
    drain_replicas: str | None
    """Its splitfeed.io/drain-replicas annotation (a drain that changes the world in place)."""
    containers: tuple[Container, ...]
    pod_conditions: tuple[Mapping[str, Any], ...]
    final_report: wellknown.SidecarReport | None
    """The sidecar's current, terminated run's report (conditions.final_report)."""
    reports: tuple[wellknown.SidecarReport, ...]
    """Every report of the sidecar's runs, current and last (conditions.sidecar_reports)."""
    raw: Mapping[str, Any]

    @classmethod
    def parse(cls, p: Mapping[str, Any]) -> Pod:
        meta = p.get("metadata") or {}
        status = p.get("status") or {}
        annotations = meta.get("annotations") or {}
        return cls(
            name=str(meta.get("name")), phase=str(status.get("phase") or PENDING),
            epoch=_epoch(meta.get("labels") or {}), replica=_label_int(meta.get("labels") or {}, wellknown.LABEL_REPLICA),
            controller=planning.controller_uid(p),
            deleting=bool(meta.get("deletionTimestamp")),
            restart_policy=str((p.get("spec") or {}).get("restartPolicy") or "Always"),
            pod_ip=status.get("podIP") or None,
            drain_token=annotations.get(wellknown.ANNOTATION_DRAIN),
            drain_replicas=annotations.get(wellknown.ANNOTATION_DRAIN_REPLICAS),
            containers=_containers(status), pod_conditions=tuple(status.get("conditions") or []),
            final_report=conditions.final_report(p), reports=tuple(conditions.sidecar_reports(p)), raw=p)

    @property
    def failed(self) -> bool:
        """Failed, or (restartPolicy Never) a regular container has exited non-zero.

        With --sidecar-mode container a dead trainer leaves its sidecar waiting for a
        reconnect that never comes, and the pod Running forever; nothing will restart
        that container, so the pod has failed (docs/pod-contract.md).
        """
        if self.phase == FAILED:
            return True
        if self.restart_policy != "Never":
            return False
        return any(c.exit_code != 0 for c in self.containers if not c.init)

    @property
    def ready(self) -> bool:
        """Condition Ready=True: every container runs and passes its readiness probe (the
        sidecar's says its trainers have imported and said hello)."""
        return any(x.get("type") == "Ready" and x.get("status") == "True" for x in self.pod_conditions)

    @property
    def terminated(self) -> bool:
        return self.phase in (SUCCEEDED, FAILED) or self.failed

    @property
    def stopped(self) -> bool:
        """Every container has stopped (phase Succeeded or Failed). A pod that counts as failed
        may still run its sidecar (a plain container waiting for its dead trainer)."""
        return self.phase in (SUCCEEDED, FAILED)

    @property
    def live(self) -> bool:
        """Neither finished nor being deleted: the pods a drain or a failure still has to stop."""
        return not self.terminated and not self.deleting

    @property
    def drained(self) -> bool:
        """The sidecar exited saying every local rank committed the world's agreed drain step."""
        return self.final_report is not None and self.final_report.drained

    @property
    def disruption(self) -> Mapping[str, Any] | None:
        """Condition DisruptionTarget=True: preemption, eviction, node shutdown."""
        return next((x for x in self.pod_conditions
                     if x.get("type") == "DisruptionTarget" and x.get("status") == "True"), None)

    def report_pending(self, now: datetime.datetime, grace_s: float) -> bool:
        """A trainer exited non-zero under `grace_s` ago and the sidecar has not yet exited."""
        if self.phase == FAILED:
            return False
        if not any(c.name == wellknown.SIDECAR_NAME and not c.terminated for c in self.containers):
            return False
        for c in self.containers:
            if not c.init and c.exit_code != 0 and c.finished_at:
                if (now - conditions.parse_timestamp(c.finished_at)).total_seconds() < grace_s:
                    return True
        return False

    def detail(self) -> str:
        """Why the pod is not running, from what the kubelet and scheduler wrote."""
        parts = [self.phase]
        for cond in self.pod_conditions:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                parts.append(f"{cond.get('reason') or 'Unschedulable'}: {cond.get('message') or ''}".strip())
        for c in self.containers:
            if c.waiting_reason and c.waiting_reason != "PodInitializing":
                parts.append(f"{c.name} {c.waiting_reason}"
                             + (f" ({c.waiting_message[:200]})" if c.waiting_message else ""))
        return f"{self.name}: " + ", ".join(parts)


def parse_pods(pods: Sequence[Mapping[str, Any]]) -> list[Pod]:
    return [Pod.parse(p) for p in pods]


def final_reports(pods: Sequence[Pod]) -> dict[str, wellknown.SidecarReport | None]:
    """Each pod's final report by pod name (conditions.agreement)."""
    return {p.name: p.final_report for p in pods}


def drain_token(reason: str, epoch: int) -> str:
    """The splitfeed.io/drain annotation's value for a drain of world `epoch` (decisions.token)."""
    return f"{reason.lower()}-w{epoch}"


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def parse_time(value: Any) -> datetime.datetime | None:
    """An RFC 3339 time with its zone; anything else reads as absent."""
    if not isinstance(value, str):
        return None
    try:
        parsed = conditions.parse_timestamp(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


@dataclasses.dataclass(frozen=True)
class Drain:
    """status.drain: the drain under way, the life cycle's resumable state (rescaling, inplace).

    A field that is absent or of the wrong type reads as None (the rules say what
    stands in for it, and write it back); the token defaults to the one the world's
    epoch and reason give, the only one the operator ever writes. `patch` is the
    status.drain merge patch that writes this view: what it read, with every field
    the view holds set over it, so an unchanged drain is an unchanged status.
    """

    reason: str | None
    """Rescale, Suspend, Restart, Disrupted or WorldDrained."""
    step: str | None
    """CheckpointRequested, WaitingForCheckpoint, RemovingOldWorld or StartingNewWorld."""
    token: str
    """The splitfeed.io/drain annotation put on the world's pods."""
    requested_at: datetime.datetime | None
    target_replicas: int | None
    """The next world's replicas."""
    in_place: bool = False
    """A rescale that keeps the pods that stay (operator/lifecycle/inplace.py)."""
    asked_at: datetime.datetime | None = None
    """In place: when the world was asked to drain (after the new pods started)."""
    raw: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def parse(cls, raw: Any, epoch: int) -> Drain | None:
        """None when no drain is under way (absent, empty, or not a mapping)."""
        if not isinstance(raw, Mapping) or not raw:
            return None
        reason = _text(raw.get("reason"))
        return cls(reason=reason, step=_text(raw.get("step")),
                   token=_text(raw.get("token")) or drain_token(reason or "Rescale", epoch),
                   requested_at=parse_time(raw.get("requestedAt")), target_replicas=_count(raw.get("targetReplicas")),
                   in_place=raw.get("inPlace") is True, asked_at=parse_time(raw.get("askedAt")), raw=raw)

    def patch(self) -> dict[str, Any]:
        """The status.drain merge patch (the CRD's wire form) that writes this view."""
        held = {"reason": self.reason, "step": self.step, "token": self.token,
                "requestedAt": conditions.timestamp(self.requested_at) if self.requested_at else None,
                "targetReplicas": self.target_replicas, "inPlace": True if self.in_place else None,
                "askedAt": conditions.timestamp(self.asked_at) if self.asked_at else None}
        return {**self.raw, **{k: v for k, v in held.items() if v is not None}}


@dataclasses.dataclass(frozen=True)
class Progress:
    """status.progress as the live poller last wrote it (operator/cluster/live.py); absent fields read as unknown."""

    global_step: int | None = None
    """The slowest member's step, as the world's coordinator last said."""
    steps_per_epoch: int = 0
    updated_at: datetime.datetime | None = None
    raw: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The whole of it: the next status.progress is written over it (trainer_client.progress)."""

    @classmethod
    def parse(cls, raw: Any) -> Progress:
        if not isinstance(raw, Mapping):
            return cls()
        step = raw.get("globalStep")
        return cls(global_step=step if isinstance(step, int) and not isinstance(step, bool) else None,
                   steps_per_epoch=_count(raw.get("stepsPerEpoch")) or 0,
                   updated_at=parse_time(raw.get("updatedAt")), raw=raw)


@dataclasses.dataclass(frozen=True)
class Disruption:
    """status.lastDisruption: the cluster disrupting a world (DisruptionTarget on its pod),
    kept because a disrupted pod is often deleted before it is seen failed (restarting)."""

    world_epoch: int | None = None
    pod: str | None = None
    reason: str | None = None

    @classmethod
    def parse(cls, raw: Any) -> Disruption | None:
        """None where none is recorded (absent, empty, or not a mapping)."""
        if not isinstance(raw, Mapping) or not raw:
            return None
        return cls(world_epoch=_count(raw.get("worldEpoch")), pod=_text(raw.get("pod")),
                   reason=_text(raw.get("reason")))


@dataclasses.dataclass(frozen=True)
class CountedRestarts:
    """status.observedContainerRestarts: the in-place container restarts of world
    `world_epoch` already counted against spec.maxRestarts (each is counted once)."""

    world_epoch: int | None = None
    count: int = 0

    @classmethod
    def parse(cls, raw: Any) -> CountedRestarts:
        if not isinstance(raw, Mapping):
            return cls()
        return cls(world_epoch=_count(raw.get("worldEpoch")), count=_count(raw.get("count")) or 0)


@dataclasses.dataclass(frozen=True)
class PodCreation:
    """status.podCreation: objects the apiserver refused to create, and when to try again."""

    failures: int = 0
    retry_at: datetime.datetime | None = None

    @classmethod
    def parse(cls, raw: Any) -> PodCreation | None:
        """None while no creation was refused (absent, empty, or not a mapping)."""
        if not isinstance(raw, Mapping) or not raw:
            return None
        return cls(failures=_count(raw.get("failures")) or 0, retry_at=parse_time(raw.get("retryAt")))


@dataclasses.dataclass(frozen=True)
class Status:
    """The fields of a StreamingJob's status that the life cycle reads as it found them."""

    phase: str | None
    world_epoch: int | None
    replicas: int
    restarts: int
    raw: Mapping[str, Any]
    drain: Drain | None = None
    """status.drain: None while no drain is under way."""
    progress: Progress = dataclasses.field(default_factory=Progress)
    saved_at: datetime.datetime | None = None
    """status.lastCheckpoint.time: when the newest checkpoint a sidecar reported was saved."""
    disruption: Disruption | None = None
    counted_restarts: CountedRestarts = dataclasses.field(default_factory=CountedRestarts)
    pod_creation: PodCreation | None = None
    next_restart_at: datetime.datetime | None = None
    """status.nextRestartAt: the back-off before a failed world's replacement starts."""

    @classmethod
    def parse(cls, status: Mapping[str, Any]) -> Status:
        epoch = status.get("worldEpoch")
        world_epoch = epoch if isinstance(epoch, int) else None
        saved = status.get("lastCheckpoint")
        return cls(phase=status.get("phase"), world_epoch=world_epoch,
                   replicas=int(status.get("replicas") or 0), restarts=int(status.get("restarts") or 0),
                   raw=status, drain=Drain.parse(status.get("drain"), world_epoch or 0),
                   progress=Progress.parse(status.get("progress")),
                   saved_at=parse_time(saved.get("time")) if isinstance(saved, Mapping) else None,
                   disruption=Disruption.parse(status.get("lastDisruption")),
                   counted_restarts=CountedRestarts.parse(status.get("observedContainerRestarts")),
                   pod_creation=PodCreation.parse(status.get("podCreation")),
                   next_restart_at=parse_time(status.get("nextRestartAt")))


@dataclasses.dataclass(frozen=True)
class Job:
    """A StreamingJob as read from the API: who it is, and its status (typed).

    The spec has one parser, `specs.parse_job` (through `admission.parse`, with the
    operator's sidecar defaults): it reads `raw`, which stays on the view for it and
    for Kopf's event posting.
    """

    name: str
    namespace: str
    uid: str
    generation: int | None
    resource_version: str | None
    deleting: bool
    """metadata.deletionTimestamp is set: the garbage collector removes the world."""
    status: Status
    raw: Mapping[str, Any]

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Job:
        meta = body.get("metadata") or {}
        generation = meta.get("generation")
        return cls(name=str(meta.get("name") or ""), namespace=str(meta.get("namespace") or "default"),
                   uid=str(meta.get("uid") or ""),
                   generation=generation if isinstance(generation, int) and not isinstance(generation, bool) else None,
                   resource_version=_text(meta.get("resourceVersion")), deleting=bool(meta.get("deletionTimestamp")),
                   status=Status.parse(body.get("status") or {}), raw=body)
