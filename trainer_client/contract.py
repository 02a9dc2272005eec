"""The pod contract as code: what the operator puts into a pod and what runs in it expects.

One home for the names both sides spell: the CRD's coordinates, labels and
annotations, container and volume names, paths, ports, the `SPLITFEED_*`
environment, the sidecar's termination report and the trainer's stats record.
The operator (which builds pods), the sidecar and `splitfeed local` (which build
the same environment for local processes) and the trainer client import it, so
it lives in the lowest layer and is pure: no I/O, standard library only.
docs/pod-contract.md describes the same names in prose; tests/unit/test_contract.py
fails when the two drift apart.
"""

from __future__ import annotations

from typing import TypedDict

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
RESERVED_VOLUMES = (VOLUME_SHM, VOLUME_CONFIG, VOLUME_PODINFO, VOLUME_STORAGE)
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

LOCAL_JOB_UID = "local"
"""SPLITFEED_JOB_UID in `splitfeed local`: runs of one job file resume each other."""

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
    *, coordinator: str, job_uid: str, resume_step: int | None, resume: str = "latest",
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
    """The sidecar's one JSON line in its termination log; the operator reads it from the
    container's `state.terminated.message`. A sidecar that cannot start writes only some
    fields (hence total=False); readers treat every field as optional."""

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


REPORT_FIELDS: tuple[str, ...] = tuple(Report.__annotations__)
LAST_CHECKPOINT_FIELDS: tuple[str, ...] = tuple(LastCheckpoint.__annotations__)


class StatsRecord(TypedDict):
    """What a trainer's client writes to $SPLITFEED_STATS_FILE (replaced whole, now and then);
    `splitfeed local` reads it for progress and its closing summary."""

    batches: int
    rows: int
    wait_s: float
    elapsed_s: float
    last_step: int
    total_steps: int
    steps_per_epoch: int
    final: bool
    data_ready_buckets: list[int]
    """Data-ready latency counts per stalls.BUCKETS_S bucket (docs/observability.md)."""


STATS_FIELDS: tuple[str, ...] = tuple(StatsRecord.__annotations__)
