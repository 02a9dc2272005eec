"""The split geometry, checked against the rules written out longhand (docs/architecture.md)."""

import dataclasses
import pickle

import pytest

from splitfeed.trainer_client.contract import geometry, specs


@dataclasses.dataclass(frozen=True)
class Shape:
    """The three spec fields a geometry is built from."""

    num_splits: int
    global_batch_size: int
    num_workers: int = 1


def longhand_steps(rows: int, n: int, g: int) -> int:
    """Each split holds floor(rows / N) rows; a step takes G / N of them; a partial step is dropped."""
    split, per_step, steps = rows // n, g // n, 0
    while (steps + 1) * per_step <= split:
        steps += 1
    return steps


@pytest.mark.parametrize("n,g", [(1, 1), (4, 8), (6, 24), (24, 48), (48, 960)])
def test_a_step_takes_g_over_n_consecutive_rows_of_every_split(n: int, g: int) -> None:
    shape = geometry.Geometry.of(Shape(n, g))
    assert shape.rows_per_split_per_step * n == g
    assert (shape.num_splits, shape.global_batch_size, shape.steps_per_epoch) == (n, g, None)


@pytest.mark.parametrize("rows", [24, 47, 48, 95, 96, 1000, 1001])
@pytest.mark.parametrize("n,g", [(4, 8), (6, 24), (24, 48)])
def test_steps_per_epoch_counts_whole_steps_of_the_rows_every_split_holds(rows: int, n: int, g: int) -> None:
    assert geometry.Geometry.of(Shape(n, g), rows=rows).steps_per_epoch == longhand_steps(rows, n, g)


def test_an_epoch_too_small_for_one_step_has_none() -> None:
    assert geometry.Geometry.of(Shape(4, 400), rows=399).steps_per_epoch == 0  # 99 a split, 100 a step


@pytest.mark.parametrize("n,w,k", [(1, 1, 1), (24, 4, 2), (24, 3, 8), (48, 6, 1), (12, 12, 1)])
def test_ranks_and_workers_read_contiguous_blocks_that_cover_every_split_once(n: int, w: int, k: int) -> None:
    shape = geometry.Geometry.of(Shape(n, n * 2, k))
    per_rank, per_worker = n // w, n // (w * k)
    for rank in range(w):
        assert list(shape.rank_splits(rank, w)) == list(range(rank * per_rank, (rank + 1) * per_rank))
        for worker in range(k):
            first = rank * per_rank + worker * per_worker
            assert list(shape.worker_splits(rank, w, worker)) == list(range(first, first + per_worker))
    everyone = [s for r in range(w) for q in range(k) for s in shape.worker_splits(r, w, q)]
    assert everyone == list(range(n))


@pytest.mark.parametrize("g,w", [(960, 48), (48, 4), (8, 8)])
def test_a_rank_gets_g_over_w_rows_a_step(g: int, w: int) -> None:
    assert geometry.Geometry.of(Shape(w, g)).rank_batch_size(w) * w == g


def test_a_world_that_cannot_share_the_splits_is_refused() -> None:
    shape = geometry.Geometry.of(Shape(24, 48, 2))
    with pytest.raises(ValueError):
        shape.rank_splits(0, 5)
    with pytest.raises(ValueError):
        shape.worker_splits(0, 24, 0)  # one split per rank cannot go to two workers


def test_it_is_one_frozen_value_built_from_a_job_spec() -> None:
    data = specs.DataSpec(uri="/tmp/t", table="t", num_splits=8, global_batch_size=32, num_workers=2)
    shape = geometry.Geometry.of(data, rows=100)
    assert shape == geometry.Geometry(8, 32, 2, 3) and shape.rows_per_split_per_step == 4
    assert pickle.loads(pickle.dumps(shape)) == shape  # loader worker processes get it too
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.num_splits = 4  # type: ignore[misc]
