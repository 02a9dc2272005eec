"""The world's drain agreement as a pure state machine (sidecar/world/agreement.py).

Every interleaving is a plain call; the expected step is worked out here from
the rule in docs/agreement.md (batch S - 1 published nowhere when S is fixed).
"""

from __future__ import annotations

import pytest

from splitfeed.sidecar.world.agreement import (
    COMMITTED,
    EVERY,
    FREEZING,
    HEARTBEATS_PER_S,
    IDLE,
    JOIN_RESEND_S,
    WAITING_FOR_MEMBERS,
    Coordinator,
    Out,
    Watermark,
    at_rest_period_s,
    cut_step,
    flat_reports,
)
from splitfeed.trainer_client.contract import errors
from splitfeed.trainer_client.contract.messages import CommitAt, Complete, DrainAck, Freeze, Joined


def kinds(outs):
    return [(o.peer, type(o.message)) for o in outs]


def joined_world(replicas: int = 3, total: int = 100) -> Coordinator:
    c = Coordinator(replicas=replicas, total_steps=total, resume_step=4)
    for r in range(replicas):
        c.on_join(f"m{r}".encode(), r)
    return c


def test_members_learn_the_worlds_resume_step_when_they_join():
    c = Coordinator(replicas=2, total_steps=10, resume_step=4, table_version=9)
    out = c.on_join(b"m1", 1)
    assert kinds(out) == [(b"m1", Joined)]
    assert out[0].message == Joined(resume_step=4, table_version=9, replicas=2)


def test_a_request_freezes_everyone_and_commits_two_past_the_highest_published_step():
    c = joined_world()
    out = c.on_request(b"operator", "rescale-w0", "rescale")
    assert kinds(out) == [(EVERY, Freeze), (b"operator", DrainAck)]
    assert out[1].message == DrainAck(token="rescale-w0", state=FREEZING)
    # Ranks are at different steps when the request lands; the furthest published 12.
    assert c.on_frozen(0, 1, 10) == [] and c.on_frozen(2, 1, 12) == []
    out = c.on_frozen(1, 1, 11)
    assert kinds(out) == [(EVERY, CommitAt)]
    assert out[0].message == CommitAt(round=1, step=14, drain=True, reason="rescale")
    assert c.phase == COMMITTED and c.step == 14


def test_a_request_before_every_member_joined_waits_for_them():
    c = Coordinator(replicas=2, total_steps=50, resume_step=0)
    c.on_join(b"m0", 0)
    out = c.on_request(b"m0", "rescale-w3", "rescale")
    assert kinds(out) == [(b"m0", DrainAck)] and c.phase == WAITING_FOR_MEMBERS
    out = c.on_join(b"m1", 1)  # the Pending pod came up
    assert kinds(out) == [(b"m1", Joined), (EVERY, Freeze)]


def test_the_same_token_twice_is_one_request_and_a_second_token_joins_the_running_round():
    c = joined_world()
    c.on_request(b"op", "rescale-w0", "rescale")
    assert kinds(c.on_request(b"m1", "rescale-w0", "rescale")) == [(b"m1", DrainAck)]
    assert kinds(c.on_request(b"m2", "preempt-x", "preempt")) == [(b"m2", DrainAck)]
    assert c.round == 1 and c.reason == "rescale"


def test_a_member_restarted_while_freezing_is_asked_again_and_one_restarted_after_the_commit_is_told():
    c = joined_world()
    c.on_request(b"op", "t", "suspend")
    c.on_frozen(0, 1, 5)
    assert kinds(c.on_join(b"m1-new", 1)) == [(b"m1-new", Joined), (b"m1-new", Freeze)]
    assert kinds(c.on_join(b"m0-new", 0)) == [(b"m0-new", Joined)]  # it answered already
    c.on_frozen(1, 1, 3)
    c.on_frozen(2, 1, 4)
    out = c.on_join(b"m2-new", 2)
    assert kinds(out) == [(b"m2-new", Joined), (b"m2-new", CommitAt)]
    assert isinstance(out[1].message, CommitAt) and out[1].message.step == 7


def test_a_heartbeat_on_the_connection_a_member_joined_on_is_answered_only_with_the_round_to_act_on():
    """At rest a heartbeat costs the coordinator one message: the member holds `joined` and every
    broadcast already (one connection delivers in order). A new connection is told everything."""
    c = joined_world(replicas=2)
    c.on_committed(0, 6)
    c.on_committed(1, 6)  # a checkpoint every member committed: `complete` went to each
    assert c.on_join(b"m1", 1) == [] and c.on_join(b"m0", 0) == []
    assert kinds(c.on_join(b"m1-again", 1)) == [(b"m1-again", Joined), (b"m1-again", Complete)]
    c.on_request(b"op", "t", "rescale")
    assert kinds(c.on_join(b"m1-again", 1)) == [(b"m1-again", Freeze)]  # it has not answered yet
    c.on_frozen(1, c.round, 5)
    assert c.on_join(b"m1-again", 1) == []
    c.on_frozen(0, c.round, 4)
    out = c.on_join(b"m0", 0)
    assert kinds(out) == [(b"m0", CommitAt)] and out[0].message.step == 7


def test_members_of_a_large_world_beat_less_often_so_the_coordinator_hears_a_bounded_rate():
    small, large = (at_rest_period_s(JOIN_RESEND_S * 5, n, HEARTBEATS_PER_S) for n in (64, 1024))
    assert small == 10.0  # the usual heartbeat
    assert large == 64.0 and 1024 / large <= HEARTBEATS_PER_S


def test_an_answer_to_an_old_round_changes_nothing():
    c = joined_world()
    c.on_request(b"op", "t", "rescale")
    assert c.on_frozen(0, 0, 99) == []
    assert c.answers == {}


def test_the_cut_never_passes_the_end_of_the_job():
    assert cut_step([7, 9], 10) == 10
    assert cut_step([-1, -1], 10) == 1  # nothing published yet: the first batch is the last
    c = joined_world(replicas=1, total=10)
    c.on_request(b"op", "t", "rescale")
    assert c.on_frozen(0, 1, 9)[0].message == CommitAt(round=1, step=10, drain=True, reason="rescale")


def test_a_request_for_a_later_step_drains_there_unless_the_world_already_published_past_it():
    """`splitfeed local --scale-at 30:N` asks ahead (not_before=30): the cut is 30, not 2 past the
    highest published step; a world already past it cuts as usual, and the end of the job still bounds it."""
    assert cut_step([3, 5], 100, not_before=30) == 30
    assert cut_step([3, 29], 100, not_before=30) == 31
    assert cut_step([3, 5], 20, not_before=30) == 20
    c = joined_world()
    c.on_request(b"local", "rescale-w0", "rescale", not_before=30)
    c.on_frozen(0, 1, 6), c.on_frozen(1, 1, 7)
    assert c.on_frozen(2, 1, 5)[0].message == CommitAt(round=1, step=30, drain=True, reason="rescale")
    # A second request (another token) joins the round: it neither moves the step nor starts another.
    assert kinds(c.on_request(b"op", "preempt-x", "preempt", not_before=50)) == [(b"op", DrainAck)]
    assert c.step == 30


def test_a_skip_job_drains_after_the_request_as_usual_whatever_step_was_asked():
    """A skip job's coordinator knows a step exists only once every rank read it: it keeps no
    not_before (reading 30 steps ahead while frozen would stall the world and hold its batches)."""
    c = Coordinator(replicas=1, total_steps=100, resume_step=0, watermark=Watermark(ranks=1, steps_per_epoch=50))
    c.on_join(b"m0", 0)
    c.on_reach(flat_reports({0: (9, {})}))
    c.on_request(b"local", "rescale-w0", "rescale", not_before=30)
    out = c.on_frozen(0, 1, 6)
    assert [o.message for o in out if isinstance(o.message, CommitAt)] == [
        CommitAt(round=1, step=8, drain=True, reason="rescale")]


def test_a_step_is_complete_once_every_member_committed_it():
    c = joined_world(replicas=2)
    assert c.on_committed(0, 6) == []
    out = c.on_committed(1, 6)
    assert kinds(out) == [(EVERY, Complete)] and out[0].message == Complete(step=6)
    assert c.on_committed(1, 6) == []  # told once
    assert kinds(c.on_join(b"late", 0))[-1] == (b"late", Complete)


def test_a_replica_outside_the_world_is_told_its_size_and_not_counted():
    """A pod of the world before an in-place scale-down learns it is not in this one."""
    c = Coordinator(replicas=2, total_steps=10, resume_step=4)
    out = c.on_join(b"x", 2)
    assert out == [Out(b"x", Joined(resume_step=4, table_version=None, replicas=2))]
    assert c.members == {} and c.phase == IDLE
    with pytest.raises(errors.ProtocolError, match="replica -1 is not in this world"):
        c.on_join(b"y", -1)


def test_an_in_place_request_names_the_next_world_and_the_newest_count_wins():
    c = joined_world(replicas=2)
    c.on_request(b"op", "rescale-w0", "rescale", replicas=4)
    c.on_request(b"op", "rescale-w0", "rescale", replicas=3)  # a second kubectl scale, same drain
    out = c.on_frozen(0, c.round, 5) + c.on_frozen(1, c.round, 6)
    assert [o.message for o in out] == [CommitAt(round=c.round, step=8, drain=True, reason="rescale",
                                                 next_replicas=3)]
    assert c.next_replicas == 3


def test_a_restarted_coordinator_adopts_the_drain_step_its_members_act_on():
    """Restarted between commit_at and the drain's end, it knows no round; the first member
    that says it acts on step 12 makes 12 the world's step again, and the others are told."""
    c = Coordinator(replicas=3, total_steps=100, resume_step=0)
    c.on_join(b"m0", 0)
    out = c.on_join(b"m1", 1, drain_step=12, drain_reason="rescale", next_replicas=2)
    assert [(o.peer, type(o.message)) for o in out] == [(b"m1", Joined), (EVERY, CommitAt)]
    assert out[1].message == CommitAt(round=1, step=12, drain=True, reason="rescale", next_replicas=2)
    assert c.phase == COMMITTED and c.step == 12 and c.next_replicas == 2
    late = c.on_join(b"m2", 2)  # a member that had not heard of it is told at once
    assert [type(o.message) for o in late] == [Joined, CommitAt] and late[1].message.step == 12
    assert c.on_request(b"op", "rescale-w0", "rescale")[-1].message == DrainAck(token="rescale-w0",
                                                                                 state=COMMITTED)
    again = c.on_join(b"m1", 1, drain_step=12, drain_reason="rescale")  # its heartbeat: no new round
    assert c.round == 1 and kinds(again) == [(b"m1", CommitAt)] and again[0].message.step == 12
