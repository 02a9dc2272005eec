"""The checkpoint store, on local disk and on S3 (moto): two phases, provenance, fencing.

Every test runs against both backends. States are the ones the sidecar writes
(`positions.state_dict`), merged by lancedb's `StreamingDataset.merge_state_dicts`;
the resume test then compares what splitfeed reads from the loaded position of
the pinned table, after the table changed, with StreamingDataset itself loading
that state over an untouched twin of the table.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow.fs as pafs
import pytest

from splitfeed.sidecar.world import blobs, checkpoints, identity
from splitfeed.sidecar.data import positions, reading, streaming
from splitfeed.trainer_client.contract import errors, specs, topology
from tests.reading.tables import (
    CREDENTIALS,
    as_rows,
    data_spec,
    endpoint_options,
    frames,
    reference_rows,
    whole_batches,
    write_table,
)

UID, OTHER_UID = "3f2c-uid-one", "9a7d-uid-two"
SPE = 20  # steps per epoch of the tests' job on the 1000-row table
Store = checkpoints.Store


@dataclasses.dataclass
class Target:
    uri: str
    options: dict[str, str]

    def store(self, *, uid: str = UID, world_epoch: int = 0, data: specs.DataSpec | None = None,
              table_version: int = 1, job: str = "job") -> Store:
        data = data or pinned_data()
        store = Store(self.uri, "ns", job, self.options, uid=uid, provenance=checkpoints.provenance(
            data, table_version=table_version, job_uid=uid, world_epoch=world_epoch))
        store.blobs.backoff_s = 0.001
        return store


def pinned_data(**overrides: Any) -> specs.DataSpec:
    return data_spec("/data/db", version=1, **overrides)


def expect(data: specs.DataSpec | None = None, table_version: int = 1, uid: str = UID) -> dict[str, Any]:
    return checkpoints.provenance(data or pinned_data(), table_version=table_version, job_uid=uid, world_epoch=99)


@pytest.fixture(params=["local", "s3"])
def target(request: pytest.FixtureRequest, tmp_path: Any) -> Target:
    if request.param == "local":
        return Target(str(tmp_path / "ckpt"), {})
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    return Target(f"s3://{bucket}/ckpt-{uuid.uuid4().hex[:8]}", {**CREDENTIALS, **endpoint_options(endpoint)})


def save(store: Store, step: int, world_size: int, *, commit: Iterator[int] | range | list[int] | None = None,
         data: specs.DataSpec | None = None) -> None:
    """Every rank's record for `step` as the sidecar writes it; commit markers for `commit`
    (default: every rank)."""
    state = positions.state_dict(data or pinned_data(), positions.position_of(step, SPE))
    for rank in range(world_size):
        store.write(global_step=step, rank=rank, world_size=world_size, state=state)
    for rank in range(world_size) if commit is None else commit:
        store.commit(global_step=step, rank=rank, world_size=world_size)


def newest_step(store: Store, **kwargs: Any) -> int | None:
    found = store.newest(streaming.merge_states, expect=expect(), **kwargs)
    return None if found is None else found.step


# --- two phases -------------------------------------------------------------------


def test_a_committed_step_resumes_exactly_on_another_world_size_after_the_table_changed(
    target: Target, tmp_path: Any, db_uri: str
) -> None:
    table_uri = str(tmp_path / "db")
    write_table(table_uri)
    _, data = reading.pin(data_spec(table_uri))
    store = target.store(data=data)
    save(store, 13, 2, data=data)
    reading.open_table(data_spec(table_uri)).add(frames(300))  # written after the checkpoint

    merged = store.load(13, streaming.merge_states, expect=checkpoints.provenance(
        data, table_version=1, job_uid=UID, world_epoch=1))
    position = positions.position_from_state(data, merged)
    assert position == positions.Position(0, 13)
    table = reading.open_table(data)
    splits = topology.rank_splits(1, 3, data.num_splits)
    got = [as_rows(b) for _, b in reading.iter_blocks(table, data, splits, start_global_step=13, stop_global_step=SPE)]
    rows = reference_rows(data_spec(db_uri), epoch=0, rank=1, world_size=3, state=merged)
    assert got == whole_batches(rows, data.global_batch_size // 3)
    assert len(got) == SPE - 13


def test_a_prepared_step_is_not_resumed_until_every_rank_committed(target: Target) -> None:
    store = target.store()
    save(store, 3, 2)
    save(store, 7, 2, commit=[0])
    assert newest_step(store) == 3
    with pytest.raises(errors.UserError, match="step 7 .* is not complete"):
        store.load(7, streaming.merge_states, expect=expect())
    store.commit(global_step=7, rank=1, world_size=2)
    assert newest_step(store) == 7
    assert store.load(7, streaming.merge_states, expect=expect()) == positions.state_dict(
        pinned_data(), positions.Position(0, 7))


def test_a_corrupt_record_makes_its_step_incomplete(target: Target, caplog: pytest.LogCaptureFixture) -> None:
    store = target.store()
    save(store, 3, 2)
    save(store, 7, 2)
    with store.blobs.fs.open_output_stream(store.record_path(7, 1, 2)) as f:
        f.write(b'{"version": 2, "globalStep": 7, "sta')
    with caplog.at_level(logging.WARNING):
        assert newest_step(store) == 3
    assert "corrupt" in caplog.text


def test_no_store_and_no_steps_mean_step_0(target: Target) -> None:
    assert newest_step(target.store()) is None
    assert target.store().pinned_version() is None


# --- provenance -------------------------------------------------------------------


@pytest.mark.parametrize("change,field", [
    pytest.param({"global_batch_size": 96}, "spec.data.globalBatchSize", id="globalBatchSize"),
    pytest.param({"shuffle": False}, "spec.data.shuffle", id="shuffle"),
    pytest.param({"shuffle_seed": 8}, "spec.data.shuffleSeed", id="shuffleSeed"),
    pytest.param({"shuffle_clump_size": 4}, "spec.data.shuffleClumpSize", id="shuffleClumpSize"),
    pytest.param({"columns": ("id",)}, "spec.data.columns", id="columns"),
    pytest.param({"filter": "label < 5"}, "spec.data.filter", id="filter"),
    pytest.param({"num_splits": 12}, "spec.data.numSplits", id="numSplits"),
    pytest.param({"table": "other"}, "spec.data.table", id="table"),
    pytest.param({"uri": "/elsewhere"}, "spec.data.uri", id="uri"),
    pytest.param({"version": 2}, "the table version", id="tableVersion"),
])
def test_a_changed_order_field_is_refused_naming_it(target: Target, change: dict[str, Any], field: str) -> None:
    store = target.store()
    save(store, 5, 2)
    changed = dataclasses.replace(pinned_data(), **change)
    wanted = expect(changed, table_version=int(changed.version or 1))
    for attempt in (lambda: store.newest(streaming.merge_states, expect=wanted),
                    lambda: store.load(5, streaming.merge_states, expect=wanted)):
        with pytest.raises(checkpoints.ProvenanceMismatch) as info:
            attempt()
        assert len(info.value.fields) == 1 and field in str(info.value)
        assert "Set those fields back" in str(info.value) and "create a new StreamingJob" in str(info.value)


def test_every_differing_field_is_named_and_epochs_may_change(target: Target) -> None:
    store = target.store()
    save(store, 5, 2)
    more_epochs = dataclasses.replace(pinned_data(), epochs=5)
    assert store.newest(streaming.merge_states, expect=expect(more_epochs)) is not None
    changed = dataclasses.replace(pinned_data(), global_batch_size=96, shuffle_seed=1)
    with pytest.raises(checkpoints.ProvenanceMismatch) as info:
        store.newest(streaming.merge_states, expect=expect(changed))
    assert info.value.fields == ["shuffleSeed", "globalBatchSize"]
    assert "spec.data.shuffleSeed: the checkpoint has 7, this job has 1" in str(info.value)
    assert isinstance(info.value, errors.DataError)  # the operator fails the job at once


def test_check_provenance_compares_only_the_order_fields() -> None:
    ours = expect()
    checkpoints.check_provenance(ours, {**ours, "worldEpoch": 3, "epochs": 9, "jobUid": "x"})
    with pytest.raises(checkpoints.ProvenanceMismatch, match="spec.data.filter"):
        checkpoints.check_provenance(ours, {**ours, "filter": "id > 3"})


# --- a job's checkpoints are its own ------------------------------------------------


def job_spec(target: Target, resume_from: specs.ResumeFrom | None = None) -> specs.JobSpec:
    return specs.JobSpec(name="job", namespace="ns", data=pinned_data(),
                         checkpoint=specs.CheckpointSpec(uri=target.uri, resume_from=resume_from))


def test_a_re_created_job_starts_at_0_unless_it_names_the_old_ones(target: Target) -> None:
    save(target.store(uid=UID), 9, 2)
    recreated = checkpoints.stores(job_spec(target), uid=OTHER_UID, storage_options=target.options)
    assert checkpoints.newest(recreated, streaming.merge_states, expect=expect(uid=OTHER_UID)) is None

    named = checkpoints.stores(job_spec(target, specs.ResumeFrom(uid=UID)), uid=OTHER_UID,
                               storage_options=target.options, provenance=expect(uid=OTHER_UID))
    found = checkpoints.newest(named, streaming.merge_states, expect=expect(uid=OTHER_UID))
    assert found is not None and (found.step, found.world_size) == (9, 2)
    assert checkpoints.load(named, 9, streaming.merge_states, expect=expect(uid=OTHER_UID)) == found.state
    assert named[1].pinned_version() is None  # no world markers in this test

    with pytest.raises(checkpoints.ProvenanceMismatch, match="globalBatchSize"):  # checked in full
        checkpoints.newest(named, streaming.merge_states,
                           expect=expect(dataclasses.replace(pinned_data(), global_batch_size=96), uid=OTHER_UID))

    # Once the new job has a checkpoint of its own, that one is resumed.
    for store in named:
        store.blobs.backoff_s = 0.001
    save(named[0], 4, 3)
    found = checkpoints.newest(named, streaming.merge_states, expect=expect(uid=OTHER_UID))
    assert found is not None and (found.step, found.world_size) == (4, 3)


def test_resume_from_another_name(target: Target) -> None:
    save(target.store(uid=UID, job="old-job"), 6, 2)
    named = checkpoints.stores(job_spec(target, specs.ResumeFrom(uid=UID, name="old-job")), uid=OTHER_UID,
                               storage_options=target.options)
    found = checkpoints.newest(named, streaming.merge_states, expect=expect())
    assert found is not None and found.step == 6


def test_a_record_claiming_another_job_is_refused(target: Target) -> None:
    impostor = Store(target.uri, "ns", "job", target.options, uid=UID, provenance={
        **expect(uid=OTHER_UID), "worldEpoch": 0})
    save(impostor, 2, 1)
    with pytest.raises(checkpoints.ProvenanceMismatch, match="jobUid"):
        target.store().newest(streaming.merge_states, expect=expect())


# --- fencing ----------------------------------------------------------------------


def test_a_stale_world_can_neither_outrank_nor_overwrite_the_new_one(target: Target) -> None:
    world1 = target.store(world_epoch=1)
    world1.start_world(resume_step=0)
    save(world1, 10, 2)
    save(world1, 14, 2, commit=[0])  # in flight when world 1 was replaced

    world2 = target.store(world_epoch=2)
    world2.start_world(resume_step=10)
    assert newest_step(world2) == 10

    # A pod of world 1 that never got the message completes step 14 and goes on to 16.
    world1.commit(global_step=14, rank=1, world_size=2)
    save(world1, 16, 2)
    assert newest_step(world2) == 10
    with pytest.raises(errors.UserError, match="not complete"):
        world2.load(14, streaming.merge_states, expect=expect())
    with pytest.raises(checkpoints.StaleWorld, match="world 2 of this job has started"):
        world1.start_world(resume_step=14)

    # World 2 (same world size) writes steps 12 and 16: its own files, newest world used.
    save(world2, 12, 2)
    save(world2, 16, 2)
    found = world2.newest(streaming.merge_states, expect=expect())
    assert found is not None and (found.step, found.world_epoch) == (16, 2)
    names = sorted(i.base_name for i in world2.blobs.fs.get_file_info(
        pafs.FileSelector(world2.record_path(16, 0, 2).rsplit("/", 1)[0])))
    assert names == sorted(f"w{e:06d}-rank-{r:05d}-of-00002.{x}" for e in (1, 2) for r in (0, 1)
                           for x in ("json", "commit"))


def test_a_world_marker_is_written_once_and_pins_the_table_version(target: Target) -> None:
    world3 = target.store(world_epoch=3, table_version=4)
    world3.start_world(resume_step=0)
    target.store(world_epoch=3, table_version=5).start_world(resume_step=8)  # a restarted coordinator
    assert world3.worlds()[3]["resumeStep"] == 0
    assert world3.pinned_version() == 4
    target.store(world_epoch=4, table_version=4).start_world(resume_step=0)
    assert sorted(world3.worlds()) == [3, 4] and world3.newest_world() == 4
    assert target.store(uid=OTHER_UID).newest_world() is None


# --- transient storage errors -------------------------------------------------------------


class Flaky:
    """A pyarrow filesystem whose listings and reads fail `failures` times, then work."""

    def __init__(self, fs: pafs.FileSystem, failures: int, only: str = "") -> None:
        self._fs, self.failures, self._only = fs, failures, only

    def _maybe_fail(self, what: str) -> None:
        if self.failures and self._only in what:
            self.failures -= 1
            raise OSError(f"AWS Error NETWORK_CONNECTION during {what}")

    def get_file_info(self, selector: pafs.FileSelector) -> Any:
        self._maybe_fail(selector.base_dir)
        return self._fs.get_file_info(selector)

    def open_input_stream(self, path: str) -> Any:
        self._maybe_fail(path)
        return self._fs.open_input_stream(path)


@pytest.mark.parametrize("only", ["", "step-000000000007", "worlds"])
def test_transient_read_errors_are_retried_not_skipped(
    target: Target, only: str, caplog: pytest.LogCaptureFixture
) -> None:
    writer = target.store(world_epoch=1)
    writer.start_world(resume_step=0)
    save(writer, 3, 2)
    save(writer, 7, 2)
    reader = target.store(world_epoch=1)
    reader.blobs.fs = Flaky(reader.blobs.fs, failures=3, only=only)  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING):
        assert newest_step(reader) == 7  # never the older step 3
    assert reader.blobs.fs.failures == 0 and "retry 1 of 4" in caplog.text
    reader.blobs.fs.failures = 3
    assert reader.load(7, streaming.merge_states, expect=expect())["epoch"] == 0


def test_a_store_that_keeps_failing_is_an_error_not_an_older_step(target: Target) -> None:
    writer = target.store()
    save(writer, 3, 2)
    save(writer, 7, 2)
    reader = target.store()
    reader.blobs.fs = Flaky(reader.blobs.fs, failures=100, only="step-000000000007")  # type: ignore[assignment]
    with pytest.raises(blobs.StoreUnavailable, match="failed 5 times"):
        newest_step(reader)
    with pytest.raises(blobs.StoreUnavailable):
        reader.load(7, streaming.merge_states, expect=expect())


# --- the pod's identity ---------------------------------------------------------------


def test_the_identity_comes_from_the_environment() -> None:
    found = identity.from_env({"SPLITFEED_JOB_UID": "u-1", "SPLITFEED_WORLD_EPOCH": "3",
                               "SPLITFEED_TABLE_VERSION": "12"})
    assert found == identity.Identity("u-1", 3, 12)
    assert identity.from_env({"SPLITFEED_JOB_UID": "u-1"}) == identity.Identity("u-1", 0, None)
    assert identity.from_env({"SPLITFEED_WORLD_EPOCH": "2"}, need_uid=False) == identity.Identity("", 2, None)


@pytest.mark.parametrize("env,words", [
    ({}, "SPLITFEED_JOB_UID is not set"),
    ({"SPLITFEED_JOB_UID": "a/b"}, "cannot name a checkpoint directory"),
    ({"SPLITFEED_JOB_UID": "u", "SPLITFEED_TABLE_VERSION": "x"}, "SPLITFEED_TABLE_VERSION='x'"),
])
def test_a_bad_identity_names_the_variable(env: dict[str, str], words: str) -> None:
    with pytest.raises(errors.UserError, match=words):
        identity.from_env(env)



@pytest.mark.parametrize("ranks", [1, 3])
def test_identical_rank_states_merge_as_lancedb_merges_them(ranks: int) -> None:
    """streaming.merge_states skips lancedb for a plain job's identical states: its answer is
    lancedb's own, and unequal states still go to lancedb."""
    from lancedb.streaming import StreamingDataset

    data = specs.DataSpec(uri="x", table="t", num_splits=6, global_batch_size=12)
    state = positions.state_dict(data, positions.Position(1, 4))
    states = [dict(state) for _ in range(ranks)]
    assert streaming.merge_states(states) == StreamingDataset.merge_state_dicts(states)
    skipped = positions.state_after(data, positions.Position(1, 4), {2: 11})
    assert streaming.merge_states([state, skipped]) == StreamingDataset.merge_state_dicts([state, skipped])
    assert streaming.merge_states([state, skipped])["positions_consumed_per_split"][2] == 11


def test_a_store_on_the_tables_kind_of_store_gets_its_endpoint() -> None:
    """An R2 / MinIO endpoint in spec.data.storageOptions serves the checkpoints too (they went
    to AWS's endpoint before); the Secret's keys win; another kind of store gets none."""
    job = specs.parse_job({"apiVersion": specs.API_VERSION, "kind": specs.KIND, "metadata": {"name": "j"},
                           "spec": {"data": {"uri": "s3://lake/db", "table": "t", "numSplits": 2,
                                             "globalBatchSize": 4,
                                             "storageOptions": {"aws_endpoint": "https://r2", "region": "auto"}},
                                    "checkpoint": {"uri": "s3://lake/ckpt"}}})
    secret = {"aws_access_key_id": "k", "region": "eu"}
    assert checkpoints.store_options(job, secret) == {"aws_endpoint": "https://r2", "region": "eu",
                                                      "aws_access_key_id": "k"}
    local = dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, uri="/ckpt"))
    assert checkpoints.store_options(local, secret) == secret
