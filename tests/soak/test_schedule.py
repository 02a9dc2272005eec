"""The soak's event schedule: a pure function of the seed, every event one the job can take."""

from __future__ import annotations

from tests.soak import schedule as sched
from tests.soak.__main__ import allowed, percentile, recovery_table

COUNTS = [1, 2, 3]


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another():
    assert sched.generate(7, 25, COUNTS) == sched.generate(7, 25, COUNTS)
    assert sched.generate(7, 25, COUNTS).describe() == sched.generate(7, 25, COUNTS).describe()
    assert sched.generate(7, 25, COUNTS) != sched.generate(8, 25, COUNTS)


def test_every_event_is_one_the_job_can_take():
    kinds: set[str] = set()
    for seed in range(200):
        plan = sched.generate(seed, 25, COUNTS)
        replicas = plan.start
        assert replicas in COUNTS
        for event in plan.events:
            kinds.add(event.kind)
            assert event.replicas in COUNTS, (seed, event)
            if event.kind == sched.SCALE:
                assert event.replicas != replicas, (seed, event)
            elif event.kind == sched.OVERLAP:
                assert len({replicas, event.first, event.replicas}) == 3 and 0 <= event.delay_s <= 3, (seed, event)
            else:
                assert event.replicas == replicas, (seed, event)
            if event.kind in (sched.KILL_TRAINER, sched.KILL_AGENT, sched.SIGTERM):
                assert 0 <= event.target < replicas, (seed, event)
            if event.kind == sched.KILL_SIDECAR:
                assert 1 <= event.target < replicas, (seed, event)  # replica 0's is the coordinator's
            if event.kind == sched.KILL_AGENT:
                assert plan.mode == sched.IN_PLACE, (seed, event)  # only in place is there an agent
            assert 0 <= event.gap_steps <= 3
            replicas = event.replicas
    assert kinds == set(sched.WEIGHTS), kinds  # every kind comes up


def test_a_given_mode_is_kept_and_the_seed_picks_both():
    assert {sched.generate(s, 3, COUNTS, sched.RECREATE).mode for s in range(20)} == {sched.RECREATE}
    assert {sched.generate(s, 3, COUNTS).mode for s in range(20)} == {sched.RECREATE, sched.IN_PLACE}


def test_the_soak_uses_the_valid_replica_counts_of_its_job():
    assert allowed(3) == [1, 2, 3] and allowed(8) == [1, 2, 3, 4, 6, 8]  # 24 splits, 48 rows a step


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile([3.0], 99) == 3.0
    assert recovery_table([("scale", 2.0), ("scale", 4.0), ("forge", 1.0)]) == {
        "forge": {"n": 1, "p50_s": 1.0, "p99_s": 1.0}, "scale": {"n": 2, "p50_s": 2.0, "p99_s": 4.0}}


def test_a_seeds_first_events_are_the_same_whatever_the_number_asked():
    """A failure at event k of a long soak replays with --events k + 1."""
    long, short = sched.generate(5, 25, COUNTS), sched.generate(5, 4, COUNTS)
    assert (long.mode, long.start, long.events[:4]) == (short.mode, short.start, short.events)
