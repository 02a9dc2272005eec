"""The world's agreement on which steps exist under onTransformError=skip/warn
(sidecar/world/agreement.py: Watermark, settle_cut; sidecar/serving/service.py: epoch_ends), as pure functions."""

from __future__ import annotations

import pytest

from splitfeed.sidecar.world import agreement
from splitfeed.sidecar.serving import service
from splitfeed.sidecar.world.agreement import IN, OUT, Coordinator, Watermark
from splitfeed.trainer_client.contract import errors, messages

SPE = 10


def test_a_step_is_in_once_every_rank_holds_it_and_out_once_any_rank_ended_before_it():
    w = Watermark(ranks=3, steps_per_epoch=SPE)
    w.report(0, 8, {})
    w.report(1, 6, {})
    assert w.through == -1 and w.verdict(0) is None  # rank 2 has not reported
    w.report(2, 9, {})
    assert w.through == 6 and w.verdict(6) == IN and w.verdict(7) is None
    w.report(1, 12, {0: 7})  # rank 1's epoch 0 ended after 7 steps
    assert w.through == 8 and [w.verdict(k) for k in (6, 7, 9, 10)] == [IN, OUT, OUT, None]
    w.report(0, 11, {0: 9})  # a later, larger end changes nothing
    assert w.ends == {0: 7} and w.through == 9


def test_reports_are_monotone_and_name_only_ranks_of_the_world():
    w = Watermark(ranks=2, steps_per_epoch=SPE)
    assert w.report(0, 5, {}) is False  # through unknown until every rank reported
    assert w.report(1, 3, {}) is True
    assert w.report(1, 2, {}) is False and w.through == 3  # an older report is no news
    with pytest.raises(errors.ProtocolError):
        w.report(2, 1, {})


def test_reach_reports_round_trip_and_malformed_ones_are_refused():
    reports = {0: (17, {0: 7, 1: 0}), 3: (4, {})}
    assert agreement.parse_reports(agreement.flat_reports(reports)) == reports
    for bad in ([0, 1], [0, 1, 2, 5], [0, "x", 0]):
        with pytest.raises(errors.ProtocolError):
            agreement.parse_reports(bad)


@pytest.mark.parametrize("previous,step,ends", [
    (4, 5, {}),                  # consecutive
    (6, 10, {0: 7}),             # epoch 0 ended after 7 steps
    (6, 20, {0: 7, 1: 0}),       # and epoch 1 held nothing
    (9, 10, {}),                 # a full epoch
    (9, 20, {1: 0}),             # started at epoch 1 (resume) but it held nothing
    (14, 20, {1: 5}),            # the reader is done (step = total steps) after step 14
])
def test_a_readers_jump_reveals_its_epoch_ends(previous, step, ends):
    assert service.epoch_ends(previous, step, SPE) == ends


def agreed(outs):
    return [o.message for o in outs if isinstance(o.message, messages.Agreed)]


def test_a_drain_never_lands_on_an_absent_step_and_waits_until_its_previous_step_is_known():
    """The cut S needs batch S - 1 to exist; in a gap it moves past it, unknown it waits."""
    c = Coordinator(replicas=2, total_steps=30, resume_step=0,
                    watermark=Watermark(ranks=2, steps_per_epoch=SPE))
    for replica in (0, 1):
        c.on_join(f"p{replica}".encode(), replica)
    c.on_reach(agreement.flat_reports({0: (6, {}), 1: (6, {})}))
    c.on_request(b"op", "t1", "rescale")
    c.on_frozen(0, c.round, 6)
    outs = c.on_frozen(1, c.round, 5)  # S = 8: is step 7 there? not known yet
    assert c.step is None and [a.need for a in agreed(outs)] == [7]
    outs = c.on_reach(agreement.flat_reports({1: (10, {0: 7})}))  # epoch 0 ends after step 6
    assert c.step is None and agreed(outs)[-1].need == 10  # S moves to 11: step 10 must exist
    outs = c.on_reach(agreement.flat_reports({0: (10, {0: 8})}))
    assert c.step == 11 and any(isinstance(o.message, messages.CommitAt) for o in outs)
    assert agreed(outs)[-1].need == -1


def test_a_drain_past_the_last_epochs_end_is_the_end_of_the_job():
    w = Watermark(ranks=1, steps_per_epoch=SPE)
    w.report(0, 30, {2: 4})
    assert agreement.settle_cut(26, w, 30) == (30, True)


def drain(c: Coordinator, published: list[int], token: str = "t") -> list:
    outs = c.on_request(b"op", token, "rescale")
    for replica, step in enumerate(published):
        outs += c.on_frozen(replica, c.round, step)
    return outs


def joined(replicas: int, total: int) -> Coordinator:
    c = Coordinator(replicas=replicas, total_steps=total, resume_step=0,
                    watermark=Watermark(ranks=replicas, steps_per_epoch=SPE))
    for replica in range(replicas):
        c.on_join(f"p{replica}".encode(), replica)
    return c


@pytest.mark.parametrize("published", [7, 8, 9, 10])
def test_a_drain_just_before_or_just_after_an_epoch_the_whole_world_lost_settles_past_it(published):
    """Epoch 1 holds no step (E = 0): a cut whose previous step falls in it moves to one step
    after epoch 2's first, and commits once every rank holds that step (no wait on a step
    that will never exist)."""
    c = joined(2, 30)
    c.on_reach(agreement.flat_reports({0: (7, {}), 1: (7, {})}))
    drain(c, [published, published - 1])  # S = published + 2
    assert c.step is None
    # The ranks read on: epoch 0 ends after 8 steps, epoch 1 holds nothing.
    c.on_reach(agreement.flat_reports({0: (20, {0: 8, 1: 0}), 1: (20, {0: 9, 1: 0})}))
    assert c.step == 21 and c.candidate is None


def test_a_drain_past_an_empty_last_epoch_commits_the_jobs_end():
    c = joined(2, 30)
    c.on_reach(agreement.flat_reports({0: (19, {}), 1: (19, {})}))
    drain(c, [19, 19])  # S = 21, step 20 is epoch 2's first
    assert c.step is None
    c.on_reach(agreement.flat_reports({0: (30, {2: 0}), 1: (30, {2: 0})}))  # both readers done
    assert c.step == 30


def test_a_drain_in_a_job_that_holds_no_step_at_all_commits_the_jobs_end():
    c = joined(2, 30)
    drain(c, [-1, -1])
    assert c.step is None
    c.on_reach(agreement.flat_reports({0: (30, {0: 0, 1: 0, 2: 0}), 1: (30, {0: 0, 1: 0, 2: 0})}))
    assert c.step == 30


def test_what_goes_to_every_member_reaches_the_coordinators_own_member_last():
    """Replica 0's sidecar runs the coordinator and dies with it: what its member is told (a
    step exists), every other member must have been handed first, whatever the join order, a
    rejoin included (tests/streaming/test_coordinator_restart.py shows why)."""
    c = joined(3, 30)  # replica 0 joined first, as its own sidecar does
    outs = c.on_reach(agreement.flat_reports({0: (5, {}), 1: (5, {}), 2: (5, {})}))
    assert [o.peer for o in outs] == [agreement.EVERY] and agreed(outs)[0].through == 5
    assert c.recipients(agreement.EVERY) == [b"p1", b"p2", b"p0"]
    c.on_join(b"p0-restarted", 0)
    c.on_join(b"p2-again", 2)
    assert c.recipients(agreement.EVERY) == [b"p1", b"p2-again", b"p0-restarted"]
    assert c.recipients(b"p1") == [b"p1"]
