"""Reading through an object store with a real per-request latency (tests/support/s3_endpoint.py).

The table is written to a local folder that the endpoint serves as `s3://lake/db`;
the reference is lancedb's StreamingDataset over the same files read locally, so the
order through the store must be lancedb's, with reads overlapping (more than one
request in flight) and transient failures retried without a row lost or repeated.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitfeed.sidecar.world import checkpoints
from splitfeed.sidecar.data import positions, reading, streaming
from splitfeed.sidecar.table import planning, plans
from splitfeed.sidecar.forks import workers
from splitfeed.trainer_client.contract import errors
from tests.reading.tables import data_spec, ids_of, reference_rows, whole_batches, write_table
from tests.support.s3_endpoint import CREDENTIALS, S3Endpoint

BUCKET = "lake"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[S3Endpoint, str]]:
    """The endpoint, and the local path of the table it serves as s3://lake/db."""
    root = tmp_path_factory.mktemp("s3root")
    local = str(root / BUCKET / "db")
    write_table(local)
    with S3Endpoint(root) as endpoint:
        yield endpoint, local


def remote_spec(endpoint: S3Endpoint, **overrides: object):  # type: ignore[no-untyped-def]
    options = {k: v for k, v in endpoint.storage_options().items() if k not in CREDENTIALS}
    return data_spec(f"s3://{BUCKET}/db", storage_options=options, **{"epochs": 1, **overrides})


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_rank_through_a_slow_store_is_lancedbs_order_with_reads_overlapping(
        store: tuple[S3Endpoint, str], world: int) -> None:
    endpoint, local = store
    endpoint.latency_s = 0.01
    endpoint.reset_counters()
    try:
        # one step a take (readBatchSize 3 = G/N): an epoch is 13 takes, several in flight
        data = remote_spec(endpoint, global_batch_size=72, read_batch_size=3,
                           shuffle_clump_size=3 if world == 3 else 0)
        per_rank = data.global_batch_size // world
        for rank in range(world):
            got = [(step, ids_of(batch)) for step, batch in workers.iter_rank_batches(
                data, CREDENTIALS, rank=rank, world_size=world, start_global_step=0)]
            expected = whole_batches(reference_rows(data_spec(local, epochs=1, global_batch_size=72,
                                                              shuffle_clump_size=data.shuffle_clump_size),
                                                    epoch=0, rank=rank, world_size=world), per_rank)
            assert [ids for _, ids in got] == [[r["id"] for r in batch] for batch in expected]
            assert [step for step, _ in got] == list(range(len(expected)))
        assert endpoint.max_in_flight > 1  # the reads overlapped
    finally:
        endpoint.latency_s = 0.0


def test_transient_failures_while_reading_are_retried_and_lose_nothing(store: tuple[S3Endpoint, str]) -> None:
    endpoint, local = store
    data = remote_spec(endpoint, read_batch_size=2, read_ahead_bytes="1")  # a step a take, one ahead
    batches = workers.iter_rank_batches(data, CREDENTIALS, rank=0, world_size=2, start_global_step=0)
    got = [ids_of(batch) for _, batch in itertools.islice(batches, 3)]
    endpoint.reset_counters()
    endpoint.fail_next(2, 503)
    endpoint.reset_next(1)
    got += [ids_of(batch) for _, batch in batches]
    expected = whole_batches(reference_rows(data_spec(local, epochs=1), epoch=0, rank=0, world_size=2), 24)
    assert got == [[r["id"] for r in batch] for batch in expected]
    assert endpoint.statuses[503] == 2


def test_a_store_that_denies_the_table_ends_the_reader_with_one_line(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_table(str(root / BUCKET / "db"))
    with S3Endpoint(root) as endpoint:
        endpoint.deny(f"{BUCKET}/db")
        data = remote_spec(endpoint)
        with pytest.raises(errors.UserError) as info:
            next(workers.iter_rank_batches(data, CREDENTIALS, rank=0, world_size=1, start_global_step=0))
    message = str(info.value)
    assert "spec.data.uri='s3://lake/db'" in message and "\n" not in message


def test_plans_are_stored_and_read_through_the_object_store(store: tuple[S3Endpoint, str]) -> None:
    endpoint, _ = store
    table, data = reading.pin(remote_spec(endpoint), CREDENTIALS)
    location = plans.location_for(data, f"s3://{BUCKET}/ckpt/test/job/uid", endpoint.storage_options())
    rows = reading.layout(table, data).rows
    whole = planning.Source(location, builds=True).ids(table, data, 0, range(24), rows)
    assert (Path(store[1]).parent / "ckpt/test/job/uid/plans").is_dir()
    endpoint.reset_counters()
    part = planning.Source(location).ids(table, data, 0, range(12, 18), rows)
    assert (part == whole[12:18]).all()
    assert endpoint.requests["GET"] <= 4  # the footer, then one ranged read of six splits


def test_a_checkpoint_write_retries_a_failing_store_and_loses_nothing(store: tuple[S3Endpoint, str]) -> None:
    endpoint, _ = store
    data = data_spec("x")
    mine = checkpoints.provenance(data, table_version=1, job_uid="u1", world_epoch=0)
    store_ = checkpoints.Store(f"s3://{BUCKET}/ckpt", "test", "job", endpoint.storage_options(), uid="u1",
                               provenance=mine)
    store_.blobs.backoff_s = 0.01
    state = positions.state_dict(data, positions.Position(0, 3))
    endpoint.reset_counters()
    endpoint.fail_next(6, 503)  # more than pyarrow's own attempts
    store_.write(global_step=3, rank=0, world_size=1, state=state)
    store_.commit(global_step=3, rank=0, world_size=1)
    assert endpoint.statuses[503] == 6
    found = store_.find(3, streaming.merge_states, expect=mine)
    assert found is not None and found.state == state


def test_the_world_start_check_of_a_stored_plan_reads_its_footer_alone(store: tuple[S3Endpoint, str]) -> None:
    """verify runs at every world start: on a 10^9-row plan its ids are 8 GB. A reader's
    damaged split is reported through the store itself, where the builder looks."""
    endpoint, local = store
    table, data = reading.pin(remote_spec(endpoint), CREDENTIALS)
    root = "ckpt/test/job/verify"
    location = plans.location_for(data, f"s3://{BUCKET}/{root}", endpoint.storage_options())
    rows = reading.layout(table, data).rows
    planning.Source(location, builds=True).ids(table, data, 0, range(24), rows)
    key = plans.PlanKey.of(data)
    endpoint.reset_counters()
    footer = plans.verify(location, key, 0)
    assert footer is not None
    assert endpoint.bytes_sent < footer.ids_bytes // 4, endpoint.bytes_sent  # the footer, not the ids
    path = next((Path(local).parent / root).glob("plans/*/epoch-000000.plan"))
    raw = bytearray(path.read_bytes())
    raw[5 * footer.split_size * 8] ^= 0xFF  # split 5
    path.write_bytes(bytes(raw))
    assert plans.verify(location, key, 0) is not None  # nobody has read split 5 yet
    with pytest.raises(errors.UserError, match="split 5 fails its CRC") as info:
        planning.Source(location, timeout_s=0).ids(table, data, 0, range(4, 6), rows)
    assert not isinstance(info.value, errors.DataError)  # a restart cures it
    assert path.with_name(path.name + plans.DAMAGED).is_file()  # marked through the store
    assert plans.verify(location, key, 0) is None  # the next world's builder builds it again


def test_a_builders_requests_per_plan_do_not_grow_with_the_plans_stored(store: tuple[S3Endpoint, str]) -> None:
    """A job's 100th epoch must cost its builder what its 2nd did: the check that the stored
    plans are this lancedb's (3 requests a plan) runs once per builder, not at every build."""
    from splitfeed.sidecar.forks import planner

    endpoint, _ = store
    table, data = reading.pin(remote_spec(endpoint, epochs=8), CREDENTIALS)
    location = plans.location_for(data, f"s3://{BUCKET}/ckpt/test/job/requests", endpoint.storage_options())
    builder = planner.Planner(data, CREDENTIALS, location, rows=reading.layout(table, data).rows)
    counted = []
    for epoch in range(8):
        endpoint.reset_counters()
        builder.ensure(epoch)
        counted.append(sum(endpoint.requests.values()))
    assert len(set(counted[1:])) == 1, counted
    key = plans.PlanKey.of(data)
    assert all(plans.verify(location, key, epoch) for epoch in range(8))
