"""Rows gathered by a scan of the table (takes.scan_rows) instead of takes by row id.

A scan must give exactly what `take_rows` gives (the rows asked, in the order asked,
an id asked twice given twice), whatever the table's fragments, deletions and the
batches lance hands out; and a reader that scans must still give StreamingDataset's
order, which this module checks with the scans counted (tests/reading/test_determinism.py
checks every job variant, but its tables of 1,000 rows are taken: a scan's start costs more).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lancedb
import numpy as np
import pyarrow as pa
import pytest

from splitfeed.sidecar.data import reading
from splitfeed.sidecar.table import scans, takes
from splitfeed.trainer_client.contract import errors
from tests.reading.tables import data_spec, ids_of, reference_rows

MIB = 1 << 20


def row_ids(table: object) -> np.ndarray:
    """Every row id of the table's version, in scan order."""
    got = table.search().select(["id"]).with_row_id(True).limit(None).to_arrow()  # type: ignore[attr-defined]
    return np.asarray(got.column("_rowid").to_numpy(), dtype=np.uint64)


@pytest.fixture
def scans_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scans where rows are many against a table's even on these 1,000-row tables, whose takes
    cost less than a scan's start (takes.SCAN_START_S)."""
    monkeypatch.setattr(takes, "SCAN_START_S", 0.0)


@pytest.fixture
def local_read_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """lance reads SCAN_READAHEAD fragments ahead, as where a process opened a local table."""
    monkeypatch.setenv(takes.READAHEAD_ENV, str(takes.SCAN_READAHEAD))


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scans in batches of 1,024 rows: many batches, a fragment's rows in several."""
    monkeypatch.setattr(takes, "SCAN_BATCH_BYTES", 1)
    monkeypatch.setattr(takes, "SCAN_BATCH_ROWS", 1024)


def fragments_of(path: Path, parts: list[pa.Table]) -> Any:
    """Table "t" at `path`, one fragment a part (created with the first, each other added)."""
    table = lancedb.connect(str(path)).create_table("t", parts[0])
    for part in parts[1:]:
        table.add(part)
    return table


def fragmented_table(path: Path) -> object:
    """5 fragments of 3,000 rows (`id` = row number), every 7th row of the second deleted."""
    parts = [np.arange(part * 3000, (part + 1) * 3000, dtype=np.int64) for part in range(5)]
    table = fragments_of(path, [pa.table({"id": ids, "label": (ids % 10).astype(np.int32),
                                          "name": [f"r{i}" for i in ids]}) for ids in parts])
    table.delete("id >= 3000 AND id < 6000 AND id % 7 = 0")
    return table


@pytest.mark.parametrize("columns", [["id"], ["label", "id"], None])
def test_a_scan_gives_exactly_what_a_take_gives(tmp_path: Path, columns: list[str] | None,
                                                 small_batches: None) -> None:
    table = fragmented_table(tmp_path)
    every = row_ids(table)
    assert len(every) == 15_000 - 429
    rng = np.random.default_rng(5)
    asked = [
        rng.permutation(every),  # all of them, shuffled
        rng.permutation(every)[:2_000],  # some, from every fragment
        np.concatenate([rng.permutation(every)[:900], rng.permutation(every)[:900]]),  # ids repeated
        every[3_000:3_010][::-1].copy(),  # a few, in one fragment, after a deleted row
    ]
    for ids in asked:
        expected = takes.take_rows(table, ids, columns)
        got = takes.scan_rows(table, ids, columns)
        assert got.equals(expected)
        assert got.num_rows == len(ids)


def varied_table(path: Path) -> object:
    """3 fragments of 2,000 rows, some deleted: int64 `id`, int32 `maybe` (every 5th null),
    float32[3] `vec` (every 7th null, every 11th row's middle element null), bool `flag`,
    string `name`."""
    def part(ids: np.ndarray) -> pa.Table:
        values = pa.array((ids * 3).astype(np.float32).repeat(3),
                          mask=np.repeat(ids % 11 == 0, 3) & np.tile([False, True, False], len(ids)))
        vec = pa.FixedSizeListArray.from_arrays(values, 3, mask=pa.array(ids % 7 == 0))
        return pa.table({"id": ids, "maybe": pa.array(ids.astype(np.int32), mask=ids % 5 == 0), "vec": vec,
                         "flag": ids % 2 == 0, "name": [f"r{i}" for i in ids]})

    table = fragments_of(path, [part(np.arange(p * 2000, (p + 1) * 2000, dtype=np.int64)) for p in range(3)])
    table.delete("id % 13 = 4")
    return table


@pytest.mark.parametrize("columns", [["id", "maybe", "vec"], ["vec", "maybe"], None, ["name", "id"]])
def test_a_scan_puts_fixed_width_columns_in_place_with_their_nulls_and_picks_the_others(
        tmp_path: Path, columns: list[str] | None, small_batches: None) -> None:
    table = varied_table(tmp_path)
    every = row_ids(table)
    rng = np.random.default_rng(8)
    for ids in (rng.permutation(every), np.concatenate([every[-700:], every[-700:][::-1]]),  # the table's end, twice
                rng.permutation(every)[:50]):
        expected = takes.take_rows(table, ids, columns)
        got = takes.scan_rows(table, ids, columns)
        assert got.equals(expected)
        assert got.column("vec" if columns is None or "vec" in columns else 0).null_count == (
            expected.column("vec" if columns is None or "vec" in columns else 0).null_count)
    in_place = {"id": True, "maybe": True, "vec": True, "flag": False, "name": False}
    schema = takes.take_rows(table, every[:1], columns).schema
    assert scans.in_place(schema) == all(in_place[name] for name in schema.names)


def test_a_row_the_scan_cannot_find_fails_as_a_take_does(tmp_path: Path) -> None:
    table = fragmented_table(tmp_path)
    every = row_ids(table)
    with pytest.raises(errors.SidecarFailed, match="row ids"):
        takes.scan_rows(table, np.array([every[0], 10**9], dtype=np.uint64), ["id"])
    present = set(every.tolist())
    deleted = np.uint64((1 << 32) | 3)  # fragment 1's row 3: id 3003, deleted
    assert int(deleted) not in present and int(deleted) + 1 in present
    with pytest.raises(errors.SidecarFailed):
        takes.scan_rows(table, np.array([every[5], deleted], dtype=np.uint64), ["id"])


def expected_hits(found: np.ndarray, asked: np.ndarray) -> set[tuple[int, int]]:
    """(index into `asked`, position in `found`) of every asked id that `found` holds."""
    where = {int(v): i for i, v in enumerate(found)}
    return {(i, where[int(v)]) for i, v in enumerate(asked) if int(v) in where}


def test_a_batch_finds_its_asked_rows_in_order_out_of_order_and_across_fragments() -> None:
    rng = np.random.default_rng(11)
    layouts = {  # row ids of a scan: fragment << 32 | offset
        "one fragment": np.arange(5_000, dtype=np.int64),
        "three, holes": np.concatenate([(f << 32) + np.flatnonzero(rng.random(3_000) > 0.2)
                                        for f in (0, 1, 4)]).astype(np.int64),
        "fragments out of order": np.concatenate([(f << 32) + np.arange(2_000) for f in (7, 2, 9, 3)]),
        "70,000 fragments": (np.arange(70_000, dtype=np.int64) * 3) << 32 | 5,  # more than 16 bits of them
    }
    for name, every in layouts.items():
        asked = [rng.choice(every, 1_500), every[rng.permutation(len(every))[:700]], every[-3:], every[:1]]
        for ids in asked:
            wanted = scans.Wanted(ids)
            for found in (every, every[100:1_000], rng.permutation(every[:2_500]), every[::-1].copy(),
                          every[len(every) // 2:], every[:1]):
                index, at = wanted.hits(found)
                assert len(index) == len(set(index.tolist())), name
                assert set(zip(index.tolist(), at.tolist())) == expected_hits(found, ids), name


def test_a_scan_is_chosen_only_where_it_costs_less_than_takes(local_read_ahead: None) -> None:
    # the bench's narrow tables: 12 B rows, readAheadBytes 256 MiB
    for per_byte in (takes.SCAN_HELD_PER_BYTE, takes.SCAN_IN_PLACE_PER_BYTE):
        big = takes.scan_window(256 * MIB, 12.0, 50_000_000, per_byte)
        assert big > 1_000_000 and takes.scan_pays(big, 12.0, 50_000_000)
        assert takes.scan_held(big, 12.0, per_byte) + big * 12.0 <= 256 * MIB  # and the result consumed
    small = takes.scan_window(256 * MIB, 12.0, 1_000_000)
    assert 2 * 26_400 <= small < big  # two of the bench's requests a scan
    # a budget that cannot hold a scan's own read-ahead, rows too large, a table too large
    assert takes.scan_window(takes.SCAN_HELD_BYTES, 12.0, 50_000_000) == 0
    assert takes.scan_window(256 * MIB, 65_536.0, 16_384) == 0
    assert takes.scan_window(256 * MIB, 12.0, 10**10) == 0
    # the rows a scan gathers must be many against the table's
    assert not takes.scan_pays(26_400, 12.0, 50_000_000)
    assert takes.scan_pays(26_400, 12.0, 1_000_000)


def test_takes_gather_requests_by_scans_and_hand_each_back_as_asked(
        db_uri: str, monkeypatch: pytest.MonkeyPatch, scans_pay: None) -> None:
    table, _ = reading.pin(data_spec(db_uri))
    every = row_ids(table)
    rng = np.random.default_rng(3)
    epochs = [rng.permutation(every) for _ in range(2)]
    asked = [(i, epochs[i // 10][(i % 10) * 50:(i % 10 + 1) * 50]) for i in range(20)]
    calls: dict[str, list[int]] = {"scan": [], "take": []}
    real_scan, real_take = takes.scan_rows, takes.take_rows

    def scanning(table: object, ids: np.ndarray, columns: list[str] | None, row: float) -> pa.RecordBatch:
        calls["scan"].append(len(ids))
        return real_scan(table, ids, columns, row)

    def taking(table: object, ids: np.ndarray, columns: list[str] | None) -> pa.RecordBatch:
        calls["take"].append(len(ids))
        return real_take(table, ids, columns)

    monkeypatch.setattr(takes, "scan_rows", scanning)
    monkeypatch.setattr(takes, "take_rows", taking)
    got = [(tag, ids_of(batch)) for tag, batch in takes.Takes(table, ["id"], iter(asked), 256 * MIB, scans=True)]
    expected = real_take(table, np.concatenate([ids for _, ids in asked]), ["id"])
    assert got == [(tag, ids_of(expected)[tag * 50:(tag + 1) * 50]) for tag, _ in asked]
    assert calls["take"][:2] == [50, 50]  # until a row's size is known: takes of one request
    assert calls["scan"] and sum(calls["scan"]) + sum(calls["take"]) == 1000
    calls["scan"].clear()
    assert [tag for tag, _ in takes.Takes(table, ["id"], iter(asked), 256 * MIB)] == list(range(20))
    assert not calls["scan"]  # scans are the caller's choice (local tables: reading._iter_planned)


def test_takes_run_one_scan_at_a_time_and_draw_a_window_only_once_its_scan_may_start(
        monkeypatch: pytest.MonkeyPatch, local_read_ahead: None) -> None:
    """The next window's scan runs while this window's rows are handed out, never beside
    another scan; its requests are drawn only when it may start (their row ids are held)."""
    per_request, budget, table_rows = 10_000, 256 * MIB, 2_000_000  # room for several scans
    lock = threading.Lock()
    state = {"drawn": 0, "asked": 0, "scans": 0, "most_scans": 0, "most_ahead": 0}

    class Table:
        def count_rows(self) -> int:
            return table_rows

    def rows(ids: np.ndarray) -> pa.RecordBatch:
        return pa.record_batch([pa.array(ids.astype(np.int64)), pa.array(ids.astype(np.int32))],
                               names=["id", "label"])

    def ahead(asked: int) -> None:
        """Rows drawn but not yet asked for, while a scan runs."""
        with lock:
            state["asked"] += asked
            state["most_ahead"] = max(state["most_ahead"], state["drawn"] - state["asked"])

    def fake_take(table: object, ids: np.ndarray, columns: object) -> pa.RecordBatch:
        with lock:
            state["asked"] += len(ids)
        return rows(ids)

    def fake_scan(table: object, ids: np.ndarray, columns: object, row: float) -> pa.RecordBatch:
        ahead(len(ids))
        with lock:
            state["scans"] += 1
            state["most_scans"] = max(state["most_scans"], state["scans"])
        time.sleep(0.05)
        ahead(0)
        with lock:
            state["scans"] -= 1
        return rows(ids)

    monkeypatch.setattr(takes, "take_rows", fake_take)
    monkeypatch.setattr(takes, "scan_rows", fake_scan)

    def requests() -> Iterator[tuple[int, np.ndarray]]:
        for i in range(100):
            with lock:
                state["drawn"] += per_request
            yield i, np.arange(i * per_request, (i + 1) * per_request, dtype=np.uint64)

    taken: takes.Takes[int] = takes.Takes(Table(), None, requests(), budget, scans=True, cpus=2)
    got = [(tag, batch.column("id").to_numpy()) for tag, batch in taken]
    assert [tag for tag, _ in got] == list(range(100))
    assert np.array_equal(np.concatenate([ids for _, ids in got]), np.arange(100 * per_request))
    window = takes.scan_window(budget, 12.0, table_rows, takes.SCAN_IN_PLACE_PER_BYTE)
    assert 3 * per_request <= window < 30 * per_request  # scans of several requests ...
    assert 3 * takes.scan_held(window, 12.0, takes.SCAN_IN_PLACE_PER_BYTE) < budget  # which would fit
    assert state["most_scans"] == 1  # ... one at a time
    assert state["most_ahead"] <= per_request  # one drawn to fill a window, not the next window


def test_a_reader_of_a_local_table_scans_and_gives_streaming_datasets_order(
        db_uri: str, monkeypatch: pytest.MonkeyPatch, scans_pay: None) -> None:
    scanned: list[int] = []
    real = takes.scan_rows

    def counting(table: object, ids: np.ndarray, columns: list[str] | None, row: float) -> pa.RecordBatch:
        scanned.append(len(ids))
        return real(table, ids, columns, row)

    monkeypatch.setattr(takes, "scan_rows", counting)
    for order in ({}, {"filter": "label != 3"}, {"shuffle_clump_size": 5}):
        table, data = reading.pin(data_spec(db_uri, read_batch_size=8, **order))
        splits = list(range(12, 24))  # rank 1 of 2
        with contextlib.closing(reading.iter_blocks(table, data, splits, start_global_step=0)) as blocks:
            got: list[int] = []
            steps: Iterator[tuple[int, pa.RecordBatch]] = blocks
            for _, block in steps:
                got += ids_of(block)
        expected: list[int] = []
        for epoch in range(data.epochs):
            rows = [r["id"] for r in reference_rows(data, epoch=epoch, rank=1, world_size=2)]
            expected += rows[:len(got) // data.epochs]
        assert got == expected, order
    assert scanned


def test_a_process_opening_a_local_table_has_lance_read_few_fragments_ahead(
        db_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """lance reads LANCE_DEFAULT_FRAGMENT_READAHEAD once, at a process's first scan or take:
    opening a local table sets it first (a value of the user's is kept), and a scan is held
    to what lance holds with it."""
    monkeypatch.setenv(takes.READAHEAD_ENV, "unset")
    monkeypatch.delenv(takes.READAHEAD_ENV)
    assert takes.lance_held() == takes.SCAN_HELD_BYTES_UNSET
    reading.open_table(data_spec(db_uri))
    assert os.environ[takes.READAHEAD_ENV] == str(takes.SCAN_READAHEAD)
    assert takes.lance_held() == takes.SCAN_HELD_BYTES < takes.SCAN_HELD_BYTES_UNSET
    monkeypatch.setenv(takes.READAHEAD_ENV, "16")  # the user's own
    reading.open_table(data_spec(db_uri))
    assert os.environ[takes.READAHEAD_ENV] == "16"
    assert takes.lance_held() == takes.SCAN_HELD_BYTES_UNSET

