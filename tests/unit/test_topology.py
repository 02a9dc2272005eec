"""Topology math, checked exhaustively against the rules written out longhand."""

import itertools

import pytest

from splitfeed.trainer_client.contract import topology


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


# --- model-parallel groups (spec.data.ranksPerBatch) -----------------------------------------

def grouped_rules_hold(replicas, gpus, n, k, g, per_batch):
    w = replicas * gpus
    if w % per_batch:
        return False
    dp = w // per_batch
    return n % (dp * k) == 0 and g % n == 0 and g % dp == 0


@pytest.mark.parametrize("gpus", [1, 2, 8])
@pytest.mark.parametrize("per_batch", [1, 2, 3, 4, 16])
@pytest.mark.parametrize("n,g", [(24, 48), (48, 960), (6, 12)])
def test_allowed_replicas_with_groups_are_exactly_those_the_rules_allow(gpus, per_batch, n, g):
    expected = [r for r in range(1, 2000) if grouped_rules_hold(r, gpus, n, 1, g, per_batch)]
    assert topology.allowed_replicas(gpus_per_replica=gpus, num_splits=n, num_workers=1,
                                     global_batch_size=g, ranks_per_batch=per_batch) == expected


def test_a_group_that_the_world_cannot_hold_is_refused_with_the_sizes_that_can():
    with pytest.raises(topology.TopologyError) as info:
        topology.check(replicas=3, gpus_per_replica=1, num_splits=24, num_workers=1,
                       global_batch_size=48, ranks_per_batch=2)
    assert "worldSize=3 (replicas*gpusPerReplica = 3*1) is not divisible by ranksPerBatch=2" in str(info.value)
    # dp = r / 2 must divide 24 and 48: r in 2 * {1, 2, 3, 4, 6, 8, 12, 24}
    assert info.value.allowed == [2, 4, 6, 8, 12, 16, 24, 48]


def test_the_splits_are_shared_among_the_data_parallel_ranks_only():
    # 8 ranks in tp pairs: 4 data-parallel ranks, so 24 splits need no more than 4 | 24.
    assert topology.violations(replicas=8, gpus_per_replica=1, num_splits=4, num_workers=1,
                               global_batch_size=8, ranks_per_batch=2) == []
    found = topology.violations(replicas=8, gpus_per_replica=1, num_splits=6, num_workers=1,
                                global_batch_size=18, ranks_per_batch=2)
    assert [v.rule for v in found] == ["numSplits % (dataParallelSize * numWorkers) == 0",
                                       "globalBatchSize % dataParallelSize == 0"]
    assert "numSplits=6 is not divisible by dataParallelSize*numWorkers=4*1=4 (worldSize / ranksPerBatch = 8/2)" \
        in found[0].message


@pytest.mark.parametrize("per_batch,stages,world,expected", [
    (1, 1, 4, [0, 1, 2, 3]),                       # plain data parallelism
    (2, 1, 4, [0, 0, 1, 1]),                       # (dp 2, tp 2): tp innermost
    (4, 1, 8, [0, 0, 0, 0, 1, 1, 1, 1]),           # (dp 2, cp 2, tp 2)
    (2, 2, 4, [0, 1, 0, 1]),                       # (pp 2, dp 2): stages outermost
    (4, 2, 8, [0, 0, 1, 1, 0, 0, 1, 1]),           # (pp 2, dp 2, tp 2), torchtitan's order
    (4, 4, 8, [0, 1, 0, 1, 0, 1, 0, 1]),           # (pp 4, dp 2)
])
def test_data_parallel_ranks_follow_the_torchtitan_mesh_order(per_batch, stages, world, expected):
    groups = topology.Groups(per_batch, stages)
    assert [groups.rank(r, world) for r in range(world)] == expected
    assert groups.size(world) == world // per_batch


def test_the_data_parallel_rank_is_the_coordinate_of_a_real_device_mesh():
    """Against torch's own DeviceMesh layout (no process group needed for its rank grid)."""
    import torch  # a test extra (the Makefile installs it)
    pp, dp, tp = 2, 3, 2
    grid = torch.arange(pp * dp * tp).reshape(pp, dp, tp)  # DeviceMesh's mesh tensor, row-major
    groups = topology.Groups(ranks_per_batch=pp * tp, pipeline_stages=pp)
    for (stage, d, t), rank in ((idx, int(grid[idx])) for idx in itertools.product(range(pp), range(dp), range(tp))):
        assert groups.rank(rank, pp * dp * tp) == d, (stage, d, t)


def test_pipeline_stages_must_divide_the_group():
    with pytest.raises(ValueError, match="ranksPerBatch=4 is not divisible by pipelineStages=3"):
        topology.Groups(4, 3)
