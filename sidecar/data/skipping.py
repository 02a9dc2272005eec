"""A skip job's bookkeeping: where its splits stand, and the rows each step passed over.

Under onTransformError=skip/warn a step no longer fixes the splits' positions: each split's
position also counts the failing rows it dropped. The rank reader (sidecar/data/reading.py)
numbers lancedb's guarded rows into steps with `epoch_steps`, from each split's resume position
(`split_starts`), and carries what each step passed in its block's metadata (`put_positions`),
which the sidecar takes off again (`take_positions`) for its checkpoints and skippedRows.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa

from splitfeed.trainer_client.contract import errors, specs

from . import positions, preprocessing, streaming

log = logging.getLogger(__name__)


SKIPPED_ROWS = [0]
"""Rows dropped by onTransformError=skip/warn before the rows of the steps this sidecar
published (counted by the sidecar as it publishes, from each step's `Passed.skipped`)."""

POSITIONS_KEY = b"splitfeed.positions"
"""Schema metadata of a skip job's block: JSON {"at": [[split, position], ...], "skipped": n},
each split's permutation position after the block's last row (lancedb's
positions_consumed_per_split) and the failing rows dropped in between. Only between the
reader and the sidecar: `take_positions` strips it before the ring."""


class Passed(typing.NamedTuple):
    """What a skip job's step passed: its splits' positions after it, and the rows dropped."""

    at: dict[int, int]
    skipped: int


def take_positions(block: pa.RecordBatch) -> tuple[pa.RecordBatch, Passed | None]:
    """A block without its positions metadata, and what it passed (None for other jobs)."""
    metadata = block.schema.metadata or {}
    if POSITIONS_KEY not in metadata:
        return block, None
    found = json.loads(metadata[POSITIONS_KEY])
    rest = {k: v for k, v in metadata.items() if k != POSITIONS_KEY}
    passed = Passed({int(s): int(p) for s, p in found["at"]}, int(found["skipped"]))
    return block.replace_schema_metadata(rest or None), passed


def put_positions(block: pa.RecordBatch, passed: Passed) -> pa.RecordBatch:
    """`block` carrying what its step passed in its POSITIONS_KEY metadata (`take_positions` reads it)."""
    found = {"at": sorted(passed.at.items()), "skipped": passed.skipped}
    metadata = {**(block.schema.metadata or {}), POSITIONS_KEY: json.dumps(found).encode()}
    return block.replace_schema_metadata(metadata)


def split_starts(data: specs.DataSpec, splits: Sequence[int], pos: positions.Position,
                 state: Mapping[str, Any] | None) -> list[int]:
    """Where each split of `splits` resumes in the epoch of `pos` under skip: 0 at an epoch
    start, else the checkpoint's per-split positions (a step no longer fixes them)."""
    if pos.step == 0:
        return [0] * len(splits)
    if state is None:
        raise errors.UserError(
            f"onTransformError={data.on_transform_error}: resuming at step {pos.step} of epoch "
            f"{pos.epoch} needs the checkpoint's per-split positions, and none was given")
    found = positions.position_from_state(data, state)
    if found != pos:
        raise errors.UserError(
            f"the checkpoint holds epoch {found.epoch} step {found.step}, not epoch {pos.epoch} "
            f"step {pos.step}")
    at = list(state["positions_consumed_per_split"])
    return [int(at[s]) for s in splits]


def guarded_rows(
    table: Any, data: specs.DataSpec, splits: Sequence[int], pos: positions.Position, floor: int,
    guarded: preprocessing.Guarded,
) -> Iterator[Any]:
    """lancedb's guarded rows of these splits in the epoch of `pos`, every split from `floor`.

    lancedb's round-robin stops at the first split that runs dry, and under Guarded
    that is the first whose rows run out: resumed at unequal positions, a split
    started early would lose its last rows. Every split resumes at the lowest of
    their positions, `floor` (rows before a split's own are read again and passed
    over), so they still run out together.
    """
    m = len(splits)
    dataset = streaming.streaming_dataset(
        table, data, epoch=pos.epoch, rank=splits[0] // m, world_size=data.num_splits // m,
        transform=guarded, blocks=None,
    )
    if pos.step:
        dataset.load_state_dict(_skip_state(data, pos, splits, [floor] * m))
    return iter(dataset)


def _skip_state(data: specs.DataSpec, pos: positions.Position, splits: Sequence[int],
                starts: Sequence[int]) -> dict[str, Any]:
    """What lancedb resumes these splits from: the uniform row count of `pos`, and each
    split's own position (later than the count by its skipped rows)."""
    return positions.state_after(data, pos, dict(zip(splits, starts)))


def epoch_steps(
    rows_iter: Iterator[Any], data: specs.DataSpec, splits: Sequence[int], starts: Sequence[int],
    cycles: int, epoch: int, name: str, first: int = 0,
) -> Iterator[tuple[list[Any], dict[int, int], int]]:
    """Each step's rows (reference order), the splits' positions after it and the rows it
    dropped, until a split cannot give `cycles` more surviving rows. `rows_iter` starts
    every split at position `first`; split i's rows before `starts[i]` were consumed already."""
    m = len(splits)
    ready: list[collections.deque[tuple[int, Any]]] = [collections.deque() for _ in splits]
    failed: list[collections.deque[tuple[int, preprocessing.Failed]]] = [
        collections.deque() for _ in splits]
    next_position = [first] * m
    after = list(starts)
    exhausted = False
    while True:
        while not exhausted and any(len(q) < cycles for q in ready):
            cycle = list(itertools.islice(rows_iter, m))
            if len(cycle) < m:
                exhausted = True  # Guarded drops nothing, so the splits end together
                break
            for i, row in enumerate(cycle):
                if next_position[i] >= starts[i]:
                    where = failed[i] if isinstance(row, preprocessing.Failed) else ready[i]
                    where.append((next_position[i], row))
                next_position[i] += 1
        if any(len(q) < cycles for q in ready):
            return
        taken = [[ready[i].popleft() for _ in range(cycles)] for i in range(m)]
        skipped = 0
        for i in range(m):
            after[i] = taken[i][-1][0] + 1
            while failed[i] and failed[i][0][0] < after[i]:
                position, row = failed[i].popleft()
                _skipped(data, name, epoch, splits[i], position, row)
                skipped += 1
        rows = [taken[i][c][1] for c in range(cycles) for i in range(m)]
        yield rows, {splits[i]: after[i] for i in range(m)}, skipped


def _skipped(data: specs.DataSpec, name: str, epoch: int, split: int, position: int,
             row: preprocessing.Failed) -> None:
    if data.on_transform_error == "warn":
        log.warning(
            "spec.data.transform=%r failed on position %d of split %d in epoch %d (%s: %s); "
            "row skipped", name, position, split, epoch, type(row.error).__name__, row.error)
