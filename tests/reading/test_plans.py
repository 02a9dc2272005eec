"""Epoch plans (sidecar/table/plans.py) against lancedb's own order, and plans that must not be used.

The oracle is StreamingDataset iterated in-process: a world of N ranks over N splits
gives each split's rows in lancedb's order, so split s of a plan, taken by row id,
must give rank s's `id` column exactly. A large table is compared on sampled splits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import lancedb
import numpy as np
import pyarrow as pa
import pytest

from splitfeed.sidecar.data import reading, streaming
from splitfeed.sidecar.table import cgroups, planning, plans, takes
from splitfeed.sidecar.forks import planner, workers
from splitfeed.trainer_client.contract import errors, specs, topology
from tests.reading.tables import data_spec, ids_of, open_reference_table, reference_rows

ORDERS = [
    pytest.param({}, id="shuffled"),
    pytest.param({"shuffle": False}, id="sequential"),
    pytest.param({"shuffle_clump_size": 5}, id="clumps"),
    pytest.param({"filter": "label != 3"}, id="filtered"),
]


def pinned(uri: str, **overrides: object) -> tuple[object, specs.DataSpec]:
    return reading.pin(data_spec(uri, **overrides))


def plan_ids(table: object, data: specs.DataSpec, epoch: int, location: plans.Location) -> np.ndarray:
    rows = reading.layout(table, data).rows
    return planning.Source(location, builds=True).ids(table, data, epoch, range(data.num_splits), rows)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("epoch", [0, 1])
def test_each_split_of_a_plan_is_lancedbs_split_row_for_row(
        db_uri: str, tmp_path: Path, order: dict[str, object], epoch: int) -> None:
    table, data = pinned(db_uri, **order)
    location = plans.location_for(data, str(tmp_path))
    ids = plan_ids(table, data, epoch, location)
    for split in range(data.num_splits):
        expected = [r["id"] for r in reference_rows(data, epoch=epoch, rank=split, world_size=data.num_splits)]
        got = takes.take_rows(table, ids[split], ["id"])
        assert ids_of(got) == expected, f"split {split}"


def test_a_plan_exported_in_batches_that_cut_splits_keeps_every_splits_rows_and_crc(
        db_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """lancedb's export batches need not end where a split does: each split's CRC is folded
    over the pieces of it that each batch holds (a wrong fold fails the readers' CRC check)."""
    monkeypatch.setattr(planning, "EXPORT_BATCH_ROWS", 37)
    table, data = pinned(db_uri)
    location = plans.location_for(data, str(tmp_path))
    ids = plan_ids(table, data, 0, location)
    for split in range(data.num_splits):
        expected = [r["id"] for r in reference_rows(data, epoch=0, rank=split, world_size=data.num_splits)]
        assert ids_of(takes.take_rows(table, ids[split], ["id"])) == expected, f"split {split}"


def test_a_reader_learns_of_a_plan_at_most_a_tenth_of_its_wait_late() -> None:
    """The look after a wait of w comes within max(first, w / 10), and never more than 0.1 s
    on on a local filesystem (a stat), 1 s on an object store (a request); the first look
    again is 5 ms locally, 50 ms on an object store."""
    for local, first, most in ((True, 0.005, 0.1), (False, 0.05, 1.0)):
        for waited in (0.0, 0.004, 0.06, 0.15, 2.0, 9.0, 600.0):
            assert 0 < planning.next_poll_s(waited, local) <= min(most, max(first, waited / 10)) + 1e-12


def test_a_rank_loads_only_its_splits_and_they_are_the_plans_rows(db_uri: str, tmp_path: Path) -> None:
    table, data = pinned(db_uri)
    location = plans.location_for(data, str(tmp_path))
    whole = plan_ids(table, data, 0, location)
    part = plans.read_splits(location, plans.PlanKey.of(data), 0, range(6, 12))
    assert part.shape == (6, whole.shape[1])
    assert np.array_equal(part, whole[6:12])
    with pytest.raises(ValueError, match="contiguous"):
        plans.read_splits(location, plans.PlanKey.of(data), 0, [1, 3])


def test_step_order_is_streaming_datasets_cycle_order() -> None:
    ids = np.arange(3 * 8, dtype=np.uint64).reshape(3, 8)  # 3 splits of 8 rows
    # step 1 of 2 rows per split: cycle 0 of splits 0, 1, 2, then cycle 1
    assert reading.step_order(ids, 1, 1, 2).tolist() == [2, 10, 18, 3, 11, 19]
    assert reading.step_order(ids, 0, 2, 2).tolist() == [0, 8, 16, 1, 9, 17, 2, 10, 18, 3, 11, 19]


def test_take_rows_gives_rows_in_the_order_asked(db_uri: str) -> None:
    table, _ = pinned(db_uri)
    order = np.array([907, 3, 512, 4, 999, 0], dtype=np.uint64)  # one fragment: row id = row number
    assert ids_of(takes.take_rows(table, order, ["id"])) == order.tolist()


def test_a_missing_row_id_is_a_failure_not_a_short_batch(db_uri: str) -> None:
    table, _ = pinned(db_uri)
    with pytest.raises(errors.SidecarFailed, match="returned 1 rows for 2 row ids"):
        takes.take_rows(table, np.array([5, 10**9], dtype=np.uint64), ["id"])


def test_a_reader_of_a_stored_plan_serves_every_world_size_exactly(db_uri: str, tmp_path: Path) -> None:
    """A plan built once (by a world of 1) serves a world of 3 that never builds: a
    rescale's new world reads the old world's plans."""
    table, data = pinned(db_uri, global_batch_size=72)
    location = plans.location_for(data, str(tmp_path))
    plan_ids(table, data, 0, location)
    plan_ids(table, data, 1, location)
    reader = planning.Source(location, builds=False, timeout_s=0)
    per_rank = data.global_batch_size // 3
    for rank in range(3):
        expected = [r["id"] for r in reference_rows(data, epoch=1, rank=rank, world_size=3)]
        spe = reading.layout(table, data).steps_per_epoch
        got: list[int] = []
        for step, batch in workers.iter_rank_batches(data, None, rank=rank, world_size=3,
                                                     start_global_step=spe + 2, plan=reader):
            assert batch.num_rows == per_rank
            got += ids_of(batch)
        assert got == expected[2 * per_rank:spe * per_rank]


def test_a_reader_waits_for_a_missing_plan_then_says_who_builds_it(db_uri: str, tmp_path: Path) -> None:
    table, data = pinned(db_uri)
    location = plans.location_for(data, str(tmp_path))
    with pytest.raises(errors.UserError, match="replica 0's sidecar builds it"):
        planning.Source(location, timeout_s=0.2).ids(table, data, 0, range(4), 1000)


def test_a_builders_failure_reaches_the_readers_waiting_for_it(db_uri: str, tmp_path: Path) -> None:
    table, data = pinned(db_uri)
    location = plans.location_for(data, str(tmp_path))
    plans.mark_failed(location, 0, "building the permutation of 1,000 rows needs about 9 MiB")
    with pytest.raises(plans.PlanError, match="could not be built: building the permutation"):
        planning.Source(location, timeout_s=30).ids(table, data, 0, range(4), 1000)


def _plan_file(db_uri: str, tmp_path: Path) -> tuple[object, specs.DataSpec, plans.Location, Path]:
    table, data = pinned(db_uri)
    location = plans.location_for(data, str(tmp_path))
    plan_ids(table, data, 0, location)
    return table, data, location, Path(location.path(0))


def _damage_split_5(path: Path) -> bytes:
    good = path.read_bytes()
    raw = bytearray(good)
    raw[5 * 41 * 8 + 3] ^= 0xFF  # a byte of split 5 (24 splits of 41 rows)
    path.write_bytes(bytes(raw))
    return good


def test_the_world_start_check_reads_the_footer_alone(db_uri: str, tmp_path: Path) -> None:
    """verify (the builder's check at every world start) never reads the ids: a 10^9-row
    plan is 8 GB. A split's damage is left to the reader of that split."""
    _, data, location, path = _plan_file(db_uri, tmp_path)
    key = plans.PlanKey.of(data)
    _damage_split_5(path)
    footer = plans.verify(location, key, 0)
    assert footer is not None and footer.num_splits == 24 and len(footer.crcs) == 24
    # what the footer says is still checked: its CRC list, its key, its epoch
    _rewrite_footer(path, crcs=[0] * 23)
    assert plans.verify(location, key, 0) is None
    _rewrite_footer(path, crcs=[0] * 24)
    assert plans.verify(location, key, 0) is not None
    assert plans.verify(location, key, 1) is None  # no plan of epoch 1
    other = plans.PlanKey.of(dataclasses.replace(data, shuffle_seed=data.shuffle_seed + 1))
    assert plans.verify(location, other, 0) is None


def test_a_damaged_split_is_refused_by_its_reader_and_rebuilt_by_the_builder(db_uri: str, tmp_path: Path) -> None:
    table, data, location, path = _plan_file(db_uri, tmp_path)
    good = _damage_split_5(path)
    key = plans.PlanKey.of(data)
    plans.read_splits(location, key, 0, range(0, 5))  # other splits still read
    assert plans.verify(location, key, 0) is not None  # footer-only: nobody has seen the damage
    with pytest.raises(errors.UserError) as info:
        plans.read_splits(location, key, 0, range(4, 8))
    message = str(info.value)
    # a restart cures it (a DataError would fail the job for good); one line, the file, what next
    assert not isinstance(info.value, errors.DataError)
    assert "\n" not in message
    assert f"plan {path} is damaged (split 5 fails its CRC)" in message
    assert "replica 0's sidecar" in message and "build it again" in message
    assert plans.damaged(location, 0) == "is damaged (split 5 fails its CRC)"
    # a reader waiting for the builder refuses it the same way, never returns its ids
    with pytest.raises(errors.UserError, match="split 5 fails its CRC"):
        planning.Source(location, timeout_s=0).ids(table, data, 0, range(4, 8), 1000)
    assert plans.verify(location, key, 0) is None  # the reader's report: build it again
    builder = planner.Planner(data, {}, location, rows=1000)
    builder.ensure(0)
    assert path.read_bytes() == good
    assert plans.damaged(location, 0) is None  # the rebuilt plan is trusted again
    assert plans.verify(location, key, 0) is not None


def test_a_reader_that_builds_for_itself_rebuilds_a_damaged_plan(db_uri: str, tmp_path: Path) -> None:
    table, data, location, path = _plan_file(db_uri, tmp_path)
    good = _damage_split_5(path)
    ids = planning.Source(location, builds=True).ids(table, data, 0, range(4, 8), 1000)
    assert path.read_bytes() == good
    assert np.array_equal(ids, plans.read_splits(location, plans.PlanKey.of(data), 0, range(4, 8)))


def test_a_torn_plan_is_refused_by_its_reader_and_rebuilt_by_the_builder(db_uri: str, tmp_path: Path) -> None:
    _, data, location, path = _plan_file(db_uri, tmp_path)
    good = path.read_bytes()
    path.write_bytes(good[:-100])
    key = plans.PlanKey.of(data)
    assert plans.verify(location, key, 0) is None  # the footer check sees a torn file
    with pytest.raises(errors.UserError, match="torn|not a splitfeed plan|damaged") as info:
        plans.read_splits(location, key, 0, range(4))
    assert not isinstance(info.value, errors.DataError)
    planner.Planner(data, {}, location, rows=1000).ensure(0)
    assert path.read_bytes() == good


def test_a_plan_of_another_seed_is_never_used(db_uri: str, tmp_path: Path) -> None:
    _, data, location, _ = _plan_file(db_uri, tmp_path)
    other = plans.PlanKey.of(dataclasses.replace(data, shuffle_seed=data.shuffle_seed + 1))
    with pytest.raises(plans.PlanError, match="built for other data \\(shuffle_seed differ\\)"):
        plans.read_splits(location, other, 0, range(4))
    Path(location.path(1)).write_bytes(Path(location.path(0)).read_bytes())  # epoch 0's as epoch 1's
    with pytest.raises(plans.PlanError, match="epoch differ"):
        plans.read_splits(location, plans.PlanKey.of(data), 1, range(4))


def _rewrite_footer(path: Path, **changes: object) -> None:
    raw = path.read_bytes()
    length, magic = struct.unpack("<Q8s", raw[-16:])
    footer = json.loads(raw[-16 - length:-16])
    footer.update(changes)
    blob = json.dumps(footer).encode()
    path.write_bytes(raw[:-16 - length] + blob + struct.pack("<Q8s", len(blob), magic))


def test_a_job_whose_plans_another_lancedb_built_refuses_to_build_more(db_uri: str, tmp_path: Path) -> None:
    table, data, location, path = _plan_file(db_uri, tmp_path)
    _rewrite_footer(path, lancedb="0.39.0")
    # the stored plan itself is still read: it fixes the order, whichever lancedb reads it
    assert plans.read_splits(location, plans.PlanKey.of(data), 0, range(4)).shape == (4, 41)
    builder = planner.Planner(data, {}, location, rows=1000)
    builder.ensure(0)  # exists and is whole: nothing to build
    with pytest.raises(plans.PlanError) as info:
        builder.ensure(1)
    message = str(info.value)
    assert "\n" not in message
    assert "built by lancedb 0.39.0" in message and f"has lancedb {lancedb.__version__}" in message
    assert "image with the lancedb that started it" in message


def test_the_builder_pool_is_sized_from_the_container_not_lancedbs_default() -> None:
    assert planning.builder_pool_bytes(20_000_000, None) == planning.MIN_POOL
    gib = 1 << 30
    # 8 GiB free: half of it, less the 320 MB permutation lancedb holds
    assert planning.builder_pool_bytes(20_000_000, 8 * gib) == 4 * gib - 20_000_000 * 16
    assert planning.builder_pool_bytes(10**9, 1000 * gib) == planning.MAX_POOL
    assert planning.builder_pool_bytes(10**9, 2 * gib) == planning.MIN_POOL  # spills to disk
    assert planning.builder_pool_bytes(1, 1) == planning.MIN_POOL


def test_a_build_that_cannot_fit_names_the_field_and_the_size() -> None:
    planning.check_fits(10_000_000, 1 << 30, limited=True)  # 160 MB + pool fit 1 GiB
    planning.check_fits(10**9, 1 << 30, limited=False)  # no limit known: lancedb spills
    with pytest.raises(plans.PlanError) as info:
        planning.check_fits(10**9, 1 << 30, limited=True)
    message = str(info.value)
    assert "spec.sidecar.resources.limits.memory" in message and "15,515 MiB" in message
    assert "\n" not in message


def test_cgroup_memory_limits_are_read_as_kubernetes_sets_them() -> None:
    assert cgroups.memory_limit("2147483648\n", "1073741824\n") == (2 << 30, 1 << 30)
    assert cgroups.memory_limit("max\n", "5") is None  # v2: no limit
    assert cgroups.memory_limit("9223372036854771712", "5") is None  # v1: no limit
    assert cgroups.memory_limit("garbage", "5") is None


def test_steps_per_epoch_come_from_a_row_count(db_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    table, data = pinned(db_uri, filter="label != 3")
    import lancedb.permutation

    def no_permutation(*_: object, **__: object) -> None:
        raise AssertionError("layout built a permutation")

    monkeypatch.setattr(lancedb.permutation, "permutation_builder", no_permutation)
    sized = reading.layout(table, data)
    assert sized.rows == 900 and sized.split_size == 37 and sized.steps_per_epoch == 18


BIG_ROWS = 4_000_000


@pytest.fixture(scope="module")
def big_table(tmp_path_factory: pytest.TempPathFactory) -> str:
    """4M narrow rows in 4 fragments: lancedb's own builder fails on it at its 100 MiB default."""
    uri = str(tmp_path_factory.mktemp("big"))
    schema = pa.schema([("id", pa.int64()), ("label", pa.int32())])

    def batches():  # type: ignore[no-untyped-def]
        for start in range(0, BIG_ROWS, 1_000_000):
            ids = np.arange(start, start + 1_000_000, dtype=np.int64)
            yield pa.record_batch([ids, (ids % 10).astype(np.int32)], schema=schema)

    db = lancedb.connect(uri)
    db.create_table("frames", pa.RecordBatchReader.from_batches(schema, batches()),
                    mode="overwrite")
    return uri


def test_a_4m_row_plan_matches_lancedb_on_sampled_splits(
        big_table: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table, data = reading.pin(data_spec(big_table, num_splits=48, global_batch_size=4800))
    location = plans.location_for(data, str(tmp_path))
    builder = planner.Planner(data, {}, location, rows=BIG_ROWS)
    builder.ensure(0)  # in a child process, as a sidecar builds it
    # The reference: StreamingDataset in-process, with its builder given the memory
    # it needs (at lancedb's default it fails on this table).
    monkeypatch.setenv(planning.MEMORY_ENV, str(1 << 30))
    for split in (0, 31):
        expected = [r["id"] for r in reference_rows(data, epoch=0, rank=split, world_size=48, limit=500)]
        ids = plans.read_splits(location, plans.PlanKey.of(data), 0, [split])[0][:500]
        assert ids_of(takes.take_rows(table, ids, ["id"])) == expected


def test_first_steps_of_a_4m_row_job_are_lancedbs(
        big_table: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 splits, 2 splits a rank: lancedb's reference opens each split at O(table rows)
    data = data_spec(big_table, num_splits=4, global_batch_size=400)
    got = list(itertools.islice(
        workers.iter_rank_batches(data, None, rank=1, world_size=2, start_global_step=0), 3))
    monkeypatch.setenv(planning.MEMORY_ENV, str(1 << 30))
    table = open_reference_table(data)
    dataset = streaming.reference_dataset(table, data, epoch=0, rank=1, world_size=2)
    per_rank = topology.rows_per_split_per_step(400, 4) * 2
    with contextlib.closing(iter(dataset)) as rows:
        expected = [r["id"] for r in itertools.islice(rows, 3 * per_rank)]
    assert [step for step, _ in got] == [0, 1, 2]
    assert sum((ids_of(batch) for _, batch in got), []) == expected


def test_the_epoch_seed_step_is_lancedbs() -> None:
    from lancedb.streaming import _EPOCH_PRIME

    assert planning.EPOCH_PRIME == _EPOCH_PRIME


def test_takes_in_flight_fit_the_budget_with_what_a_take_holds_while_it_decodes() -> None:
    mib = 1 << 20
    # 26,400 rows of 12 B shuffled one by one: ~24.6 MB a take -> 10 fit 256 MiB, 2 CPUs allow 4
    assert takes.depth_for(256 * mib, 26_400, 12.0, cpus=2) == 4
    assert takes.depth_for(256 * mib, 26_400, 12.0, cpus=16) == 10
    assert takes.depth_for(256 * mib, 26_400, 12.0, clump=64, cpus=64) == takes.MAX_IN_FLIGHT
    # 64 KiB rows: a take holds 2.5 x its rows while it decodes, beside the one consumed
    assert takes.depth_for(256 * mib, 1_920, 65_536.0, cpus=16) == 1  # 120 MiB takes
    assert takes.depth_for(256 * mib, 480, 65_536.0, cpus=16) == 2  # 30 MiB takes: rows_per_take's
    assert takes.depth_for(1, 10, 1.0, cpus=8) == 1
    assert takes.depth_for(256 * mib, 26_400, 12.0, cpus=None) == 10  # an object store: no CPU cap
    assert reading.remote("s3://b/db") and reading.remote("gs://b/db") and not reading.remote("/data/db")
    assert not reading.remote("file:///data/db")
    # a take's size leaves room for MIN_DEPTH of them and the one consumed within the budget
    assert takes.rows_per_take(1 << 40, 65_536.0) == takes.TAKE_BYTES // 65_536
    assert takes.rows_per_take(256 * mib, 12.0) == int(256 * mib / (2 * (30 + 900) + 12))
    for budget in (16 * mib, 256 * mib, 1 << 30):
        for row_bytes in (12.0, 4096.0, 65_536.0):
            for clump in (0, 64):
                rows = takes.rows_per_take(budget, row_bytes, clump)
                assert takes.depth_for(budget, rows, row_bytes, clump=clump, cpus=None) >= takes.MIN_DEPTH


def test_a_take_of_large_rows_stays_under_take_bytes(db_uri: str) -> None:
    """Until the first take sizes a row, takes are one step; then as many steps as fit."""
    table, data = pinned(db_uri)
    for budget in (1 << 30, 1 << 20):
        requests = iter([((0, 1), np.arange(10, dtype=np.uint64))])
        taken = takes.Takes(table, ["id"], requests, budget)
        assert taken.steps_per_take(50, 1000) == 1
        next(taken)
        row = taken._row_bytes
        assert row is not None and row > 0
        most = takes.rows_per_take(budget, row) // 1000
        assert most == int(min(takes.TAKE_BYTES / row, budget / (2 * (2.5 * row + 900) + row)) // 1000)
        assert taken.steps_per_take(10**9, 1000) == max(1, most)  # a step, even over the budget
        assert taken.steps_per_take(3, 1000) == max(1, min(3, most))
        taken.close()


def test_takes_hold_what_they_decode_to_the_budget_take_by_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """Takes running at once hold at most readAheadBytes with the result being consumed:
    the first take (one step) must not size the depth of the larger takes after it."""
    row, per_step, budget, steps = 65_544, 10, 16 << 20, 200
    lock = threading.Lock()
    running: dict[int, int] = {}
    consumed = [0]
    worst = {"held": 0.0, "takes": 0}

    def fake_take(table: object, ids: np.ndarray, columns: object) -> pa.RecordBatch:
        with lock:
            running[id(ids)] = len(ids)
            held = sum(takes.held_bytes(n, row) for n in running.values()) + consumed[0]
            worst["held"] = max(worst["held"], held)
            worst["takes"] = max(worst["takes"], len(running))
        time.sleep(0.01)
        with lock:
            del running[id(ids)]
        return pa.record_batch([pa.array(ids.astype(np.int64)), pa.array([bytes(row - 8)] * len(ids),
                                                                         pa.binary(row - 8))],
                               names=["id", "payload"])

    monkeypatch.setattr(takes, "take_rows", fake_take)

    def requests() -> Iterator[tuple[int, np.ndarray] | None]:
        first = 0
        while first < steps:
            count = min(taken.steps_per_take(50, per_step), steps - first)
            yield first, np.arange(first * per_step, (first + count) * per_step, dtype=np.uint64)
            first += count

    taken: takes.Takes[int] = takes.Takes(None, None, requests(), budget, cpus=None)
    got: list[int] = []
    for _, batch in taken:
        with lock:
            consumed[0] = batch.nbytes
        got += batch.column("id").to_pylist()
    assert got == list(range(steps * per_step))
    assert worst["takes"] >= 2  # it reads ahead
    assert worst["held"] <= budget, worst


def test_requests_drawn_are_taken_together_and_each_gets_its_own_rows(
        db_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A take of more rows costs lance less a row on a large table: requests already drawn
    are taken at once, two epochs' (the same rows again) included, and handed back apart."""
    small, _ = pinned(db_uri)

    class Large:
        """The test table, said to be 10^8 rows: its requests' rows would sit far apart."""

        def __getattr__(self, name: str) -> object:
            return getattr(small, name)

        def count_rows(self) -> int:
            return 10**8

    table = Large()
    rng = np.random.default_rng(3)
    epochs = [rng.permutation(1000).astype(np.uint64) for _ in range(2)]
    asked = [(i, epochs[i // 10][(i % 10) * 50:(i % 10 + 1) * 50]) for i in range(20)]
    calls: list[int] = []
    real = takes.take_rows

    def counting(table: object, ids: np.ndarray, columns: list[str] | None) -> pa.RecordBatch:
        calls.append(len(ids))
        return real(table, ids, columns)

    monkeypatch.setattr(takes, "take_rows", counting)
    taken: takes.Takes[int] = takes.Takes(table, ["id"], iter(asked), 256 << 20)
    got = [(tag, ids_of(batch)) for tag, batch in taken]
    assert got == [(tag, ids.tolist()) for tag, ids in asked]
    assert calls[:2] == [50, 50]  # until a row's size is known: one request a take
    assert len(calls) < len(asked) and max(calls) >= 500, calls
    assert ids_of(real(table, np.array([7, 3, 7], dtype=np.uint64), ["id"])) == [7, 3, 7]
    # where a request's rows already share lance's reads, merging would only cost CPU
    calls.clear()
    assert [tag for tag, _ in takes.Takes(small, ["id"], iter(asked), 256 << 20)] == list(range(20))
    assert calls == [50] * 20
    mib = 1 << 20
    assert takes.merged_rows(256 * mib, 12.0, 0, 1_000_000) < 26_400  # the bench's 1M table
    assert takes.merged_rows(256 * mib, 12.0, 0, 50_000_000) == takes.rows_per_take(256 * mib, 12.0)


def _barrier_crossed(table: object, barrier: takes.Barrier) -> tuple[list[int], list[int]]:
    """(tags received in order, results handed out when the requests went past `barrier`),
    with every take that fits in flight at once (cpus=None): a barrier passed early is
    passed before the first result."""
    received: list[int] = []
    crossed: list[int] = []

    def requests() -> Iterator[tuple[int, np.ndarray] | takes.Barrier]:
        for i in range(6):
            yield i, np.arange(i * 50, (i + 1) * 50, dtype=np.uint64)
        yield barrier
        crossed.append(len(received))
        for i in range(6, 8):
            yield i, np.arange(i * 50, (i + 1) * 50, dtype=np.uint64)

    for tag, batch in takes.Takes(table, ["id"], requests(), 256 << 20, cpus=None):
        assert ids_of(batch) == list(range(tag * 50, (tag + 1) * 50))
        received.append(tag)
    return received, crossed


def test_takes_never_draw_past_a_closed_barrier_before_every_result_before_it_is_handed_out(db_uri: str) -> None:
    """What follows a Barrier may wait for the plan that a published step lets the planner
    build: every result asked before it reaches the consumer before it is drawn."""
    table, _ = pinned(db_uri)
    received, crossed = _barrier_crossed(table, takes.Barrier())
    assert received == list(range(8)) and crossed == [6]


def test_takes_read_on_past_a_barrier_that_opened(db_uri: str) -> None:
    """Once the plan is there (the barrier opened), the next epoch's rows are taken ahead
    like any others: the epoch's first step does not wait for them."""
    table, _ = pinned(db_uri)
    received, crossed = _barrier_crossed(table, takes.Barrier(lambda: True))
    assert received == list(range(8)) and crossed == [0]


def _wait_until(done: Callable[[], bool], timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.005)
    return done()


def test_a_plan_loaded_ahead_arrives_once_published_with_lancedbs_rows(db_uri: str, tmp_path: Path) -> None:
    """The next epoch's ids load in a thread: not there before its plan is published, then
    each split's rows are lancedb's."""
    table, data = pinned(db_uri)
    location = plans.location_for(data, str(tmp_path))
    ahead = planning.Source(location).ahead(table, data, 1, range(4, 8), 1000)
    try:
        time.sleep(0.05)
        assert not ahead.arrived()
        planning.build_and_publish(table, data, location, 1, rows=reading.layout(table, data).rows)
        assert _wait_until(ahead.arrived)
        ids = ahead.ids()
    finally:
        ahead.close()
    for i, split in enumerate(range(4, 8)):
        expected = [r["id"] for r in reference_rows(data, epoch=1, rank=split, world_size=data.num_splits)]
        assert ids_of(takes.take_rows(table, ids[i], ["id"])) == expected, f"split {split}"


def test_a_plan_loaded_ahead_times_out_only_once_the_reads_need_it(db_uri: str, tmp_path: Path) -> None:
    """A load begun an epoch early must not count that epoch against the plan's timeout:
    the wait's clock starts when the reads get there."""
    table, data = pinned(db_uri)
    location = plans.location_for(data, str(tmp_path))
    ahead = planning.Source(location, timeout_s=0.05).ahead(table, data, 1, range(4), 1000)
    try:
        time.sleep(0.3)
        assert not ahead.arrived()
        with pytest.raises(errors.UserError, match="did not appear .* replica 0's sidecar builds it"):
            ahead.ids()
    finally:
        ahead.close()


def test_reads_that_end_stop_the_next_epochs_load(db_uri: str, tmp_path: Path) -> None:
    """A reader closed mid-epoch (a drain, a trainer gone) leaves no thread waiting for a
    plan that will never be built."""
    table, data = pinned(db_uri, epochs=3)
    location = plans.location_for(data, str(tmp_path))
    plan_ids(table, data, 0, location)  # epoch 1's plan is never built
    blocks = reading.iter_blocks(table, data, range(data.num_splits), start_global_step=0, plan=planning.Source(location))
    next(blocks)
    assert _wait_until(lambda: any(t.name == "splitfeed-plan-ahead-1" for t in threading.enumerate()))
    loader = next(t for t in threading.enumerate() if t.name == "splitfeed-plan-ahead-1")
    blocks.close()
    loader.join(5)
    assert not loader.is_alive()


def test_the_pool_is_set_once_for_the_process_and_a_users_own_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(planning.MEMORY_ENV, raising=False)
    monkeypatch.delenv(planning.OURS_ENV, raising=False)
    planning.size_pool(20_000_000, 8 << 30)
    assert int(os.environ[planning.MEMORY_ENV]) == planning.builder_pool_bytes(20_000_000, 8 << 30)
    planning.size_pool(1_000, 8 << 30)  # ours: sized again (a build's child, for its rows)
    assert int(os.environ[planning.MEMORY_ENV]) == planning.builder_pool_bytes(1_000, 8 << 30)
    monkeypatch.setenv(planning.MEMORY_ENV, "12345")
    monkeypatch.delenv(planning.OURS_ENV)
    planning.size_pool(1_000, 8 << 30)  # the user's
    assert os.environ[planning.MEMORY_ENV] == "12345"
