"""Who a sidecar works for: the job's UID, its world, and the table version it pinned.

Read from the pod's environment (docs/pod-contract.md). The UID keys the job's
checkpoints, so a deleted and re-created job never resumes what the old one
wrote; the world epoch fences checkpoints of replaced worlds; the pinned table
version, once the operator has recorded it (status.data.tableVersion), makes
every later world open the same version as the first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from splitfeed.trainer_client.contract import wellknown, errors

JOB_UID_ENV = wellknown.JOB_UID_ENV
WORLD_EPOCH_ENV = wellknown.WORLD_EPOCH_ENV
TABLE_VERSION_ENV = wellknown.TABLE_VERSION_ENV
LOCAL_UID = wellknown.LOCAL_JOB_UID
"""The UID `splitfeed local` gives a job: runs of one job file resume each other."""


@dataclasses.dataclass(frozen=True)
class Identity:
    uid: str
    """The StreamingJob's metadata.uid (`splitfeed local`: a fixed local id)."""
    world_epoch: int
    table_version: int | None
    """The version the job pinned when it first started; None until it is recorded."""


def from_env(env: Mapping[str, str], *, need_uid: bool = True) -> Identity:
    """The identity in `env`; a missing or malformed variable is a UserError naming it.

    `need_uid=False` lets the UID be absent (""), for a caller that learns only later
    whether the job has spec.checkpoint.uri; it then calls `required`.
    """
    uid = env.get(JOB_UID_ENV, "").strip()
    if "/" in uid or uid in (".", ".."):
        raise errors.UserError(f"{JOB_UID_ENV}={uid!r} cannot name a checkpoint directory")
    found = Identity(uid, _int(env, WORLD_EPOCH_ENV) or 0, _int(env, TABLE_VERSION_ENV))
    return required(found) if need_uid else found


def required(found: Identity) -> Identity:
    """`found`, if it has a UID: a job with spec.checkpoint.uri cannot do without one."""
    if not found.uid:
        raise errors.UserError(
            f"{JOB_UID_ENV} is not set: the operator sets it to the StreamingJob's metadata.uid "
            "(checkpoints are kept per job UID); `splitfeed local` sets a fixed one")
    return found


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise errors.UserError(f"{name}={raw!r} is not a non-negative integer")
    return value
