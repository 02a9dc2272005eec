"""The determinism contract (docs/architecture.md) against StreamingDataset itself.

Rank r's batch k of epoch e must be rows [k*B, (k+1)*B) of
`StreamingDataset(..., epoch=e, rank=r, world_size=W)` iterated in-process,
truncated to whole global steps, for every world size and worker count; state
dicts must be the ones lancedb reports and accepts. One table serves every
case; runs and reference orders are memoised per module, because the same
full run answers several questions. Worker processes cost seconds to spawn
(lancedb imports torch), so only a few configurations use them.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
from typing import Any

import pytest
from lancedb.streaming import StreamingDataset

from splitfeed.sidecar.data import positions, streaming
from splitfeed.sidecar.forks import workers
from splitfeed.trainer_client.contract import errors, specs, topology

from tests.reading.tables import (
    NUM_ROWS,
    as_rows,
    data_spec,
    ids_of,
    open_reference_table,
    reference_rows,
    whole_batches,
)

N = 24
WORLD_SIZES = [1, 2, 3, 4, 6, 8, 12, 24]
VALID_FOR_24 = "[1, 2, 3, 4, 6, 8, 12, 24]"

Batches = list[tuple[int, Any]]


class Memo:
    """Full runs of splitfeed and StreamingDataset orders, each computed once."""

    def __init__(self) -> None:
        self._ours: dict[tuple[str, int, int], Batches] = {}
        self._refs: dict[tuple[str, int, int, int], list[dict[str, Any]]] = {}

    def ours(self, data: specs.DataSpec, rank: int, world_size: int) -> Batches:
        key = (repr(data), rank, world_size)
        if key not in self._ours:
            self._ours[key] = list(workers.iter_rank_batches(
                data, {}, rank=rank, world_size=world_size, start_global_step=0
            ))
        return self._ours[key]

    def reference(self, data: specs.DataSpec, epoch: int, rank: int, world_size: int) -> list[dict[str, Any]]:
        key = (repr(data), epoch, rank, world_size)
        if key not in self._refs:
            self._refs[key] = reference_rows(data, epoch=epoch, rank=rank, world_size=world_size)
        return self._refs[key]

    def steps_per_epoch(self, data: specs.DataSpec) -> int:
        """Whole global steps per epoch, counted on the reference (world size 1)."""
        return len(self.reference(data, 0, 0, 1)) // data.global_batch_size


@pytest.fixture(scope="module")
def memo() -> Memo:
    return Memo()


def check_world_matches_reference(memo: Memo, data: specs.DataSpec, world_size: int) -> None:
    """Every rank: batch order == reference per epoch, same step count everywhere."""
    batch_size = data.global_batch_size // world_size
    steps_of_rank = []
    for rank in range(world_size):
        run = memo.ours(data, rank, world_size)
        steps_of_rank.append([step for step, _ in run])
        expected = []
        for epoch in range(data.epochs):
            reference = memo.reference(data, epoch, rank, world_size)
            expected += whole_batches(reference, batch_size)
        assert [len(batch) for _, batch in run] == [batch_size] * len(run)
        assert [as_rows(batch) for _, batch in run] == expected, f"rank {rank}"
    spe = memo.steps_per_epoch(data)
    assert spe >= 1
    assert steps_of_rank == [list(range(data.epochs * spe))] * world_size


def step_id_sets(memo: Memo, data: specs.DataSpec, world_size: int) -> list[frozenset[int]]:
    """The ids of each global step, gathered over ranks; ranks never overlap."""
    per_rank = [memo.ours(data, rank, world_size) for rank in range(world_size)]
    sets = []
    for batches in zip(*per_rank):
        ids = [i for _, batch in batches for i in ids_of(batch)]
        assert len(ids) == len(set(ids)) == data.global_batch_size
        sets.append(frozenset(ids))
    return sets


# --- topology ----------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [5, 7], ids=lambda w: f"W={w}")
def test_a_world_size_that_does_not_divide_the_splits_is_rejected_with_the_valid_ones(
    db_uri: str, world_size: int
) -> None:
    with pytest.raises(topology.TopologyError) as info:
        topology.check(replicas=world_size, gpus_per_replica=1, num_splits=N,
                       num_workers=1, global_batch_size=48)
    assert VALID_FOR_24 in str(info.value)
    with pytest.raises(errors.UserError, match=r"numSplits=24 is not divisible") as info:
        workers.iter_rank_batches(data_spec(db_uri), {}, rank=0, world_size=world_size,
                                  start_global_step=0)
    assert VALID_FOR_24 in str(info.value)


# --- batch order ---------------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda w: f"W={w}")
def test_every_rank_yields_the_reference_order_over_two_epochs(
    memo: Memo, db_uri: str, world_size: int
) -> None:
    check_world_matches_reference(memo, data_spec(db_uri), world_size)


@pytest.mark.parametrize(
    ("overrides", "world_size"),
    [
        pytest.param({"filter": "label != 3"}, 3, id="filter-W=3"),
        pytest.param({"filter": "id % 7 != 0", "columns": ("vec", "id")}, 2,
                     id="filter-columns-W=2"),
        pytest.param({"shuffle_clump_size": 8}, 4, id="clump-W=4"),
        pytest.param({"shuffle_clump_size": 5, "filter": "label < 8"}, 2, id="clump-filter-W=2"),
        pytest.param({"shuffle": False}, 4, id="no-shuffle-W=4"),
        pytest.param({"global_batch_size": 72, "read_batch_size": 5}, 3,
                     id="odd-read-batch-W=3"),
    ],
)
def test_every_rank_yields_the_reference_order_for_job_variants(
    memo: Memo, db_uri: str, overrides: dict[str, Any], world_size: int
) -> None:
    # One epoch each (the epoch switch is exercised above), except without
    # shuffling, where the second epoch must repeat the first (below).
    epochs = 2 if overrides.get("shuffle") is False else 1
    check_world_matches_reference(memo, data_spec(db_uri, epochs=epochs, **overrides), world_size)


def test_rows_that_cannot_fill_a_global_step_are_not_delivered(memo: Memo, db_uri: str) -> None:
    data = data_spec(db_uri)
    assert NUM_ROWS % N  # lancedb drops the surplus ...
    reference = memo.reference(data, 0, 0, 1)
    spe = memo.steps_per_epoch(data)
    assert len(reference) > spe * data.global_batch_size  # ... and so do we, per step
    assert len(memo.ours(data, 0, 1)) == data.epochs * spe


def test_a_global_step_holds_the_same_rows_for_every_world_size(
    memo: Memo, db_uri: str
) -> None:
    data = data_spec(db_uri)
    expected = step_id_sets(memo, data, 1)
    for world_size in WORLD_SIZES[1:]:
        assert step_id_sets(memo, data, world_size) == expected, f"W={world_size}"


def test_each_epoch_reshuffles_when_shuffling(memo: Memo, db_uri: str) -> None:
    data = data_spec(db_uri)
    spe = memo.steps_per_epoch(data)
    sets = step_id_sets(memo, data, 1)
    assert sets[:spe] != sets[spe:]
    assert [r["id"] for r in memo.reference(data, 0, 0, 1)] != [
        r["id"] for r in memo.reference(data, 1, 0, 1)
    ]


def test_every_epoch_is_the_same_without_shuffling(memo: Memo, db_uri: str) -> None:
    data = data_spec(db_uri, shuffle=False, epochs=2)
    spe = memo.steps_per_epoch(data)
    run = [ids_of(batch) for _, batch in memo.ours(data, 1, 4)]
    assert run[:spe] == run[spe:]


# --- resuming ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "stop"),
    [(0, None), (7, None), (19, None), (20, None), (33, None), (5, 23), (39, 40)],
    ids=lambda v: str(v),
)
def test_resuming_at_a_step_yields_the_tail_of_a_full_run(
    memo: Memo, db_uri: str, start: int, stop: int | None
) -> None:
    data = data_spec(db_uri)
    full = memo.ours(data, 1, 3)
    resumed = list(workers.iter_rank_batches(
        data, {}, rank=1, world_size=3, start_global_step=start, stop_global_step=stop
    ))
    tail = full[start:stop]
    assert [step for step, _ in resumed] == [step for step, _ in tail]
    assert [as_rows(b) for _, b in resumed] == [as_rows(b) for _, b in tail]


def test_worker_processes_resume_in_reference_order_and_stop_when_closed(
    memo: Memo, db_uri: str
) -> None:
    # One spawn answers four questions (workers cost seconds to start): K=2
    # yields the reference order and the same rows per global step as K=1 (at
    # W=1 and W=4, and so at every W, above), resumes mid-epoch across an epoch
    # boundary, and closing the generator mid-stream ends both workers.
    base = data_spec(db_uri)  # numWorkers does not change the order
    # Epochs beyond what is compared: a worker whose last blocks all fit in its pipe
    # would send them, exit and no longer count as running mid-stream.
    data = data_spec(db_uri, num_workers=2, epochs=6)
    spe = memo.steps_per_epoch(base)
    start, stop = spe - 5, 2 * spe - 5
    before = set(multiprocessing.active_children())  # other tests' children, still exiting
    with contextlib.closing(workers.iter_rank_batches(
        data, {}, rank=0, world_size=1, start_global_step=start
    )) as batches:
        taken = [next(batches)]
        ours = set(multiprocessing.active_children()) - before
        pids = [child.pid for child in ours]
        assert len(pids) == 2
        taken += itertools.islice(batches, stop - start - 1)
    assert not ours & set(multiprocessing.active_children())
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert [step for step, _ in taken] == list(range(start, stop))
    expected = [
        batch
        for epoch in range(base.epochs)
        for batch in whole_batches(memo.reference(base, epoch, 0, 1), base.global_batch_size)
    ]
    assert [as_rows(b) for _, b in taken] == expected[start:stop]
    sets = [frozenset(ids_of(b)) for _, b in taken]
    for world_size in (1, 4):
        assert sets == step_id_sets(memo, base, world_size)[start:stop], f"W={world_size}"


# --- state dicts ---------------------------------------------------------------------


def reference_state(data: specs.DataSpec, *, epoch: int, rank: int, world_size: int,
                    step: int) -> dict[str, Any]:
    """StreamingDataset.state_dict() after rank `rank` consumed `step` whole batches."""
    table = open_reference_table(data)
    dataset = streaming.reference_dataset(table, data, epoch=epoch, rank=rank, world_size=world_size)
    batch_size = data.global_batch_size // world_size
    with contextlib.closing(iter(dataset)) as rows:
        consumed = sum(1 for _ in itertools.islice(rows, step * batch_size))
        assert consumed == step * batch_size
        return dataset.state_dict()


@pytest.mark.parametrize(
    ("world_size", "rank", "epoch", "step"),
    [(1, 0, 0, 5), (4, 1, 0, 3), (4, 3, 1, 0), (6, 5, 0, 19), (3, 2, 1, 20)],
    ids=lambda v: str(v),
)
def test_our_state_dict_is_the_one_streaming_dataset_reports(
    db_uri: str, world_size: int, rank: int, epoch: int, step: int
) -> None:
    data = data_spec(db_uri)
    position = positions.Position(epoch, step)
    ours = positions.state_dict(data, position)
    assert ours == reference_state(data, epoch=epoch, rank=rank, world_size=world_size, step=step)
    assert positions.position_from_state(data, ours) == position


@pytest.mark.parametrize(("world_size", "epoch", "step"), [(4, 0, 7), (3, 1, 13)],
                         ids=lambda v: str(v))
def test_merged_rank_states_equal_ours(db_uri: str, world_size: int, epoch: int, step: int) -> None:
    data = data_spec(db_uri)
    states = [
        reference_state(data, epoch=epoch, rank=rank, world_size=world_size, step=step)
        for rank in range(world_size)
    ]
    merged = StreamingDataset.merge_state_dicts(states)
    position = positions.Position(epoch, step)
    assert merged == positions.state_dict(data, position)
    assert positions.position_from_state(data, merged) == position


@pytest.mark.parametrize(
    ("old_world", "new_world", "epoch", "step"),
    [(4, 3, 0, 7), (2, 8, 1, 13)],
    ids=lambda v: str(v),
)
def test_a_reference_resumed_from_merged_states_continues_with_our_next_batch(
    memo: Memo, db_uri: str, old_world: int, new_world: int, epoch: int, step: int
) -> None:
    data = data_spec(db_uri)
    merged = StreamingDataset.merge_state_dicts([
        positions.state_dict(data, positions.Position(epoch, step)) for _ in range(old_world)
    ])
    spe = memo.steps_per_epoch(data)
    batch_size = data.global_batch_size // new_world
    for rank in range(new_world):
        continued = reference_rows(data, epoch=epoch, rank=rank, world_size=new_world,
                                   state=merged, limit=batch_size)
        global_step, batch = memo.ours(data, rank, new_world)[epoch * spe + step]
        assert global_step == epoch * spe + step
        assert as_rows(batch) == continued, f"rank {rank}"
