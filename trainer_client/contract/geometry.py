"""A job's split geometry as one value: its splits, batch, rows per split per step, epoch steps.

Every reader of a job cuts the same table the same way: numSplits splits, each global step
taking globalBatchSize / numSplits consecutive rows of every split, an epoch being as many
such steps as a split holds. `Geometry` holds those numbers once, built where the spec (and,
for the steps per epoch, the table's row count) is known, and is handed to whoever needs
them instead of each recomputing them; the math itself stays in `topology`, whose rules
tests pin against lancedb's StreamingDataset.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from . import topology


class Shaped(Protocol):
    """What a geometry is built from: the fields of a job's `specs.DataSpec` that fix it."""

    @property
    def num_splits(self) -> int: ...

    @property
    def global_batch_size(self) -> int: ...

    @property
    def num_workers(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class Geometry:
    """How a job's rows are cut into splits and steps (docs/architecture.md's model).

    `steps_per_epoch` is None where no table was read (`splitfeed plan` without
    --read-table, the checkpoint positions of a spec): only what the spec fixes is known.
    """

    num_splits: int
    global_batch_size: int
    num_workers: int = 1
    steps_per_epoch: int | None = None
    rows_per_split_per_step: int = dataclasses.field(init=False)
    """G / N: each global step takes this many consecutive rows from every split."""

    def __post_init__(self) -> None:
        per_step = topology.rows_per_split_per_step(self.global_batch_size, self.num_splits)
        object.__setattr__(self, "rows_per_split_per_step", per_step)  # derived: frozen stays true

    @classmethod
    def of(cls, data: Shaped, *, rows: int | None = None) -> Geometry:
        """The geometry of a job's data; with `rows` (the rows an epoch permutes: the table's
        filtered count, or a packing job's blocks), its steps per epoch too."""
        steps = (None if rows is None
                 else topology.steps_per_epoch(rows, data.num_splits, data.global_batch_size))
        return cls(data.num_splits, data.global_batch_size, data.num_workers, steps)

    def rank_splits(self, rank: int, world: int) -> range:
        """The contiguous block of splits data-parallel rank `rank` of `world` reads."""
        return topology.rank_splits(rank, world, self.num_splits)

    def worker_splits(self, rank: int, world: int, worker: int) -> range:
        """The contiguous sub-block of `rank`'s splits that its loader worker `worker` reads."""
        return topology.worker_splits(rank, world, self.num_splits, self.num_workers, worker)

    def rank_batch_size(self, world: int) -> int:
        """Rows per data-parallel rank per global step (G / W)."""
        return topology.rank_batch_size(self.global_batch_size, world)
