"""Data positions: global step <-> (epoch, step) <-> StreamingDataset state dicts.

Pure. At a step boundary every split has consumed the same number of rows
(G / N per step), so a position is fully described by (epoch, step), except under
onTransformError=skip/warn, where each split's permutation position also counts the
rows it skipped and the state carries them per split (`state_after`); the state
dicts written into checkpoints are in `StreamingDataset.state_dict()`'s format
so that `StreamingDataset.merge_state_dicts` and `load_state_dict` accept them,
and tests compare them with what lancedb itself reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from splitfeed.trainer_client.contract import errors, geometry, specs


@dataclasses.dataclass(frozen=True)
class Position:
    """The next batch to deliver: epoch `epoch`, step `step` within it."""

    epoch: int
    step: int


def position_of(global_step: int, steps_per_epoch: int) -> Position:
    if steps_per_epoch < 1:
        raise ValueError("an epoch must hold at least one step")
    return Position(*divmod(global_step, steps_per_epoch))


def state_dict(data: specs.DataSpec, position: Position) -> dict[str, Any]:
    """The StreamingDataset state after every step before `position` was consumed."""
    consumed = position.step * geometry.Geometry.of(data).rows_per_split_per_step
    return {
        "shuffle_seed": data.shuffle_seed,
        "num_splits": data.num_splits,
        "epoch": position.epoch,
        "samples_consumed_per_split": [consumed] * data.num_splits,
        "positions_consumed_per_split": [consumed] * data.num_splits,
    }


def state_after(data: specs.DataSpec, position: Position, at: Mapping[int, int]) -> dict[str, Any]:
    """A rank's state at `position` of a skip job: the uniform row count, and the exact
    positions of the splits in `at` (the rank's own; the rest stay at the row count, a lower
    bound, so `StreamingDataset.merge_state_dicts`' elementwise maximum recovers every split)."""
    state = state_dict(data, position)
    held = list(state["positions_consumed_per_split"])
    for split, value in at.items():
        held[split] = int(value)
    state["positions_consumed_per_split"] = held
    return state


class IncompatibleState(errors.SplitfeedError, ValueError):
    """A checkpoint state that cannot continue this job (other seed, splits, ...)."""


def position_from_state(data: specs.DataSpec, state: Mapping[str, Any]) -> Position:
    """Where to continue from a (merged) state dict; refuses partial steps."""
    for key, ours in (("num_splits", data.num_splits), ("shuffle_seed", data.shuffle_seed)):
        if state.get(key) != ours:
            raise IncompatibleState(
                f"checkpoint has {key}={state.get(key)!r} but the job has {ours!r}; "
                "a checkpoint only resumes the job that wrote it"
            )
    samples = list(state.get("samples_consumed_per_split") or [])
    positions = list(state.get("positions_consumed_per_split") or samples)
    # Under onTransformError=skip/warn a split's position runs ahead of its row count
    # by the rows it skipped; otherwise the two are equal.
    skipping = data.drops_rows
    if (len(samples) != data.num_splits or len(set(samples)) != 1 or len(positions) != len(samples)
            or (positions != samples and not (skipping and all(
                int(p) >= int(c) for p, c in zip(positions, samples))))):
        raise IncompatibleState(
            "checkpoint is not at a global step boundary "
            f"(samples_consumed_per_split={samples[:8]}...)"
        )
    per_step = geometry.Geometry.of(data).rows_per_split_per_step
    consumed = samples[0]
    if consumed % per_step:
        raise IncompatibleState(
            f"checkpoint consumed {consumed} rows per split, not a multiple of "
            f"globalBatchSize/numSplits={per_step}; was globalBatchSize changed?"
        )
    return Position(int(state["epoch"]), consumed // per_step)
