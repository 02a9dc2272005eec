"""What one step of the world life cycle returns, and the inputs it is decided on.

Pure. Shared by the policies that decide a step (`lifecycle` for the steady
world, `restarting` for failures, `rescaling` for drains); `lifecycle.decide`
says which one runs. A `Decision` is applied in order (status, create, annotate,
delete) by `reconciling`; everything the next step needs is in the status patch,
written first (see `lifecycle`'s docstring).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from splitfeed.trainer_client.contract import messages, specs

from ..objects import admission, conditions, planning, redaction, views

PENDING, RUNNING, RESCALING, SUSPENDED, SUCCEEDED, FAILED = (
    "Pending", "Running", "Rescaling", "Suspended", "Succeeded", "Failed",
)
CHECKPOINT_REQUESTED = "CheckpointRequested"
WAITING_FOR_CHECKPOINT = "WaitingForCheckpoint"
REMOVING_OLD_WORLD = "RemovingOldWorld"
STARTING_NEW_WORLD = "StartingNewWorld"
POLL_S = 2.0
"""How soon to look again while a step waits on pods."""


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
    notify_replicas: int = 0
    """With `notify`: > 0 asks the world to change in place to that many replicas."""
    notify_lost: tuple[int, ...] = ()
    """With `notify`: these member replicas' pods failed; the world ends without a drain and the
    others go on in place (messages.DrainRequest.lost, operator/lifecycle/inplace.py)."""
    label: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    """Pod name -> labels to set (a kept pod moved to the next world in place); after annotate."""


def is_terminal(status: Mapping[str, Any]) -> bool:
    """Succeeded, or Failed for a reason other than an invalid spec (which a fix revives)."""
    phase = status.get("phase")
    conds = status.get("conditions") or []
    return phase == SUCCEEDED or (phase == FAILED and conditions.is_true(conds, conditions.VALIDATED))


token = views.drain_token
"""The splitfeed.io/drain annotation's value for a drain of a world (reason, epoch)."""


class Ctx:
    """The inputs of one decision, parsed once (views), plus the status being built."""

    def __init__(self, job: specs.JobSpec, status: Mapping[str, Any], pods: Sequence[views.Pod],
                 owner: planning.Owner, settings: planning.Settings, now: datetime.datetime,
                 generation: int | None, next_world: messages.Status | None = None) -> None:
        self.job, self.status, self.owner, self.settings, self.now = job, status, owner, settings, now
        self.found = views.Status.parse(status)
        """The status as this decision found it (typed); `value` reads it as the patch leaves it."""
        self.generation = generation
        self.epoch: int | None = self.found.world_epoch
        self.pods = list(pods)
        self.next_world = next_world
        """In place: the `status` answer of the next world's coordinator, once it serves."""
        self.world = [p for p in self.pods if self.epoch is not None and (p.epoch == self.epoch or self._kept(p))]
        changing = job.in_place and self.found.drain is not None and self.found.drain.in_place
        self.ahead = [p for p in self.pods if changing and self.epoch is not None and p.epoch == self.epoch + 1]
        """Pods created ahead for the world that follows in place (a scale-up's new replicas)."""
        self.stale = [p for p in self.pods if p not in self.world and p not in self.ahead]
        self.conds: list[dict[str, Any]] = [dict(c) for c in status.get("conditions") or []]
        self.patch: dict[str, Any] = {}
        self.events: list[Event] = []

    def _kept(self, p: views.Pod) -> bool:
        """A pod that stayed through an in-place change whose world label the operator has not
        yet moved on (it crashed in between): it runs this world (docs/pod-contract.md)."""
        return (self.job.in_place and self.epoch is not None and p.epoch is not None and p.epoch < self.epoch
                and p.replica is not None and p.replica < self.found.replicas and not p.terminated
                and p.name == planning.pod_name_of(self.job, self.epoch, p.replica))

    @property
    def world_epoch(self) -> int:
        """The running world's epoch (0 before the first world)."""
        return int(self.epoch or 0)

    @property
    def table_version(self) -> int | None:
        """The table version the job pinned (status.data.tableVersion), for the next world's pods."""
        data = self.patch.get("data") or self.status.get("data") or {}
        version = data.get("tableVersion")
        return version if isinstance(version, int) else None

    @property
    def resume_step(self) -> int | None:
        """status.resumeStep as this decision leaves it (the patch's None clears it)."""
        value = self.value("resumeStep")
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

    def seconds_to(self, at: datetime.datetime | None) -> float:
        """Seconds until `at`; 0 when it is None or past."""
        return 0.0 if at is None else max(0.0, (at - self.now).total_seconds())

    def creation_wait(self) -> float:
        """Seconds before objects may be created again after a refused creation."""
        return self.seconds_to(self.found.pod_creation.retry_at if self.found.pod_creation is not None else None)

    def world_objects(self, epoch: int, replicas: int) -> list[dict[str, Any]]:
        """Every object of world `epoch` with `replicas` replicas, starting where the status says."""
        job = dataclasses.replace(self.job, replicas=replicas)
        return planning.world(job, epoch, self.owner, self.settings, self.resume_step, self.table_version)

    def decision(self, step: str, **kw: Any) -> Decision:
        patch = {
            "allowedReplicas": admission.allowed_replicas(self.job),
            "selector": planning.selector_string(self.job.name),
            **conditions.progress((r for p in self.pods for r in p.reports), self.status),
            **self.patch,
            "conditions": self.conds,
        }
        if self.generation is not None:
            patch["observedGeneration"] = self.generation
        changed = {k: v for k, v in patch.items() if self.status.get(k) != v}
        deletes = sorted(set(kw.pop("delete", [])) | {p.name for p in self.stale if not p.deleting})
        return Decision(step=step, status=changed, events=self.events, delete=deletes, **kw)


def start_world(c: Ctx, epoch: int, replicas: int, reason: str) -> Decision:
    """Status first (worldEpoch, replicas), then every object of the world."""
    job = dataclasses.replace(c.job, replicas=replicas)
    c.patch.update(worldEpoch=epoch, replicas=replicas, worldSize=job.world_size)
    if c.status.get("nextRestartAt"):
        c.patch["nextRestartAt"] = None
    c.cond(conditions.READY, False, "PodsStarting", f"world {epoch}: creating {replicas} pods")
    start = "the newest complete checkpoint" if c.resume_step is None else f"step {c.resume_step}"
    c.events.append(Event("Normal", STARTING_NEW_WORLD,
                          f"starting world {epoch} with {replicas} replicas ({reason}), resuming at {start}"))
    return c.decision(STARTING_NEW_WORLD, create=c.world_objects(epoch, replicas), requeue_s=POLL_S)


def fail(c: Ctx, reason: str, msg: str) -> Decision:
    """The job has failed: say why, and stop what still runs of its world (a failed pod's
    sidecar too: as a plain container it would wait for its dead trainer for ever)."""
    live = [p.name for p in c.world if not p.stopped and not p.deleting]
    c.patch["phase"] = FAILED
    c.cond(conditions.FAILED, True, reason, msg)
    c.cond(conditions.READY, False, "Failed", msg)
    c.events.append(Event("Warning", "Failed" if reason == "RestartLimitExceeded" else reason, msg))
    return c.decision(FAILED, delete=live)
