"""Transforms, bad rows and sequence packing in the sidecar against StreamingDataset.

The oracle is lancedb's `StreamingDataset` with the same transform (or the same
packing arguments) iterated in-process; splitfeed's batches must hold its rows,
B per step, for every world size, numWorkers, resume and rescale. onTransformError=
fill has no lancedb counterpart: its oracle is StreamingDataset's per-split order
with a transform that never fails, plus the rule "a failing row is replaced by the
next good row of its split" applied by the test itself.
"""

from __future__ import annotations

import contextlib
import json
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import lancedb
import numpy as np
import pyarrow as pa
import pytest
from lancedb.streaming import StreamingDataset

from splitfeed.sidecar.data import reading, streaming
from splitfeed.sidecar.table import cgroups
from splitfeed.sidecar.forks import workers
from splitfeed.trainer_client.contract import errors, specs

from tests.support import transforms
from tests.reading.tables import data_spec, open_reference_table

N, G = 24, 48
FEATURES = "tests.support.transforms:features"


def reference(data: specs.DataSpec, transform: Callable[..., Any] | None, *, epoch: int,
              rank: int, world_size: int, **packing: Any) -> list[Any]:
    """StreamingDataset's own rows for one rank and epoch, in-process."""
    table = open_reference_table(data)
    dataset = StreamingDataset(
        table, num_splits=data.num_splits, shuffle=data.shuffle, shuffle_seed=data.shuffle_seed,
        epoch=epoch, rank=rank, world_size=world_size, filter=data.filter,
        columns=list(data.columns) if data.columns else None,
        read_batch_size=data.read_batch_size, transform=transform, **packing,
    )
    with contextlib.closing(iter(dataset)) as rows:
        return list(rows)


def run(data: specs.DataSpec, rank: int, world_size: int, start: int = 0,
        stop: int | None = None) -> list[tuple[int, pa.RecordBatch]]:
    return list(workers.iter_rank_batches(
        data, {}, rank=rank, world_size=world_size, start_global_step=start, stop_global_step=stop,
    ))


def as_features(batch: pa.RecordBatch) -> list[tuple[int, str, list[float]]]:
    """A batch of `features` rows, comparable with `reference_features`."""
    images = batch.column("image").to_numpy_ndarray()
    assert images.shape[1:] == (2, 2) and images.dtype == np.float64
    assert batch.schema.field("key").type == pa.int16()
    return list(zip(batch.column("key").to_pylist(), batch.column("name").to_pylist(),
                    [img.ravel().tolist() for img in images]))


def reference_features(rows: list[dict[str, Any]]) -> list[tuple[int, str, list[float]]]:
    return [(int(r["key"]), r["name"], r["image"].ravel().tolist()) for r in rows]


def whole_steps(rows: list[Any], batch_size: int) -> list[list[Any]]:
    return [rows[i:i + batch_size] for i in range(0, len(rows) - batch_size + 1, batch_size)]


class Memo:
    def __init__(self) -> None:
        self.runs: dict[Any, list[tuple[int, pa.RecordBatch]]] = {}
        self.refs: dict[Any, list[Any]] = {}

    def ours(self, data: specs.DataSpec, rank: int, world_size: int) -> list[tuple[int, pa.RecordBatch]]:
        key = (repr(data), rank, world_size)
        if key not in self.runs:
            self.runs[key] = run(data, rank, world_size)
        return self.runs[key]

    def ref(self, data: specs.DataSpec, epoch: int, rank: int, world_size: int) -> list[Any]:
        key = (repr(data), epoch, rank, world_size)
        if key not in self.refs:
            transform = functools.partial(transforms.features, **data.transform_kwargs)
            self.refs[key] = reference(data, transform, epoch=epoch, rank=rank, world_size=world_size)
        return self.refs[key]


@pytest.fixture(scope="module")
def memo() -> Memo:
    return Memo()


def transform_job(db_uri: str, **overrides: Any) -> specs.DataSpec:
    fields: dict[str, Any] = dict(transform=FEATURES, transform_args='{"scale": 0.5}',
                                  filter="label != 3")
    return data_spec(db_uri, **{**fields, **overrides})


# --- transforms -----------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [1, 2], ids=lambda k: f"K={k}")
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6], ids=lambda w: f"W={w}")
def test_transformed_batches_are_streaming_datasets_rows_for_every_rank(
    memo: Memo, db_uri: str, world_size: int, num_workers: int
) -> None:
    data = transform_job(db_uri, num_workers=num_workers)
    batch_size = G // world_size
    reference_steps = whole_steps(memo.ref(data, 0, 0, 1), G)
    assert len(reference_steps) >= 10
    for rank in range(world_size):
        ours = memo.ours(data, rank, world_size)
        expected = []
        for epoch in range(data.epochs):
            expected += whole_steps(reference_features(memo.ref(data, epoch, rank, world_size)), batch_size)
        assert [step for step, _ in ours] == list(range(2 * len(reference_steps)))
        assert [as_features(batch) for _, batch in ours] == expected, f"rank {rank}"


def test_transform_threads_and_queue_depth_reach_streaming_dataset_and_keep_the_order(
    memo: Memo, db_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """spec.data.transformParallelism / transformQueueDepth are lancedb's own arguments;
    with 1 thread or 3, a queue of 1 batch or 64, every rank gets the reference rows."""
    built: list[tuple[Any, Any]] = []

    class Recording(StreamingDataset):  # the real StreamingDataset, its arguments noted
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if kwargs.get("transform") is not None:
                built.append((kwargs.get("transform_parallelism"), kwargs.get("transform_queue_depth")))
            super().__init__(*args, **kwargs)

    import lancedb.streaming

    monkeypatch.setattr(lancedb.streaming, "StreamingDataset", Recording)  # reading imports it when it needs it
    world_size = 3
    for threads, depth in ((1, 1), (3, 64)):
        data = transform_job(db_uri, transform_parallelism=threads, transform_queue_depth=depth)
        built.clear()
        for rank in range(world_size):
            expected = []
            for epoch in range(data.epochs):
                rows = memo.ref(transform_job(db_uri), epoch, rank, world_size)
                expected += whole_steps(reference_features(rows), G // world_size)
            assert [as_features(b) for _, b in run(data, rank, world_size)] == expected, (threads, rank)
        assert built and set(built) == {(threads, depth)}


def test_default_transform_threads_are_the_cpus_the_sidecar_may_use_shared_among_workers(
    db_uri: str
) -> None:
    assert cgroups.cpu_quota("200000 100000") == 2.0
    assert cgroups.cpu_quota("150000 100000") == 1.5
    assert cgroups.cpu_quota("max 100000") is None
    assert cgroups.cpu_quota("50000", "100000") == 0.5  # cgroup v1
    assert cgroups.cpu_quota("-1", "100000") is None
    assert cgroups.cpu_quota("garbage") is None
    assert cgroups.usable_cpus(64, 2.0) == 2  # a 2-CPU pod on a 64-CPU node
    assert cgroups.usable_cpus(64, 1.5) == 2 and cgroups.usable_cpus(64, 0.5) == 1
    assert cgroups.usable_cpus(4, 16.0) == 4 and cgroups.usable_cpus(8, None) == 8
    assert streaming.transform_parallelism(transform_job(db_uri), 8) == 8
    assert streaming.transform_parallelism(transform_job(db_uri, num_workers=2), 8) == 4
    assert streaming.transform_parallelism(transform_job(db_uri, num_workers=4), 2) == 1
    assert streaming.transform_parallelism(transform_job(db_uri, transform_parallelism=3), 8) == 3


def test_elastic_resume_4_then_2_then_3_mid_epoch_gives_every_global_step_once(
    memo: Memo, db_uri: str
) -> None:
    data = transform_job(db_uri)
    spe = len(whole_steps(memo.ref(data, 0, 0, 1), G))
    first, second = 7, spe + 5  # mid epoch 0, then mid epoch 1
    steps: dict[int, list[Any]] = {}
    for world_size, start, stop in ((4, 0, first), (2, first, second), (3, second, None)):
        for rank in range(world_size):
            for step, batch in run(data, rank, world_size, start, stop):
                steps.setdefault(step, []).extend(as_features(batch))
    expected = [
        sorted(step) for epoch in range(2)
        for step in whole_steps(reference_features(memo.ref(data, epoch, 0, 1)), G)
    ]
    assert sorted(steps) == list(range(2 * spe))
    assert [sorted(steps[k]) for k in range(2 * spe)] == expected


def test_a_transform_that_cannot_be_imported_fails_naming_it(db_uri: str) -> None:
    for num_workers in (1, 2):
        data = transform_job(db_uri, transform="tests.reading.no_such_module:f", num_workers=num_workers)
        with pytest.raises(errors.UserError, match=r"spec.data.transform='tests.reading.no_such_module:f': "
                                                     r"cannot import module"):
            run(data, 0, 2)
    data = transform_job(db_uri, transform="tests.support.transforms:NOT_CALLABLE", transform_args=None)
    with pytest.raises(errors.UserError, match=r"NOT_CALLABLE' is not callable"):
        run(data, 0, 1)
    data = transform_job(db_uri, transform="tests.support.transforms:missing", transform_args=None)
    with pytest.raises(errors.UserError, match=r"has no attribute 'missing'"):
        run(data, 0, 1)


@pytest.mark.parametrize("num_workers", [1, 2], ids=lambda k: f"K={k}")
def test_a_transform_returning_the_wrong_row_count_fails_naming_it(db_uri: str, num_workers: int) -> None:
    data = transform_job(db_uri, transform="tests.support.transforms:one_short", transform_args=None,
                         num_workers=num_workers)
    with pytest.raises(errors.UserError, match=r"one_short' returned \d+ rows for a batch of \d+"):
        run(data, 1, 2)


# --- bad rows ------------------------------------------------------------------------


def split_rows(data: specs.DataSpec, epoch: int, split: int) -> list[dict[str, Any]]:
    """Split `split`'s rows in order (a rank of a world of N owns exactly it)."""
    return reference(data, transforms.features, epoch=epoch, rank=split, world_size=N)


@pytest.fixture(scope="module")
def bad_ids(db_uri: str) -> list[int]:
    """Ids of epoch 0 concentrated in splits 3 and 17: runs of rows, and split 17's last
    delivered row and the surplus row after it (its substitute wraps to the split's start)."""
    data = transform_job(db_uri)
    three, seventeen = split_rows(data, 0, 3), split_rows(data, 0, 17)
    assert len(seventeen) % (G // N) == 1  # one surplus row per split, never delivered
    picked = three[2:6] + three[10:11] + seventeen[-2:] + seventeen[20:23]
    return [int(r["key"]) for r in picked]


def fragile_job(db_uri: str, bad: list[int], mode: str, **overrides: Any) -> specs.DataSpec:
    return transform_job(db_uri, transform="tests.support.transforms:fragile",
                         transform_args=json.dumps({"bad": bad}), on_transform_error=mode, **overrides)


@pytest.mark.parametrize("num_workers", [1, 2], ids=lambda k: f"K={k}")
def test_raise_fails_naming_the_transform_the_row_and_the_error(
    db_uri: str, bad_ids: list[int], num_workers: int
) -> None:
    data = fragile_job(db_uri, bad_ids, "raise", num_workers=num_workers)
    with pytest.raises(errors.DataError) as info:  # a DataError from a loader worker too
        run(data, 0, 2)
    message = str(info.value)
    assert "spec.data.transform='tests.support.transforms:fragile' failed on the row at position 2 " \
           "of split 3 in epoch 0" in message
    assert f"ValueError: cannot decode ids [{bad_ids[0]}]" in message
    assert f"'id': {bad_ids[0]}" in message and "onTransformError=fill" in message


def filled_reference(data: specs.DataSpec, bad: set[int], epoch: int) -> tuple[list[list[Any]], int]:
    """Global steps of a fill job, built by the test from each split's own order, and the
    number of delivered rows that are substitutes."""
    per_split = [reference_features(split_rows(data, epoch, s)) for s in range(N)]
    filled = []
    for rows in per_split:
        out = []
        for p, row in enumerate(rows):
            q = p
            while rows[q][0] in bad:
                q = (q + 1) % len(rows)
            out.append(rows[q])
        filled.append(out)
    cycles = G // N
    steps = len(per_split[0]) // cycles
    fills = sum(row[0] in bad for rows in per_split for row in rows[:steps * cycles])
    return [
        sorted(r for rows in filled for r in rows[k * cycles:(k + 1) * cycles]) for k in range(steps)
    ], fills


def test_fill_keeps_every_global_step_identical_for_every_world_size_and_counts_fills(
    db_uri: str, bad_ids: list[int]
) -> None:
    data = fragile_job(db_uri, bad_ids, "fill")
    (epoch0, fills0), (epoch1, fills1) = (filled_reference(data, set(bad_ids), e) for e in (0, 1))
    expected = epoch0 + epoch1
    assert fills0 == len(bad_ids) - 1  # the surplus row is never delivered
    for world_size, num_workers in ((1, 1), (3, 1), (4, 2)):
        job = fragile_job(db_uri, bad_ids, "fill", num_workers=num_workers)
        before = reading.FILLED_ROWS[0]
        steps: dict[int, list[Any]] = {}
        for rank in range(world_size):
            for step, batch in run(job, rank, world_size):
                steps.setdefault(step, []).extend(as_features(batch))
        assert [sorted(steps[k]) for k in sorted(steps)] == expected, f"W={world_size}"
        if num_workers == 1:  # counted in this process; workers count in theirs
            assert reading.FILLED_ROWS[0] - before == fills0 + fills1


def test_fill_resumes_exactly_on_another_world_size(db_uri: str, bad_ids: list[int]) -> None:
    data = fragile_job(db_uri, bad_ids, "fill")
    expected, _ = filled_reference(data, set(bad_ids), 0)
    steps: dict[int, list[Any]] = {}
    for world_size, start, stop in ((2, 0, 3), (6, 3, len(expected))):
        for rank in range(world_size):
            for step, batch in run(data, rank, world_size, start, stop):
                steps.setdefault(step, []).extend(as_features(batch))
    assert [sorted(steps[k]) for k in range(len(expected))] == expected


# --- packing --------------------------------------------------------------------------

BLOCK, EOS, PAD = 16, 1, 0


@pytest.fixture(scope="module")
def token_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """600 documents of 1..40 tokens (ids >= 2), deterministic."""
    rng = np.random.default_rng(3)
    docs = [rng.integers(2, 1000, size=int(rng.integers(1, 41))).tolist() for _ in range(600)]
    uri = str(tmp_path_factory.mktemp("tokens"))
    lancedb.connect(uri).create_table("docs", pa.table({
        "tokens": pa.array(docs, type=pa.list_(pa.int32())),
        "n": pa.array(np.arange(600)),
    }))
    return uri


def pack_job(uri: str, **overrides: Any) -> specs.DataSpec:
    fields: dict[str, Any] = dict(
        uri=uri, table="docs", num_splits=12, global_batch_size=24, shuffle_seed=5, epochs=2,
        pack_sequences=specs.PackSpec(column="tokens", block_size=BLOCK, eos_id=EOS, pad_id=PAD,
                                      blocks_per_epoch=12 * 30),
    )
    return specs.DataSpec(**{**fields, **overrides})


def reference_blocks(data: specs.DataSpec, epoch: int, rank: int, world_size: int) -> list[Any]:
    pack = data.pack_sequences
    assert pack is not None
    rows = reference(dataclasses.replace(data, columns=(pack.column,)), None, epoch=epoch, rank=rank,
                     world_size=world_size, pack_sequences=pack.block_size, eos_id=pack.eos_id,
                     pad_id=pack.pad_id, blocks_per_epoch=pack.blocks_per_epoch)
    return [(r["input_ids"].tolist(), r["doc_ids"].tolist()) for r in rows]


def as_blocks(batch: pa.RecordBatch) -> list[Any]:
    ids, docs = batch.column("input_ids").to_numpy_ndarray(), batch.column("doc_ids").to_numpy_ndarray()
    assert ids.dtype == np.int64 and docs.dtype == np.int64 and ids.shape[1:] == (BLOCK,)
    return [(i.tolist(), d.tolist()) for i, d in zip(ids, docs)]


@pytest.mark.parametrize(("world_size", "num_workers"), [(1, 1), (2, 1), (3, 2), (4, 1)],
                         ids=lambda v: str(v))
def test_packed_blocks_equal_pack_sequences_block_for_block(
    token_uri: str, world_size: int, num_workers: int
) -> None:
    data = pack_job(token_uri, num_workers=num_workers)
    batch_size = data.global_batch_size // world_size
    for rank in range(world_size):
        ours = run(data, rank, world_size)
        expected = []
        for epoch in range(2):
            blocks = reference_blocks(data, epoch, rank, world_size)
            assert len(blocks) == 30 * 12 // world_size  # blocksPerEpoch / W, padding included
            expected += whole_steps(blocks, batch_size)
        assert [step for step, _ in ours] == list(range(2 * 15))
        assert [as_blocks(batch) for _, batch in ours] == expected, f"rank {rank}"


def test_packing_resumes_on_another_world_size(token_uri: str) -> None:
    data = pack_job(token_uri)
    steps: dict[int, list[Any]] = {}
    for world_size, start, stop in ((3, 0, 4), (2, 4, 19), (4, 19, None)):
        for rank in range(world_size):
            for step, batch in run(data, rank, world_size, start, stop):
                steps.setdefault(step, []).extend(as_blocks(batch))
    expected = [sorted(s) for e in range(2) for s in whole_steps(reference_blocks(data, e, 0, 1), 24)]
    assert [sorted(steps[k]) for k in range(30)] == expected


def test_packing_auto_budget_is_lancedbs_epoch_0_estimate(token_uri: str) -> None:
    data = pack_job(token_uri, pack_sequences=specs.PackSpec(
        column="tokens", block_size=BLOCK, eos_id=EOS, pad_id=PAD, blocks_per_epoch="auto"))
    table = open_reference_table(data)
    with pytest.warns(UserWarning, match="approximate"):
        estimate = StreamingDataset(table, num_splits=12, shuffle_seed=5, epoch=0, columns=["tokens"],
                                    pack_sequences=BLOCK, eos_id=EOS, pad_id=PAD,
                                    blocks_per_epoch="auto")._blocks_per_epoch
        assert streaming.blocks_per_epoch(reading.open_table(data), data) == estimate
        assert reading.layout(reading.open_table(data), data).steps_per_epoch == estimate // 24


def test_a_checkpoint_of_other_preprocessing_is_not_resumed(db_uri: str) -> None:
    from splitfeed.sidecar.world import checkpoints

    def provenance(data: specs.DataSpec) -> dict[str, Any]:
        return checkpoints.provenance(data, table_version=1, job_uid="u", world_epoch=0)

    plain, ours = provenance(data_spec(db_uri)), provenance(transform_job(db_uri))
    assert plain["preprocessing"] is None  # records of jobs without preprocessing stay as they were
    checkpoints.check_provenance(ours, provenance(transform_job(db_uri)))
    for other in (data_spec(db_uri, filter="label != 3"),
                  transform_job(db_uri, transform_args='{"scale": 0.25}'),
                  transform_job(db_uri, on_transform_error="fill")):
        with pytest.raises(checkpoints.ProvenanceMismatch, match="spec.data.transform, transformArgs"):
            checkpoints.check_provenance(ours, provenance(other))
