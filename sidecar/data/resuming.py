"""Where a world resumes: the table version an earlier world pinned, the global step its
coordinator chooses once from the job's checkpoints (docs/agreement.md), and that step's
merged state, checked against the data position it holds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from splitfeed.trainer_client.contract import wellknown, errors, specs

from ..world import checkpoints
from . import positions, streaming

log = logging.getLogger(__name__)


def choose_version(recorded: int | None, stores: list[checkpoints.Store]) -> int | None:
    """The table version the job reads start to end, if an earlier world already fixed it:
    the one the operator `recorded` (status.data.tableVersion), else the one a store pinned."""
    if recorded is not None:
        return recorded
    for store in stores:
        version = store.pinned_version()
        if version is not None:
            return version
    return None


def choose_resume_step(data: specs.DataSpec, stores: list[checkpoints.Store], expect: Mapping[str, Any], *,
                       recorded: int | None, resume: str, uri: str | None) -> int:
    """The world's resume step, decided once by its coordinator: the one the operator
    `recorded`, else (`resume` latest) the newest complete checkpoint under `uri`, else 0."""
    if recorded is not None:
        log.info("resuming at global step %d, as the operator recorded", recorded)
        return recorded
    if resume == wellknown.RESUME_NONE or not stores:
        return 0
    found = checkpoints.newest(stores, streaming.merge_states, expect=expect,
                               accept=lambda s: positions.position_from_state(data, s))
    if found is None:
        log.info("no complete checkpoint under %s: starting at step 0", uri)
        return 0
    log.info("the world resumes at global step %d, the newest complete checkpoint (%d ranks)",
             found.step, found.world_size)
    return found.step


def check_resume_step(data: specs.DataSpec, stores: list[checkpoints.Store], step: int,
                      steps_per_epoch: int, expect: Mapping[str, Any]) -> dict[str, Any] | None:
    """Load exactly the world's resume step (its merged state); a store that disagrees is an
    error, never a guess."""
    if step == 0:
        return None
    if not stores:
        raise errors.UserError(
            f"the world resumes at global step {step} but the job has no spec.checkpoint.uri")
    merged = checkpoints.load(stores, step, streaming.merge_states, expect=expect)
    position = positions.position_from_state(data, merged)
    if position.epoch * steps_per_epoch + position.step != step:
        raise errors.UserError(
            f"checkpoint step {step} holds the position of epoch {position.epoch} step "
            f"{position.step}, not global step {step}")
    return merged
