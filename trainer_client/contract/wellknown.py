"""The pod contract as code: what the operator puts into a pod and what runs in it expects.

One home for the names both sides spell: the CRD's coordinates, labels and
annotations, container and volume names, paths, ports, the `SPLITFEED_*`
environment, the sidecar's termination report and the trainer's stats record.
The operator (which builds pods), the sidecar and `splitfeed local` (which build
the same environment for local processes) and the trainer client import it, so
it lives in the lowest layer and is pure: no I/O, the standard library and the
error tree only.
docs/pod-contract.md describes the same names in prose; tests/unit/test_contract.py
fails when the two drift apart.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypedDict

from .errors import ProtocolError

# --- the custom resource -------------------------------------------------------
GROUP = "splitfeed.io"
VERSION = "v1alpha1"
PLURAL = "streamingjobs"
KIND = "StreamingJob"
API_VERSION = f"{GROUP}/{VERSION}"

# --- names on objects ----------------------------------------------------------
LABEL_JOB = "splitfeed.io/job"
"""The job's name, on every object of its worlds; also status.selector (scale subresource)."""
LABEL_REPLICA = "splitfeed.io/replica"
LABEL_EPOCH = "splitfeed.io/world-epoch"
ANNOTATION_DRAIN = "splitfeed.io/drain"
"""The sure path of a drain request: the sidecar reads it through the downward-API file."""
ANNOTATION_DRAIN_REPLICAS = "splitfeed.io/drain-replicas"
"""With a drain annotation of an in-place rescale: the replicas of the world that follows in place."""
ANNOTATION_CHECKSUM = "splitfeed.io/config-checksum"

SIDECAR_NAME = "splitfeed-sidecar"
TRAINER_NAME = "trainer"
VOLUME_SHM = "splitfeed-shm"
VOLUME_CONFIG = "splitfeed-config"
VOLUME_PODINFO = "splitfeed-podinfo"
VOLUME_STORAGE = "splitfeed-storage"
VOLUME_KEYS = "splitfeed-keys"
"""The job's CURVE keypair Secret, mounted read-only at KEYS_DIR in the sidecar and trainer only."""
RESERVED_VOLUMES = (VOLUME_SHM, VOLUME_CONFIG, VOLUME_PODINFO, VOLUME_STORAGE, VOLUME_KEYS)
VOLUME_TRANSFORMS = "splitfeed-transforms"
"""A volume of this name in the trainer template (a ConfigMap of small transform modules,
say) is mounted read-only into the sidecar at TRANSFORMS_DIR, which is put on its
PYTHONPATH so that spec.data.transform can name a module there (README, Preprocessing)."""

# --- paths and ports -----------------------------------------------------------
SOCKET_DIR = "/var/run/splitfeed"
"""The shared memory volume in both containers: the ZeroMQ ipc socket and the ring's slot files."""
CONFIG_DIR = "/etc/splitfeed/config"
CONFIG_FILE = "config.json"
PODINFO_DIR = "/etc/splitfeed/podinfo"
PODINFO_ANNOTATIONS = "annotations"
PODINFO_LABELS = "labels"
STORAGE_DIR = "/etc/splitfeed/storage"
TRANSFORMS_DIR = "/etc/splitfeed/transforms"
TERMINATION_LOG = "/dev/termination-log"
KEYS_DIR = "/etc/splitfeed/keys"
"""Where a pod's sidecar and trainers find the job's keypair (the job's Secret, read-only)."""
KEY_PUBLIC, KEY_SECRET = "public.key", "secret.key"
"""The keypair's two files (and the job Secret's two keys): Z85 text, 40 characters each."""
MASTER_PORT = 29500
"""torch.distributed's rendezvous on replica 0."""
COORDINATOR_PORT = 29501
METRICS_PORT = 29502
"""The sidecar's /metrics port in a pod (container port `metrics`)."""
"""Replica 0's sidecar binds the world's agreement coordinator here (docs/agreement.md)."""

# --- environment ---------------------------------------------------------------
WORLD_SIZE = "WORLD_SIZE"
NODE_RANK = "NODE_RANK"
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT_ENV = "MASTER_PORT"
SOCKET_DIR_ENV = "SPLITFEED_SOCKET_DIR"
WORLD_EPOCH_ENV = "SPLITFEED_WORLD_EPOCH"
RESUME_ENV = "SPLITFEED_RESUME"
RESUME_STEP_ENV = "SPLITFEED_RESUME_STEP"
JOB_UID_ENV = "SPLITFEED_JOB_UID"
TABLE_VERSION_ENV = "SPLITFEED_TABLE_VERSION"
COORDINATOR_ENV = "SPLITFEED_COORDINATOR"
CONFIG_CHECKSUM_ENV = "SPLITFEED_CONFIG_CHECKSUM"
STATS_FILE_ENV = "SPLITFEED_STATS_FILE"
METRICS_PORT_ENV = "SPLITFEED_METRICS_PORT"
"""Where the sidecar serves Prometheus /metrics (docs/observability.md); 0: off."""
"""Only `splitfeed local` sets it: where a trainer's client writes its StatsRecord."""
KEYS_DIR_ENV = "SPLITFEED_KEYS_DIR"
"""A directory holding the job's CURVE keypair (trainer_client.keys): every socket to the
world's coordinator is encrypted and admitted with it (docs/security.md)."""

LOCAL_JOB_UID = "local"
"""SPLITFEED_JOB_UID in `splitfeed local`: runs of one job file resume each other."""
RESUMES = ("latest", "none")
"""SPLITFEED_RESUME's values: from the newest complete checkpoint, or from global step 0."""
RESUME_LATEST, RESUME_NONE = RESUMES
LOOPBACK = "127.0.0.1"
"""MASTER_ADDR of a world on one machine (the default), and where `splitfeed local` binds."""
ALL_INTERFACES = "0.0.0.0"
"""Where the operator's and sidecars' HTTP servers (webhook, /metrics) listen in a pod."""

Env = dict[str, str]


def rank_env(
    *, world_size: int, gpus_per_replica: int, replica: int, local_rank: int, master_addr: str,
    master_port: int, socket_dir: str, world_epoch: int,
) -> Env:
    """The variables every container of a replica gets (docs/pod-contract.md, "Environment").

    The one builder behind the operator's pods and `splitfeed local`'s processes, so
    a trainer sees the same environment in both. A pod has one process per replica
    (local_rank 0; torchrun sets the others' own); `splitfeed local` starts one per rank.
    """
    return {
        WORLD_SIZE: str(world_size),
        NODE_RANK: str(replica),
        RANK: str(replica * gpus_per_replica + local_rank),
        LOCAL_RANK: str(local_rank),
        LOCAL_WORLD_SIZE: str(gpus_per_replica),
        MASTER_ADDR: master_addr,
        MASTER_PORT_ENV: str(master_port),
        SOCKET_DIR_ENV: socket_dir,
        WORLD_EPOCH_ENV: str(world_epoch),
    }


def sidecar_env(
    *, coordinator: str, job_uid: str, resume_step: int | None, resume: str = RESUME_LATEST,
    table_version: int | None = None, config_checksum: str | None = None,
) -> Env:
    """What only the sidecar gets on top of `rank_env`: where the world starts, who it works for.

    `resume_step` (the step the previous world agreed on) replaces `resume`: with it
    every sidecar loads exactly that step; without it the coordinator picks (`latest`)
    or starts at 0 (`none`).
    """
    env: Env = {RESUME_ENV: resume} if resume_step is None else {RESUME_STEP_ENV: str(resume_step)}
    env[COORDINATOR_ENV] = coordinator
    env[JOB_UID_ENV] = job_uid
    if table_version is not None:
        env[TABLE_VERSION_ENV] = str(table_version)
    if config_checksum is not None:
        env[CONFIG_CHECKSUM_ENV] = config_checksum
    return env


# --- records -------------------------------------------------------------------
class LastCheckpoint(TypedDict):
    """The newest step this sidecar's ranks committed (the report's `lastCheckpoint`)."""

    step: int
    epoch: int
    worldSize: int
    time: str
    """UTC, ISO 8601, when the commit arrived."""


class Report(TypedDict, total=False):
    """The sidecar's one JSON line in its termination log, as the sidecar writes it; the operator
    reads it from the container's `state.terminated.message` through `SidecarReport.parse`, never
    by these keys. A sidecar that cannot start writes only some fields (hence total=False)."""

    globalStep: int
    epoch: int
    step: int
    stepsPerEpoch: int
    lastCheckpoint: LastCheckpoint | None
    drained: bool
    agreedStep: int | None
    drainReason: str | None
    resumeStep: int
    tableVersion: int | None
    error: str | None
    permanent: bool
    filledRows: int
    """Rows whose transform failed and were replaced (spec.data.onTransformError: fill)."""
    skippedRows: int
    """Rows whose transform failed and were dropped (spec.data.onTransformError: skip, warn)."""
    completeStep: int | None
    """Replica 0's only: the newest step every member of its world committed, as its coordinator
    counted (a dead member sidecar's ranks through the coordinator included: sidecar.standins)."""


REPORT_FIELDS: tuple[str, ...] = tuple(Report.__annotations__)
LAST_CHECKPOINT_FIELDS: tuple[str, ...] = tuple(LastCheckpoint.__annotations__)


def _wire_name(field: str) -> str:
    """global_step -> globalStep: the report's JSON spelling of an attribute."""
    head, *rest = field.split("_")
    return head + "".join(word.title() for word in rest)


@functools.cache
def _hints(cls: type[Any]) -> dict[str, tuple[type, ...]]:
    """Per wire field of dataclass `cls`: its attribute and the types its annotation allows."""
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) or (hints[f.name],)
            for f in dataclasses.fields(cls) if f.metadata.get("wire", True)}


def _build(cls: Any, where: str, raw: Any, **extra: Any) -> Any:
    """A `cls` (a frozen dataclass) from the JSON object `raw`, each field checked against its annotation.

    An absent field keeps its default (a sidecar that could not start writes few); a field
    this version does not know is ignored (a newer sidecar may write more); a present field
    of another type, or an absent one without a default, is a ProtocolError. A bool is not
    an int; a nested dataclass is built the same way.
    """
    if not isinstance(raw, Mapping):
        raise ProtocolError(f"{where} is not a JSON object")
    out: dict[str, Any] = dict(extra)
    for name, allowed in _hints(cls).items():
        key = _wire_name(name)
        if key not in raw:
            continue
        value = raw[key]
        nested = next((t for t in allowed if dataclasses.is_dataclass(t)), None)
        if nested is not None and isinstance(value, Mapping):
            out[name] = _build(nested, f"{where}.{key}", value)
        elif (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
            names = " | ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise ProtocolError(f"{where}.{key} is {json.dumps(value)[:40]}, not {names}")
        else:
            out[name] = value
    missing = [_wire_name(f.name) for f in dataclasses.fields(cls)
               if f.name not in out and f.default is dataclasses.MISSING]
    if missing:
        raise ProtocolError(f"{where} has no {', '.join(missing)}")
    return cls(**out)


@dataclasses.dataclass(frozen=True)
class ReportedCheckpoint:
    """A report's `lastCheckpoint`, typed (what the sidecar writes is a LastCheckpoint)."""

    step: int
    epoch: int | None = None
    world_size: int | None = None
    time: str | None = None


@dataclasses.dataclass(frozen=True)
class SidecarReport:
    """A sidecar's termination report as the operator reads it: parsed once (`parse`), validated, typed.

    `Report` is what the sidecar writes; this is what a reader gets. Every field may be
    absent from the text (a sidecar that cannot start writes only `globalStep`,
    `lastCheckpoint`, `drained`, `agreedStep`, `error` and `permanent`): absent counts are
    None, absent flags False. Attributes are the report's fields in snake case.
    """

    global_step: int | None = None
    epoch: int | None = None
    step: int | None = None
    steps_per_epoch: int | None = None
    last_checkpoint: ReportedCheckpoint | None = None
    drained: bool = False
    agreed_step: int | None = None
    drain_reason: str | None = None
    resume_step: int | None = None
    table_version: int | None = None
    error: str | None = None
    permanent: bool = False
    filled_rows: int = 0
    skipped_rows: int = 0
    complete_step: int | None = None
    finished_at: str | None = dataclasses.field(default=None, metadata={"wire": False})
    """Not in the text: when the sidecar's container terminated (its state's `finishedAt`), set by
    the reader that found the report."""

    WIRE_FIELDS: ClassVar[tuple[str, ...]] = ()
    """The JSON fields `parse` reads (REPORT_FIELDS; tests/unit/test_contract.py keeps them equal)."""

    @classmethod
    def parse(cls, text: str, finished_at: str | None = None) -> SidecarReport | None:
        """The report in a termination message (its last line); None without one, or for one
        that is not a valid report (a ProtocolError says why in `from_text`)."""
        try:
            return cls.from_text(text, finished_at)
        except ProtocolError:
            return None

    @classmethod
    def from_text(cls, text: str, finished_at: str | None = None) -> SidecarReport:
        """Like `parse`, but a ProtocolError says what is wrong with the text."""
        lines = text.strip().splitlines()
        if not lines:
            raise ProtocolError("the termination message is empty")
        try:
            raw = json.loads(lines[-1])
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(f"the termination message is not JSON: {str(exc)[:200]}") from None
        report: SidecarReport = _build(cls, "report", raw, finished_at=finished_at)
        return report


SidecarReport.WIRE_FIELDS = tuple(
    _wire_name(f.name) for f in dataclasses.fields(SidecarReport) if f.metadata.get("wire", True))


class StatsRecord(TypedDict):
    """What a trainer's client writes to $SPLITFEED_STATS_FILE (replaced whole, now and then);
    `splitfeed local` reads it for progress and its closing summary."""

    batches: int
    rows: int
    wait_s: float
    elapsed_s: float
    last_step: int
    trained: int | None
    """Global steps trained where the loop said so (StreamClient.trained), else None."""
    total_steps: int
    steps_per_epoch: int
    final: bool
    data_ready_buckets: list[int]
    """Data-ready latency counts per stalls.BUCKETS_S bucket (docs/observability.md)."""


STATS_FIELDS: tuple[str, ...] = tuple(StatsRecord.__annotations__)
