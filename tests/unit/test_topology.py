"""Topology math, checked exhaustively against the rules written out longhand."""

import itertools

import pytest

from splitfeed.trainer_client import topology


def rules_hold(replicas, gpus, n, k, g):
    w = replicas * gpus
    return n % (w * k) == 0 and g % n == 0 and g % w == 0


@pytest.mark.parametrize("gpus", [1, 2, 4])
@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 6, 24, 48, 49])
@pytest.mark.parametrize("g", [24, 48, 960, 1000])
def test_allowed_replicas_are_exactly_those_that_satisfy_every_rule(gpus, workers, n, g):
    expected = [r for r in range(1, 200) if rules_hold(r, gpus, n, workers, g)]
    assert topology.allowed_replicas(
        gpus_per_replica=gpus, num_splits=n, num_workers=workers, global_batch_size=g
    ) == expected


def test_the_architecture_example_lists_the_documented_replica_counts():
    assert topology.allowed_replicas(
        gpus_per_replica=1, num_splits=48, num_workers=1, global_batch_size=960
    ) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]


@pytest.mark.parametrize("w", [5, 7])
def test_a_rejection_names_the_rule_and_lists_the_valid_counts(w):
    with pytest.raises(topology.TopologyError) as info:
        topology.check(replicas=w, gpus_per_replica=1, num_splits=24, num_workers=1,
                       global_batch_size=48)
    message = str(info.value)
    assert "numSplits=24 is not divisible by worldSize*numWorkers" in message
    assert "[1, 2, 3, 4, 6, 8, 12, 24]" in message
    assert info.value.allowed == [1, 2, 3, 4, 6, 8, 12, 24]
    assert [v.rule for v in info.value.violations][0] == "numSplits % (worldSize * numWorkers) == 0"


def test_a_batch_size_that_splits_cannot_share_is_rejected_for_every_replica_count():
    with pytest.raises(topology.TopologyError) as info:
        topology.check(replicas=1, gpus_per_replica=1, num_splits=24, num_workers=1,
                       global_batch_size=100)
    assert "globalBatchSize=100 is not divisible by numSplits=24" in str(info.value)
    assert info.value.allowed == []


def test_zero_or_negative_values_are_named():
    found = topology.violations(replicas=0, gpus_per_replica=1, num_splits=24,
                                num_workers=1, global_batch_size=48)
    assert found[0].message == "replicas must be at least 1, got 0"


@pytest.mark.parametrize("n,w,k", [(24, 1, 1), (24, 4, 2), (48, 6, 1), (12, 12, 1), (24, 3, 4)])
def test_rank_and_worker_splits_partition_every_split_exactly_once_in_order(n, w, k):
    seen = []
    for rank in range(w):
        block = topology.rank_splits(rank, w, n)
        assert len(block) == n // w
        workers = [topology.worker_splits(rank, w, n, k, i) for i in range(k)]
        assert list(itertools.chain.from_iterable(workers)) == list(block)
        seen.extend(block)
    assert seen == list(range(n))


def test_steps_per_epoch_drops_rows_that_cannot_fill_a_global_step():
    # 1000 rows in 24 splits -> 41 rows per split (16 surplus rows dropped);
    # G=48 takes 2 rows per split per step -> 20 whole steps, 1 row per split left over.
    assert topology.split_size(1000, 24) == 41
    assert topology.steps_per_epoch(1000, 24, 48) == 20
    assert topology.rank_batch_size(48, 6) == 8


# --- bounded work: the valid counts come from divisors, not a walk up to numSplits ----------

@pytest.mark.parametrize("n", [1, 2, 12, 36, 97, 720720, 1_000_000])
def test_divisors_are_every_divisor_in_order(n):
    assert topology.divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize("gpus", [1, 3])
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("n,g", [(720, 1440), (360, 720 * 7), (100, 300), (49, 49 * 6)])
def test_divisor_enumeration_agrees_with_the_rules_walked_longhand(gpus, workers, n, g):
    expected = [r for r in range(1, n + 1) if rules_hold(r, gpus, n, workers, g)]
    assert topology.allowed_replicas(
        gpus_per_replica=gpus, num_splits=n, num_workers=workers, global_batch_size=g) == expected


@pytest.mark.parametrize("n", [1_000_000, 2_147_483_646, 2_147_483_647])
def test_huge_split_counts_are_answered_in_milliseconds(n):
    """A complexity check, not a benchmark: walking every integer up to 2**31 takes minutes.

    This thread's CPU time, not the wall clock: on a loaded machine a millisecond's work
    can wait longer than the bound for a core."""
    import time

    start = time.thread_time()
    allowed = topology.allowed_replicas(gpus_per_replica=1, num_splits=n, num_workers=1,
                                        global_batch_size=n * 4)
    with pytest.raises(topology.TopologyError) as info:
        topology.check(replicas=n + 1, gpus_per_replica=1, num_splits=n, num_workers=1,
                       global_batch_size=n * 4)
    elapsed = time.thread_time() - start
    assert elapsed < 0.5, f"{elapsed:.2f} s of CPU for numSplits={n}"
    assert allowed[0] == 1 and allowed[-1] == n and all(n % r == 0 and (4 * n) % r == 0 for r in allowed)
    assert info.value.allowed == allowed
