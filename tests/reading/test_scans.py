"""Rows gathered by a scan of the table (takes.scan_rows) instead of takes by row id.

A scan must give exactly what `take_rows` gives (the rows asked, in the order asked,
an id asked twice given twice), whatever the table's fragments, deletions and the
batches lance hands out; and a reader that scans must still give StreamingDataset's
order, which tests/reading/test_determinism.py checks for every job variant (its local
tables are read with scans) and this module checks once more with the scans counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import lancedb
import numpy as np
import pyarrow as pa
import pytest

from splitfeed.sidecar import reading, takes
from splitfeed.trainer_client import errors
from tests.reading.tables import data_spec, ids_of, reference_rows

MIB = 1 << 20


def row_ids(table: object) -> np.ndarray:
    """Every row id of the table's version, in scan order."""
    got = table.search().select(["id"]).with_row_id(True).limit(None).to_arrow()  # type: ignore[attr-defined]
    return np.asarray(got.column("_rowid").to_numpy(), dtype=np.uint64)


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scans in batches of 1,024 rows: many batches, a fragment's rows in several."""
    monkeypatch.setattr(takes, "SCAN_BATCH_BYTES", 1)
    monkeypatch.setattr(takes, "SCAN_BATCH_ROWS", 1024)


def fragmented_table(path: Path) -> object:
    """5 fragments of 3,000 rows (`id` = row number), every 7th row of the second deleted."""
    db = lancedb.connect(str(path))
    table = None
    for part in range(5):
        ids = np.arange(part * 3000, (part + 1) * 3000, dtype=np.int64)
        batch = pa.table({"id": ids, "label": (ids % 10).astype(np.int32), "name": [f"r{i}" for i in ids]})
        table = db.create_table("t", batch) if table is None else table
        if part:
            table.add(batch)
    assert table is not None
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


def test_rows_of_a_batch_out_of_order_are_found_by_search() -> None:
    wanted = np.array([3, 8, 20, 21, 40], dtype=np.int64)
    for found in (np.array([21, 5, 3, 40, 9, 8], dtype=np.int64),  # unordered
                  np.array([0, 21, 2, 3, 4, 5, 6, 7, 8, 1], dtype=np.int64),  # a range's span, shuffled
                  np.arange(0, 50, dtype=np.int64)):  # a range in order
        index, at = takes._hits(found, wanted)
        hits = {int(wanted[i]) for i in index}
        assert hits == set(found.tolist()) & set(wanted.tolist())
        assert (found[at] == wanted[index]).all()


def test_a_scan_is_chosen_only_where_it_costs_less_than_takes() -> None:
    # the bench's narrow tables: 12 B rows, readAheadBytes 256 MiB
    big = takes.scan_window(256 * MIB, 12.0, 50_000_000)
    assert big > 1_000_000 and takes.scan_pays(big, 12.0, 50_000_000)
    assert takes.scan_held(big, 12.0) + big * 12.0 <= 256 * MIB  # a scan and the result consumed
    small = takes.scan_window(256 * MIB, 12.0, 1_000_000)
    assert 26_400 <= small < big
    # a budget that cannot hold a scan's own read-ahead, rows too large, a table too large
    assert takes.scan_window(64 * MIB, 12.0, 50_000_000) == 0
    assert takes.scan_window(256 * MIB, 65_536.0, 16_384) == 0
    assert takes.scan_window(256 * MIB, 12.0, 10**10) == 0
    # the rows a scan gathers must be many against the table's
    assert not takes.scan_pays(26_400, 12.0, 50_000_000)
    assert takes.scan_pays(26_400, 12.0, 1_000_000)


def test_takes_gather_requests_by_scans_and_hand_each_back_as_asked(
        db_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
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


def test_a_reader_of_a_local_table_scans_and_gives_streaming_datasets_order(
        db_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
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


def test_ids_are_sorted_with_the_order_they_were_asked_in() -> None:
    rng = np.random.default_rng(9)
    for ids in (rng.integers(0, 1 << 40, 5_000), rng.integers(0, 50, 5_000),  # packed, with repeats
                rng.integers(1 << 55, 1 << 62, 5_000), np.array([-3, 7, -3, 0])):  # too large, negative
        ids = ids.astype(np.int64)
        order, ordered = takes._sorted(ids)
        assert (order == np.argsort(ids, kind="stable")).all()
        assert (ordered == ids[order]).all()
