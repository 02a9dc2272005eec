"""Bad input reaches the person who can fix it as a clear error, never as a hang.

A missing table, a filter that leaves too few rows or does not parse, a missing
column: UserError naming the field. A read that fails inside a loader worker
process: its error text in the parent, and no worker left behind.
"""

from __future__ import annotations

import multiprocessing
import os
import pathlib

import pytest

from splitfeed.sidecar.forks import workers
from splitfeed.trainer_client.contract import errors, specs
from tests.reading import dying
from tests.reading.tables import TABLE, data_spec, write_table


def first_batch(data: specs.DataSpec, *, world_size: int = 2) -> object:
    return next(workers.iter_rank_batches(data, {}, rank=0, world_size=world_size,
                                          start_global_step=0))


def test_an_unparsable_filter_is_the_users_to_fix(db_uri: str) -> None:
    with pytest.raises(errors.UserError, match=r"(?s)spec\.data\.filter='id <<>> 3'.*sql parser error"):
        first_batch(data_spec(db_uri, filter="id <<>> 3"))


def test_a_worker_sends_a_user_error_as_the_users_text(db_uri: str) -> None:
    # The worker's entry point, run in this process (spawning costs seconds):
    # its error frame becomes a UserError in the parent, with the worker's text.
    receiver, sender = multiprocessing.Pipe(duplex=False)
    data = data_spec(db_uri, filter="id <<>> 3", num_workers=2)
    workers._worker_main(sender, data, {}, 0, 2, 1, 0, None)
    with pytest.raises(errors.UserError, match=r"(?s)spec\.data\.filter='id <<>> 3'.*sql parser error"):
        workers._receive(receiver, multiprocessing.current_process(), 1, 0)
    receiver.close()


def test_a_missing_table_is_named_and_the_existing_ones_listed(db_uri: str) -> None:
    with pytest.raises(errors.UserError, match=r"spec\.data\.table='clips' does not exist") as info:
        first_batch(data_spec(db_uri, table="clips"))
    assert repr(TABLE) in str(info.value)


def test_a_filter_that_leaves_fewer_rows_than_splits_names_both(db_uri: str) -> None:
    with pytest.raises(errors.UserError) as info:
        first_batch(data_spec(db_uri, filter="id < 10"))
    message = str(info.value)
    assert "has 10 rows after spec.data.filter='id < 10'" in message
    assert "spec.data.numSplits=24" in message


def test_a_missing_column_is_named(db_uri: str) -> None:
    with pytest.raises(errors.UserError, match=r"spec\.data\.columns names \['nope'\]"):
        first_batch(data_spec(db_uri, columns=("id", "nope")))


def test_a_table_too_small_for_one_global_step_says_so(db_uri: str) -> None:
    # 1000 rows in 24 splits of 41 rows cannot fill a step taking 48 rows per split.
    with pytest.raises(errors.UserError, match=r"cannot fill one global step"):
        first_batch(data_spec(db_uri, global_batch_size=24 * 48))


def test_a_read_that_fails_in_a_worker_process_reaches_the_parent_with_its_text(
    tmp_path: pathlib.Path,
) -> None:
    uri = str(tmp_path / "db")
    write_table(uri)
    for fragment in (tmp_path / "db" / f"{TABLE}.lance" / "data").iterdir():
        os.remove(fragment)  # the table opens and splits; reading its rows fails
    data = data_spec(uri, num_workers=2)
    with pytest.raises(errors.SidecarFailed, match=r"(?s)loader worker 0 of rank 0 failed.*Not found"):
        first_batch(data)
    assert multiprocessing.active_children() == []


def test_a_worker_that_dies_silently_reads_as_a_failure_not_a_hang() -> None:
    # Once the parent has dropped its writer end, the worker's death is EOF.
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=dying.exit_holding, args=(sender, 3))
    process.start()
    sender.close()
    with pytest.raises(errors.SidecarFailed, match=r"loader worker 1 of rank 2 exited \(code 3\)"):
        workers._receive(receiver, process, 1, 2)
    receiver.close()
    process.join()
    process.close()
