"""Topology math: which world sizes a job can run on, and who reads what.

Pure functions, shared by every layer: the operator's admission checks, the
sidecar's split assignment and `splitfeed plan` all call these, so a rule is
written once. The rules are docs/architecture.md's "Validity rules"; the split
assignment mirrors `lancedb.streaming.StreamingDataset` (contiguous blocks of
splits per rank, contiguous sub-blocks per worker), which tests pin against
lancedb itself.
"""

from __future__ import annotations

import dataclasses

from .errors import SplitfeedError


@dataclasses.dataclass(frozen=True)
class Violation:
    """One broken validity rule, phrased for the person who can fix it."""

    rule: str
    message: str


class TopologyError(SplitfeedError, ValueError):
    """A replica count that the job's splits, workers and batch size cannot serve."""

    def __init__(self, violations: list[Violation], allowed: list[int]) -> None:
        self.violations = violations
        self.allowed = allowed
        valid = ", ".join(map(str, allowed)) if allowed else "none"
        details = "; ".join(v.message for v in violations)
        super().__init__(f"{details}. Valid replica counts for this job: [{valid}]")


def world_size(replicas: int, gpus_per_replica: int) -> int:
    return replicas * gpus_per_replica


def violations(
    *,
    replicas: int,
    gpus_per_replica: int,
    num_splits: int,
    num_workers: int,
    global_batch_size: int,
    ranks_per_batch: int = 1,
) -> list[Violation]:
    """Every validity rule the topology breaks (empty when it is valid).

    The rules are about the data-parallel world (docs/architecture.md, "Data-parallel
    groups"): with `ranks_per_batch` k > 1, each group of k ranks takes one batch, so the
    splits and the global batch are shared among worldSize / k data-parallel ranks.
    """
    found: list[Violation] = []
    for name, value in (
        ("replicas", replicas),
        ("gpusPerReplica", gpus_per_replica),
        ("numSplits", num_splits),
        ("numWorkers", num_workers),
        ("globalBatchSize", global_batch_size),
        ("ranksPerBatch", ranks_per_batch),
    ):
        if value < 1:
            found.append(Violation(f"{name} >= 1", f"{name} must be at least 1, got {value}"))
    if found:
        return found
    w = world_size(replicas, gpus_per_replica)
    if global_batch_size % num_splits:
        found.append(
            Violation(
                "globalBatchSize % numSplits == 0",
                f"globalBatchSize={global_batch_size} is not divisible by "
                f"numSplits={num_splits}; pick a multiple of {num_splits}",
            )
        )
    if w % ranks_per_batch:  # no whole data-parallel size: its two rules cannot be judged
        return [Violation(
            "worldSize % ranksPerBatch == 0",
            f"worldSize={w} (replicas*gpusPerReplica = {replicas}*{gpus_per_replica}) is not "
            f"divisible by ranksPerBatch={ranks_per_batch}: every model-parallel group of "
            f"{ranks_per_batch} ranks must be whole"), *found]
    dp, name = w // ranks_per_batch, "dataParallelSize" if ranks_per_batch > 1 else "worldSize"
    spelled = (f" (worldSize / ranksPerBatch = {w}/{ranks_per_batch})" if ranks_per_batch > 1 else
               f" (worldSize = replicas*gpusPerReplica = {replicas}*{gpus_per_replica})")
    if num_splits % (dp * num_workers):
        found.insert(0, Violation(
            f"numSplits % ({name} * numWorkers) == 0",
            f"numSplits={num_splits} is not divisible by {name}*numWorkers="
            f"{dp}*{num_workers}={dp * num_workers}{spelled}",
        ))
    if global_batch_size % dp:
        found.append(
            Violation(
                f"globalBatchSize % {name} == 0",
                f"globalBatchSize={global_batch_size} is not divisible by {name}={dp}",
            )
        )
    return found


def divisors(n: int) -> list[int]:
    """Every positive divisor of `n` (n >= 1), ascending; O(sqrt(n)) steps."""
    if n < 1:
        raise ValueError(f"divisors of {n} are not defined")
    small: list[int] = []
    large: list[int] = []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def allowed_replicas(
    *, gpus_per_replica: int, num_splits: int, num_workers: int, global_batch_size: int,
    ranks_per_batch: int = 1,
) -> list[int]:
    """Replica counts that satisfy every rule, ascending.

    The data-parallel size dp = r * gpusPerReplica / ranksPerBatch must be whole and
    dp * numWorkers must divide numSplits, so dp divides numSplits / numWorkers: only
    its divisors are candidates, found in O(sqrt(numSplits)) steps (a numSplits of
    2**31 takes milliseconds, not minutes). Each candidate dp gives r = dp * k / g
    where that is whole, and globalBatchSize % dp filters the rest.
    """
    if min(gpus_per_replica, num_splits, num_workers, global_batch_size, ranks_per_batch) < 1:
        return []
    if num_splits % num_workers or global_batch_size % num_splits:
        return []
    found = []
    for dp in divisors(num_splits // num_workers):
        ranks = dp * ranks_per_batch
        if ranks % gpus_per_replica == 0 and global_batch_size % dp == 0:
            found.append(ranks // gpus_per_replica)
    return found


def check(
    *,
    replicas: int,
    gpus_per_replica: int,
    num_splits: int,
    num_workers: int,
    global_batch_size: int,
    ranks_per_batch: int = 1,
) -> None:
    """Raise TopologyError naming each broken rule and the valid replica counts."""
    found = violations(
        replicas=replicas,
        gpus_per_replica=gpus_per_replica,
        num_splits=num_splits,
        num_workers=num_workers,
        global_batch_size=global_batch_size,
        ranks_per_batch=ranks_per_batch,
    )
    if found:
        raise TopologyError(
            found,
            allowed_replicas(
                gpus_per_replica=gpus_per_replica,
                num_splits=num_splits,
                num_workers=num_workers,
                global_batch_size=global_batch_size,
                ranks_per_batch=ranks_per_batch,
            ),
        )


@dataclasses.dataclass(frozen=True)
class Groups:
    """How a world's ranks share batches: spec.data.ranksPerBatch and pipelineStages.

    The mesh order is torchtitan's and Megatron-LM's: pipeline stages outermost, then data
    parallel, then the rest of the group (context, tensor) innermost, so a rank is
    ((stage * dp + dp_rank) * inner + inner_rank) with inner = ranksPerBatch / pipelineStages.
    Every rank of one model-parallel group (all its stages) gets the same data rank.
    """

    ranks_per_batch: int = 1
    pipeline_stages: int = 1

    def __post_init__(self) -> None:
        if self.pipeline_stages < 1 or self.ranks_per_batch % self.pipeline_stages:
            raise ValueError(f"ranksPerBatch={self.ranks_per_batch} is not divisible by "
                             f"pipelineStages={self.pipeline_stages}")

    def size(self, world: int) -> int:
        """How many different batches a global step is cut into: one per model-parallel group."""
        if world % self.ranks_per_batch:
            raise ValueError(f"worldSize={world} is not divisible by ranksPerBatch={self.ranks_per_batch}")
        return world // self.ranks_per_batch

    def rank(self, rank: int, world: int) -> int:
        """The data-parallel rank of global rank `rank`: whose splits it is served."""
        dp = self.size(world)
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside world of size {world}")
        return (rank // (self.ranks_per_batch // self.pipeline_stages)) % dp


def rank_splits(rank: int, world: int, num_splits: int) -> range:
    """The contiguous block of global split indices rank `rank` reads."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world of size {world}")
    if num_splits % world:
        raise ValueError(f"numSplits={num_splits} is not divisible by worldSize={world}")
    per_rank = num_splits // world
    return range(rank * per_rank, (rank + 1) * per_rank)


def worker_splits(rank: int, world: int, num_splits: int, num_workers: int, worker: int) -> range:
    """The contiguous sub-block of a rank's splits that loader worker `worker` reads."""
    splits = rank_splits(rank, world, num_splits)
    if not 0 <= worker < num_workers or len(splits) % num_workers:
        raise ValueError(
            f"worker {worker} of {num_workers} cannot share {len(splits)} splits evenly"
        )
    per_worker = len(splits) // num_workers
    return splits[worker * per_worker : (worker + 1) * per_worker]


def rank_batch_size(global_batch_size: int, world: int) -> int:
    """Rows per rank per global step (B = G / W)."""
    return global_batch_size // world


def rows_per_split_per_step(global_batch_size: int, num_splits: int) -> int:
    """Each global step takes this many consecutive rows from every split (G / N)."""
    return global_batch_size // num_splits


def split_size(num_rows: int, num_splits: int) -> int:
    """Rows in each split; lancedb drops the surplus so every split is as long."""
    return num_rows // num_splits


def steps_per_epoch(num_rows: int, num_splits: int, global_batch_size: int) -> int:
    """Whole global steps in an epoch: rows that cannot fill one are not delivered."""
    return split_size(num_rows, num_splits) // rows_per_split_per_step(
        global_batch_size, num_splits
    )
