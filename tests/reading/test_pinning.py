"""A job reads one table version from start to end, whatever is written meanwhile.

The table under test is written, pinned, then changed (append, delete, update,
overwrite) between a checkpoint and a resume, or between two epochs. The
reference is lancedb's StreamingDataset iterated in-process over `db_uri`, a
twin of the table as it was when pinned that nobody writes to; each test also
shows that the change it makes would alter the batches if the version were not
pinned, so a pin that silently follows the latest version fails it.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Callable
from typing import Any

import lancedb
import pytest

from splitfeed.sidecar.data import reading
from splitfeed.sidecar.forks import workers
from splitfeed.trainer_client.contract import errors, specs, topology
from tests.reading.tables import TABLE, as_rows, data_spec, frames, reference_rows, whole_batches, write_table

W_BEFORE, W_AFTER = 2, 3
RANK_AFTER = 1


def lance_table(uri: str) -> Any:
    return lancedb.connect(uri).open_table(TABLE)


def append(uri: str) -> None:
    lance_table(uri).add(frames(200))


def delete(uri: str) -> None:
    lance_table(uri).delete("label = 3")


def update(uri: str) -> None:
    lance_table(uri).update(where="id < 500", values={"label": 99})


def overwrite(uri: str) -> None:
    lancedb.connect(uri).create_table(TABLE, frames(700), mode="overwrite")


def clean_up_old_versions(uri: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "removes every version except the latest"
        lance_table(uri).optimize(cleanup_older_than=datetime.timedelta(0), delete_unverified=True)


WRITES = [pytest.param(f, id=f.__name__) for f in (append, delete, update, overwrite)]


@pytest.fixture()
def table_uri(tmp_path: Any) -> str:
    """A fresh copy of the `frames` table (one version) that a test may write to."""
    uri = str(tmp_path / "db")
    write_table(uri)
    return uri


def rank_batches(table: Any, data: specs.DataSpec, rank: int, world_size: int,
                 start: int = 0, stop: int | None = None) -> list[list[dict[str, Any]]]:
    splits = topology.rank_splits(rank, world_size, data.num_splits)
    return [as_rows(b) for _, b in reading.iter_blocks(table, data, splits, start_global_step=start,
                                                       stop_global_step=stop)]


def reference(twin: specs.DataSpec, rank: int, world_size: int) -> list[list[dict[str, Any]]]:
    """Every epoch's batches of `rank`, from StreamingDataset over the untouched twin."""
    size = twin.global_batch_size // world_size
    out: list[list[dict[str, Any]]] = []
    for epoch in range(twin.epochs):
        out += whole_batches(reference_rows(twin, epoch=epoch, rank=rank, world_size=world_size), size)
    return out


def test_pin_fixes_the_latest_version_as_a_number(table_uri: str) -> None:
    append(table_uri)
    table, data = reading.pin(data_spec(table_uri))
    assert data.version == reading.table_version(table) == 2
    append(table_uri)
    assert reading.table_version(table) == 2  # checked out: no longer follows the latest
    assert reading.table_version(reading.open_table(data)) == 2
    assert reading.table_version(reading.open_table(data_spec(table_uri))) == 3


@pytest.mark.parametrize("write", WRITES)
def test_writes_between_a_checkpoint_and_a_resume_change_nothing(
    table_uri: str, db_uri: str, write: Callable[[str], None]
) -> None:
    table, data = reading.pin(data_spec(table_uri))
    spe = reading.layout(table, data).steps_per_epoch
    checkpoint = spe // 2
    before = rank_batches(table, data, 0, W_BEFORE, stop=checkpoint)
    write(table_uri)
    # A new world (new process, new world size) opens the table from the spec the sidecar pinned.
    after = rank_batches(reading.open_table(data), data, RANK_AFTER, W_AFTER, start=checkpoint)
    twin = data_spec(db_uri)
    assert before == reference(twin, 0, W_BEFORE)[:checkpoint]
    assert after == reference(twin, RANK_AFTER, W_AFTER)[checkpoint:]
    # Without the pin the same resume would deliver other rows: the write matters.
    latest = reading.open_table(data_spec(table_uri))
    assert rank_batches(latest, data_spec(table_uri), RANK_AFTER, W_AFTER, start=checkpoint) != after


@pytest.mark.parametrize("write", WRITES)
def test_writes_between_epochs_change_nothing(table_uri: str, db_uri: str, write: Callable[[str], None]) -> None:
    table, data = reading.pin(data_spec(table_uri))
    spe = reading.layout(table, data).steps_per_epoch
    splits = topology.rank_splits(0, W_BEFORE, data.num_splits)
    got = []
    for step, block in reading.iter_blocks(table, data, splits, start_global_step=0):
        got.append(as_rows(block))
        if step == spe - 1:
            write(table_uri)  # the next epoch's permutation is built after this
    assert len(got) == 2 * spe
    assert got == reference(data_spec(db_uri), 0, W_BEFORE)
    unpinned = data_spec(table_uri)
    assert rank_batches(reading.open_table(unpinned), unpinned, 0, W_BEFORE, start=spe) != got[spe:]


def test_loader_workers_open_the_pinned_version(table_uri: str, db_uri: str) -> None:
    _, data = reading.pin(data_spec(table_uri, epochs=1, num_workers=2))
    overwrite(table_uri)
    got = [as_rows(b) for _, b in workers.iter_rank_batches(data, {}, rank=1, world_size=2, start_global_step=0)]
    assert got == reference(data_spec(db_uri, epochs=1), 1, 2)


def test_a_tag_pins_the_version_it_names(table_uri: str, db_uri: str) -> None:
    lance_table(table_uri).tags.create("before-cleanup", 1)
    overwrite(table_uri)
    table, data = reading.pin(data_spec(table_uri, version="before-cleanup"))
    assert data.version == 1
    assert rank_batches(table, data, 0, 1) == reference(data_spec(db_uri), 0, 1)


def test_an_already_pinned_number_wins_over_the_spec(table_uri: str) -> None:
    append(table_uri)
    lance_table(table_uri).tags.create("moving", 2)
    _, data = reading.pin(data_spec(table_uri, version="moving"), pinned=1)
    assert data.version == 1


@pytest.mark.parametrize("how", ["spec", "pinned"])
def test_a_cleaned_up_version_is_a_data_error_that_says_how_to_keep_one(table_uri: str, how: str) -> None:
    _, data = reading.pin(data_spec(table_uri))
    overwrite(table_uri)
    clean_up_old_versions(table_uri)
    with pytest.raises(errors.DataError) as info:
        if how == "spec":
            reading.open_table(data)
        else:
            reading.pin(data_spec(table_uri), pinned=1)
    message = str(info.value)
    assert "version 1" in message and "does not exist" in message
    assert "never falls back to the latest version" in message
    assert "tag it" in message and "keep versions longer" in message


def test_a_missing_tag_is_a_data_error(table_uri: str) -> None:
    with pytest.raises(errors.DataError, match="tag 'nightly'"):
        reading.pin(data_spec(table_uri, version="nightly"))


def test_a_version_cleaned_up_while_a_job_reads_it_is_a_data_error(table_uri: str) -> None:
    # One step per take and one take in flight: the reads of epoch 1 happen after the
    # clean-up (with the default read-ahead a table this small is read whole at once).
    table, data = reading.pin(data_spec(table_uri, read_batch_size=2, read_ahead_bytes="1"))
    spe = reading.layout(table, data).steps_per_epoch
    blocks = reading.iter_blocks(table, data, topology.rank_splits(0, 1, data.num_splits), start_global_step=0)
    with pytest.raises(errors.DataError, match="version 1, which this job reads"):
        for step, _ in blocks:
            if step == spe - 1:
                overwrite(table_uri)
                clean_up_old_versions(table_uri)
