"""onTransformError=skip/warn in the sidecar's reader against StreamingDataset's own skip.

The oracle is lancedb's `StreamingDataset(..., transform=..., on_transform_error="skip")`
iterated in-process for each rank. What lancedb leaves to the caller (where the world
stops each epoch) the test computes itself, from each split's rows and the set of
failing ids: E = min over all splits of (surviving rows // (G/N)). A rank's reader may
run past E (its own splits last longer; the world's watermark cuts it, see
tests/streaming/test_skipping.py), so the reader's steps up to E must be the reference's.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from lancedb.streaming import StreamingDataset

from splitfeed.sidecar.data import positions, reading, skipping, streaming
from splitfeed.sidecar.forks import workers
from splitfeed.trainer_client.contract import specs

from tests.reading.tables import data_spec, open_reference_table
from tests.support import transforms

N, G = 24, 48
CYCLES = G // N


def lancedb_rows(data: specs.DataSpec, *, epoch: int, rank: int, world_size: int,
                 bad: list[int] | None) -> list[Any]:
    """StreamingDataset's rows, in-process; with `bad`, lancedb's own skip of failing rows."""
    table = open_reference_table(data)
    extra: dict[str, Any] = {}
    if bad is not None:
        extra = dict(transform=functools.partial(transforms.fragile, bad=bad), on_transform_error="skip")
    dataset = StreamingDataset(
        table, num_splits=data.num_splits, shuffle=data.shuffle, shuffle_seed=data.shuffle_seed,
        epoch=epoch, rank=rank, world_size=world_size, read_batch_size=data.read_batch_size, **extra)
    with contextlib.closing(iter(dataset)) as rows:
        return list(rows)


def split_ids(data: specs.DataSpec, epoch: int, split: int) -> list[int]:
    """Split `split`'s ids in permutation order (a rank of a world of N owns exactly it)."""
    return [int(r["id"]) for r in lancedb_rows(data, epoch=epoch, rank=split, world_size=N, bad=None)]


def world_end(data: specs.DataSpec, epoch: int, bad: set[int]) -> int:
    """The world's last step + 1 of `epoch`: the split with the fewest survivors decides."""
    spe = len(split_ids(data, epoch, 0)) // CYCLES
    return min(spe, *(sum(i not in bad for i in split_ids(data, epoch, s)) // CYCLES for s in range(N)))


def features(rows: list[dict[str, Any]]) -> list[tuple[int, str, list[float]]]:
    return [(int(r["key"]), r["name"], r["image"].ravel().tolist()) for r in rows]


def as_features(batch: pa.RecordBatch) -> list[tuple[int, str, list[float]]]:
    images = batch.column("image").to_numpy_ndarray()
    return list(zip(batch.column("key").to_pylist(), batch.column("name").to_pylist(),
                    [img.ravel().tolist() for img in images]))


def skip_job(db_uri: str, bad: list[int], mode: str = "skip", **overrides: Any) -> specs.DataSpec:
    return data_spec(db_uri, transform="tests.support.transforms:fragile",
                     transform_args=json.dumps({"bad": bad}), on_transform_error=mode, **overrides)


@pytest.fixture(scope="module")
def bad_ids(db_uri: str) -> list[int]:
    """Epoch 0's failing rows, concentrated in splits 3 (6 rows: its epoch ends 3 steps
    early), 17 (3 rows) and 9 (1 row); in epoch 1 the same ids land elsewhere."""
    data = data_spec(db_uri)
    three, seventeen, nine = (split_ids(data, 0, s) for s in (3, 17, 9))
    return three[2:6] + three[10:12] + seventeen[20:23] + nine[:1]


@pytest.fixture(scope="module")
def ends(db_uri: str, bad_ids: list[int]) -> list[int]:
    data = data_spec(db_uri)
    found = [world_end(data, epoch, set(bad_ids)) for epoch in range(data.epochs)]
    spe = len(split_ids(data, 0, 0)) // CYCLES
    assert found[0] == spe - 3 and found[0] != found[1], found  # the data does what the test needs
    return found


def test_the_world_end_is_the_scarcest_splits_and_lancedb_runs_each_rank_to_its_own(
    db_uri: str, bad_ids: list[int], ends: list[int]
) -> None:
    """What lancedb leaves to the caller: ranks of one world end the epoch at different steps."""
    data = data_spec(db_uri)
    per_rank = [len(lancedb_rows(data, epoch=0, rank=r, world_size=4, bad=bad_ids)) // (G // 4)
                for r in range(4)]
    assert min(per_rank) == ends[0] < max(per_rank)


@pytest.mark.parametrize("world_size,num_workers", [(1, 1), (3, 1), (4, 2)], ids=lambda v: str(v))
def test_skip_yields_lancedb_skip_rows_for_every_rank_up_to_the_world_end(
    db_uri: str, bad_ids: list[int], ends: list[int], world_size: int, num_workers: int
) -> None:
    data = skip_job(db_uri, bad_ids, num_workers=num_workers)
    spe = reading.layout(reading.open_table(data), data).steps_per_epoch
    per_step = G // world_size
    for rank in range(world_size):
        ledger: dict[int, skipping.Passed] = {}
        ours = dict(workers.iter_rank_batches(data, {}, rank=rank, world_size=world_size,
                                              start_global_step=0, ledger=ledger))
        for epoch, end in enumerate(ends):
            ref = features(lancedb_rows(data, epoch=epoch, rank=rank, world_size=world_size, bad=bad_ids))
            own = len(ref) // per_step  # lancedb stops this rank at its own splits' end
            assert own >= end
            steps = [epoch * spe + k for k in range(spe)]
            assert [k for k in steps if k in ours] == steps[:own], f"rank {rank} epoch {epoch}"
            for k in range(end):
                got = as_features(ours[epoch * spe + k])
                assert got == ref[k * per_step:(k + 1) * per_step], f"rank {rank} step {k}"
            assert all(ledger[k] for k in ours)


def test_checkpoint_positions_are_lancedbs_and_resume_is_exact_on_another_world_size(
    db_uri: str, bad_ids: list[int], ends: list[int]
) -> None:
    """Two ranks stop after step 9 of epoch 0 (split 3 has skipped rows by then); their
    states merge into one; three ranks resume from it through both epochs."""
    data = skip_job(db_uri, bad_ids)
    spe = reading.layout(reading.open_table(data), data).steps_per_epoch
    cut = 10
    states, steps = [], {}
    for rank in range(2):
        ledger: dict[int, skipping.Passed] = {}
        for step, batch in workers.iter_rank_batches(data, {}, rank=rank, world_size=2,
                                                     start_global_step=0, stop_global_step=cut, ledger=ledger):
            steps.setdefault(step, []).extend(as_features(batch))
        states.append(positions.state_after(data, positions.position_of(cut, spe), ledger[cut - 1].at))
        # lancedb's own state after the same rows of this rank: the same positions
        ref = StreamingDataset(
            open_reference_table(data), num_splits=N, shuffle=True, shuffle_seed=data.shuffle_seed, rank=rank,
            world_size=2, transform=functools.partial(transforms.fragile, bad=bad_ids), on_transform_error="skip")
        with contextlib.closing(iter(ref)) as rows:
            for _ in range(cut * G // 2):
                next(rows)
            theirs = ref.state_dict()
        mine = states[-1]
        own = range(rank * N // 2, (rank + 1) * N // 2)
        assert [mine["positions_consumed_per_split"][s] for s in own] == \
               [theirs["positions_consumed_per_split"][s] for s in own]
        assert mine["samples_consumed_per_split"] == theirs["samples_consumed_per_split"]
    merged = streaming.merge_states(states)
    assert merged["positions_consumed_per_split"][3] > merged["samples_consumed_per_split"][3]
    for rank in range(3):
        for step, batch in workers.iter_rank_batches(data, {}, rank=rank, world_size=3,
                                                     start_global_step=cut, resume_state=merged):
            steps.setdefault(step, []).extend(as_features(batch))
    for epoch, end in enumerate(ends):
        ref = features(lancedb_rows(data, epoch=epoch, rank=0, world_size=1, bad=bad_ids))
        for k in range(end):
            assert sorted(steps[epoch * spe + k]) == sorted(ref[k * G:(k + 1) * G]), (epoch, k)


def test_warn_logs_each_skipped_row_with_its_split_and_position_and_counts_it(
    db_uri: str, bad_ids: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    data = skip_job(db_uri, bad_ids, "warn")
    ledger: dict[int, skipping.Passed] = {}
    with caplog.at_level(logging.WARNING, logger="splitfeed.sidecar.data.skipping"):
        out = list(workers.iter_rank_batches(data, {}, rank=3, world_size=24, start_global_step=0,
                                             stop_global_step=12, ledger=ledger))
    assert len(out) == 12
    lines = [r.getMessage() for r in caplog.records if "row skipped" in r.getMessage()]
    # split 3 (rank 3 of 24) lost positions 2..5 and 10..11 of epoch 0, all passed by step 11
    assert [line.split(" failed on ")[1].split(" (")[0] for line in lines] == [
        f"position {p} of split 3 in epoch 0" for p in (2, 3, 4, 5, 10, 11)]
    assert [ledger[k].skipped for k in range(12)] == [0, 4, 0, 2] + [0] * 8  # survivors 0-1, 6-7, 8-9, 12-13, ...
    assert np.all(["cannot decode ids" in line for line in lines])


def test_a_resume_at_unequal_split_positions_still_reaches_the_scarcest_splits_last_rows(db_uri: str) -> None:
    """Rank 2 of 12 owns splits 4 and 5. Split 4 skips its first 3 rows (before the cut),
    split 5 loses 4 rows after it and decides the epoch's end. Resumed after the cut, split 4
    is 3 positions ahead, and its rows run out first: the reader must still read split 5 to
    its end (lancedb's Guarded round-robin would stop with split 4), so the resumed steps up
    to the world's end are lancedb's own skip rows."""
    data0 = data_spec(db_uri)
    four, five = split_ids(data0, 0, 4), split_ids(data0, 0, 5)
    bad = four[:3] + five[20:24]
    data = skip_job(db_uri, bad)
    spe = reading.layout(reading.open_table(data), data).steps_per_epoch
    end = world_end(data0, 0, set(bad))
    assert end == (len(five) - 4) // CYCLES and (len(four) - 3) // CYCLES >= end  # split 5 decides
    world, rank, cut, per_rank = 12, 2, 4, G // 12
    ledger: dict[int, skipping.Passed] = {}
    for _ in workers.iter_rank_batches(data, {}, rank=rank, world_size=world, start_global_step=0,
                                       stop_global_step=cut, ledger=ledger):
        pass
    state = positions.state_after(data, positions.position_of(cut, spe), ledger[cut - 1].at)
    assert state["positions_consumed_per_split"][4] > state["positions_consumed_per_split"][5]
    resumed = dict(workers.iter_rank_batches(data, {}, rank=rank, world_size=world, start_global_step=cut,
                                             stop_global_step=spe, resume_state=state))
    ref = features(lancedb_rows(data, epoch=0, rank=rank, world_size=world, bad=bad))
    assert sorted(resumed)[:end - cut] == list(range(cut, end))
    for k in range(cut, end):
        assert as_features(resumed[k]) == ref[k * per_rank:(k + 1) * per_rank], k
