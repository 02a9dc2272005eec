"""Data-ready histograms and the world's progress: the pure parts (trainer_client.stalls, .progress)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from splitfeed.trainer_client.contract import messages, progress, stalls
from splitfeed.trainer_client.contract.errors import ProtocolError


def counts_at(**by_bound: int) -> list[int]:
    """A histogram with `n` waits in the bucket whose upper bound is the given one (b0_01=3 -> 3 waits <= 0.01 s)."""
    out = [0] * stalls.NUM_BUCKETS
    for key, n in by_bound.items():
        bound = float(key[1:].replace("_", "."))
        out[stalls.BUCKETS_S.index(bound)] += n
    return out


def test_a_wait_lands_in_the_bucket_whose_upper_bound_holds_it():
    assert stalls.bucket_of(0.0) == 0
    assert stalls.bucket_of(0.0001) == 0  # le is inclusive, as Prometheus'
    assert stalls.bucket_of(0.00011) == 1
    assert stalls.bucket_of(0.07) == stalls.BUCKETS_S.index(0.1)
    assert stalls.bucket_of(99.0) == stalls.NUM_BUCKETS - 1


def test_quantiles_interpolate_inside_the_bucket_like_histogram_quantile():
    # 100 waits, all in (0.05, 0.1]: the median is half way, 0.075.
    counts = counts_at(b0_1=100)
    assert stalls.quantile(counts, 0.5) == pytest.approx(0.075)
    assert stalls.quantile(counts, 0.99) == pytest.approx(0.0995)
    # 90 fast, 10 slow: p50 among the fast, p95 and p99 among the slow.
    counts = counts_at(b0_001=90, b1_0=10)
    assert stalls.quantile(counts, 0.5) < 0.001
    assert 0.5 < stalls.quantile(counts, 0.95) <= 1.0
    assert stalls.quantile([0] * stalls.NUM_BUCKETS, 0.5) is None


def test_the_first_batch_is_start_up_and_the_share_is_waiting_over_wall_time():
    s = stalls.Stalls()
    assert s.record(5.0, now=100.0) is None  # start-up
    for i in range(1, 11):
        s.record(0.3, now=100.0 + i)  # one batch a second, 0.3 s of it waiting
    summary = s.summary()
    assert summary.batches == 10
    assert summary.wall_s == pytest.approx(10.0)
    assert summary.stall_share == pytest.approx(0.3)
    assert 0.25 <= summary.p50_s <= 0.5


def test_merge_adds_ranks_bucket_by_bucket():
    assert stalls.merge([counts_at(b0_01=2), counts_at(b0_01=3, b1_0=1)]) == counts_at(b0_01=5, b1_0=1)


def member(replica: int, step: int, **over: object) -> messages.Progress:
    fields = {"replica": replica, "global_step": step, "steps_per_epoch": 20, "rows": 480, "rows_per_s": 100.0,
              "wait_s": 1.0, "wall_s": 4.0, "buckets": counts_at(b0_1=9), "filled_rows": 0, "skipped_rows": 0,
              **over}
    return messages.Progress(**fields)


def answered(members: list[messages.Progress], **world: object) -> messages.Status:
    """The coordinator's `status` answer as the operator gets it (sidecar/world/agreement.py builds it the same way)."""
    return progress.world_status(members, **world)


def test_the_world_moves_at_its_slowest_member_and_sums_the_rest():
    answer = progress.world_status([member(0, 27), member(1, 25)], replicas=2, total_steps=60, resume_step=10,
                                   drain_step=None)
    assert answer.global_step == 25
    assert answer.rows_per_s == 200.0 and answer.wait_s == 2.0 and answer.wall_s == 8.0
    assert answer.buckets == counts_at(b0_1=18)
    status = progress.status_progress(answer, {})
    assert status is not None
    assert (status["globalStep"], status["epoch"], status["step"], status["stepsPerEpoch"]) == (25, 1, 5, 20)
    assert status["dataStallShare"] == 0.25 and status["rowsPerSecond"] == 200.0
    assert 0.05 < status["dataReady"]["p50Seconds"] <= 0.1


def test_no_progress_until_every_member_was_heard_and_never_backwards():
    half = answered([member(0, 27)], replicas=2, total_steps=60, resume_step=0, drain_step=None)
    assert progress.status_progress(half, {}) is None
    whole = answered([member(0, 27), member(1, 27)], replicas=2, total_steps=60, resume_step=0, drain_step=None)
    assert progress.status_progress(whole, {"globalStep": 31})["globalStep"] == 31


def test_a_members_histogram_of_the_wrong_shape_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="buckets"):
        progress.checked(member(0, 1, buckets=[1, 2]))
    with pytest.raises(ProtocolError, match="buckets"):
        progress.checked(member(0, 1, buckets=[-1] * stalls.NUM_BUCKETS))


def test_filled_rows_are_summed_over_the_world_and_carried_across_worlds():
    world0 = progress.world_status([member(0, 5, filled_rows=2, skipped_rows=1), member(1, 5, filled_rows=3)],
                                   replicas=2, total_steps=60, resume_step=0, drain_step=None)
    assert world0.filled_rows == 5 and world0.skipped_rows == 1
    first = progress.status_progress(world0, {}, 0)
    assert first is not None and first["filledRows"] == 5 and first["skippedRows"] == 1
    # The same world, one member not heard again yet: the total never goes back.
    later = answered([member(0, 6, filled_rows=1), member(1, 6, filled_rows=3)], replicas=2,
                     total_steps=60, resume_step=0, drain_step=None)
    assert progress.status_progress(later, first, 0)["filledRows"] == 5
    # World 1 (a rescale to one replica) starts counting at 0: world 0's 5 are carried.
    world1 = answered([member(0, 7, filled_rows=4)], replicas=1, total_steps=60, resume_step=5, drain_step=None)
    second = progress.status_progress(world1, first, 1)
    assert second["filledRows"] == 9 and second["carried"] == {"worldEpoch": 1, "filledRows": 5, "skippedRows": 1}
    world1_more = dataclasses.replace(world1, filled_rows=6)
    assert progress.status_progress(world1_more, second, 1)["filledRows"] == 11


def test_the_status_frame_sums_the_progress_frames_members_sent_and_reads_as_before():
    """Frames written out by hand, as members and the operator of any version send and read them."""
    counts = json.dumps(counts_at(b0_1=9))
    frames = [('{"v":1,"type":"progress","replica":%d,"global_step":%d,"steps_per_epoch":20,"rows":480,'
               '"rows_per_s":100.0,"wait_s":1.0,"wall_s":4.0,"buckets":%s,"filled_rows":%d,"skipped_rows":0}'
               % (r, step, counts, filled)).encode() for r, step, filled in ((0, 27, 2), (1, 25, 3))]
    members = [progress.checked(messages.Progress.decode(f)) for f in frames]
    answer = progress.world_status(members, replicas=2, total_steps=60, resume_step=10, drain_step=None,
                                   world_epoch=3)
    assert json.loads(answer.encode()) == {
        "v": 1, "type": "status", "replicas": 2, "reporting": 2, "global_step": 25, "steps_per_epoch": 20,
        "total_steps": 60, "resume_step": 10, "rows": 960, "rows_per_s": 200.0, "wait_s": 2.0, "wall_s": 8.0,
        "buckets": counts_at(b0_1=18), "drain_step": None, "filled_rows": 5, "skipped_rows": 0, "world_epoch": 3}
    empty = progress.world_status([], replicas=2, total_steps=60, resume_step=0, drain_step=7)
    assert (empty.global_step, empty.reporting, empty.rows, empty.drain_step) == (None, 0, 0, 7)


def test_the_worlds_first_batch_is_its_last_members_once_every_replica_said():
    world = {"replicas": 2, "total_steps": 60, "resume_step": 10, "drain_step": None}
    assert answered([member(0, 11, first_batch_at=100.5)], **world).first_batch_at is None  # one of two heard
    assert answered([member(0, 11, first_batch_at=100.5), member(1, 10)], **world).first_batch_at is None
    both = answered([member(0, 11, first_batch_at=100.5), member(1, 11, first_batch_at=101.25)], **world)
    assert both.first_batch_at == 101.25
    assert json.loads(both.encode())["first_batch_at"] == 101.25
    assert messages.Status.decode(both.encode()).first_batch_at == 101.25
    assert "first_batch_at" not in json.loads(answered([member(0, 9)], **world).encode())  # as older peers read it
