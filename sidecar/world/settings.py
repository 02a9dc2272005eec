"""Where this pod's sidecar stands: its world, its ranks in that world, and the paths and
ports it is given (read from the pod's environment by `main.settings_from_env`).

A frozen value: a world changed in place is a new one (sidecar.world.transitions).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from splitfeed.trainer_client.contract import wellknown, errors, layout


@dataclasses.dataclass(frozen=True)
class SidecarSettings:
    config: Path
    socket_dir: Path
    rank: int = 0
    """Global rank of this pod's first local rank."""
    world_size: int = 1
    local_world_size: int = 1
    resume: str = wellknown.RESUME_LATEST
    resume_step: int | None = None
    """The world's resume step, chosen by the operator (SPLITFEED_RESUME_STEP); None: the coordinator chooses."""
    replica: int | None = None
    """This pod's replica index (NODE_RANK); default rank // local_world_size."""
    coordinator: str | None = None
    """tcp://HOST:PORT of replica 0's coordinator (SPLITFEED_COORDINATOR); replica 0 binds its port."""
    job_uid: str = ""
    """The StreamingJob's metadata.uid (SPLITFEED_JOB_UID): its checkpoints are its own."""
    world_epoch: int = 0
    """The world this sidecar belongs to (SPLITFEED_WORLD_EPOCH): fences older worlds' checkpoints."""
    table_version: int | None = None
    """The table version the job pinned, once the operator recorded it (SPLITFEED_TABLE_VERSION)."""
    checksum: str | None = None
    podinfo_dir: Path | None = None
    storage_options_dir: Path | None = None
    termination_log: Path | None = None
    metrics_port: int | None = None
    """Where /metrics is served (SPLITFEED_METRICS_PORT; 0: any free port); None: not at all."""
    master_addr: str = wellknown.LOOPBACK
    master_port: int = wellknown.MASTER_PORT
    """The trainers' rendezvous (MASTER_ADDR, MASTER_PORT): told to them again in a world changed in place."""
    after_loss: bool = False
    """This world follows in place one that lost member pods (no drain): trainers still in an
    earlier world are stopped (membership.World.after_loss)."""
    keys_dir: Path | None = None
    """The job's CURVE keypair (SPLITFEED_KEYS_DIR): without it no coordinator or member starts."""


def replicas_of(settings: SidecarSettings) -> int:
    """The replicas (pods) of this pod's world."""
    return max(1, settings.world_size // max(1, settings.local_world_size))


def replica_of(settings: SidecarSettings) -> int:
    """This pod's replica index in its world."""
    if settings.replica is not None:
        return settings.replica
    return settings.rank // max(1, settings.local_world_size)


def local_ranks(settings: SidecarSettings) -> range:
    """The global ranks of this pod's trainers."""
    return range(settings.rank, settings.rank + settings.local_world_size)


def coordinator_addresses(settings: SidecarSettings) -> tuple[str, str]:
    """(what replica 0 binds, what members connect to); a lone sidecar picks a free port."""
    if settings.coordinator is None:
        if replicas_of(settings) > 1:
            raise errors.UserError(
                "SPLITFEED_COORDINATOR is not set: a world of several replicas needs replica 0's "
                "coordinator address (the operator and `splitfeed local` set it)")
        return f"tcp://{wellknown.LOOPBACK}:*", ""
    _, port = layout.parse_coordinator(settings.coordinator)  # UserError where it is not tcp://HOST:PORT
    return f"tcp://*:{port}", settings.coordinator
