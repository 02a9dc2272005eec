"""Pods and a StreamingJob's status, parsed once into small typed views.

Pure. The life cycle (`lifecycle`, `restarting`, `rescaling`) asks these views
questions (has the pod failed, is its sidecar's report still on its way, which
world is it in) instead of walking raw API mappings in each rule; the parsing of
a raw pod, with its defaults for absent fields, happens here and only here, its
sidecar's termination reports included (typed `contract.SidecarReport`s, which
`conditions.progress`, `conditions.agreement` and the rules read). The raw mapping
stays on the view for what reads whole objects.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from splitfeed.trainer_client import contract

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
    return _label_int(labels, contract.LABEL_EPOCH)


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
    containers: tuple[Container, ...]
    pod_conditions: tuple[Mapping[str, Any], ...]
    final_report: contract.SidecarReport | None
    """The sidecar's current, terminated run's report (conditions.final_report)."""
    reports: tuple[contract.SidecarReport, ...]
    """Every report of the sidecar's runs, current and last (conditions.sidecar_reports)."""
    raw: Mapping[str, Any]

    @classmethod
    def parse(cls, p: Mapping[str, Any]) -> Pod:
        meta = p.get("metadata") or {}
        status = p.get("status") or {}
        return cls(
            name=str(meta.get("name")), phase=str(status.get("phase") or PENDING),
            epoch=_epoch(meta.get("labels") or {}), replica=_label_int(meta.get("labels") or {}, contract.LABEL_REPLICA),
            controller=planning.controller_uid(p),
            deleting=bool(meta.get("deletionTimestamp")),
            restart_policy=str((p.get("spec") or {}).get("restartPolicy") or "Always"),
            pod_ip=status.get("podIP") or None,
            drain_token=(meta.get("annotations") or {}).get(contract.ANNOTATION_DRAIN),
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
        if not any(c.name == contract.SIDECAR_NAME and not c.terminated for c in self.containers):
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


def final_reports(pods: Sequence[Pod]) -> dict[str, contract.SidecarReport | None]:
    """Each pod's final report by pod name (conditions.agreement)."""
    return {p.name: p.final_report for p in pods}


@dataclasses.dataclass(frozen=True)
class Status:
    """The fields of a StreamingJob's status that the life cycle reads as it found them."""

    phase: str | None
    world_epoch: int | None
    replicas: int
    restarts: int
    raw: Mapping[str, Any]

    @classmethod
    def parse(cls, status: Mapping[str, Any]) -> Status:
        epoch = status.get("worldEpoch")
        return cls(phase=status.get("phase"), world_epoch=epoch if isinstance(epoch, int) else None,
                   replicas=int(status.get("replicas") or 0), restarts=int(status.get("restarts") or 0),
                   raw=status)
