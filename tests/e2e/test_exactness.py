"""The exactness rule itself (tests/support/exactness.py) on hand-written trainer logs: no cluster needed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support import exactness

TOTAL = 6
"""Global steps of the made-up run; step s holds ids 4s .. 4s+3."""


def reference_rank(size: int, rank: int) -> list[list[int]]:
    per = 4 // size
    return [list(range(4 * s + rank * per, 4 * s + (rank + 1) * per)) for s in range(TOTAL)]


REFERENCE_GLOBAL = [set(range(4 * s, 4 * s + 4)) for s in range(TOTAL)]


class Run:
    """Writes trainer log lines as tests/e2e/trainer.py does."""

    def __init__(self, log_dir: Path) -> None:
        self.dir = log_dir

    def write(self, world: int, rank: int, *records: dict[str, Any]) -> None:
        with open(self.dir / f"w{world}-r{rank}.jsonl", "a") as f:
            for rec in records:
                f.write(json.dumps({**rec, "t": 0.0}) + "\n")

    def rank(self, world: int, size: int, rank: int, resume: int, steps: range, *, drained_at: int | None = None,
             end: bool = False, requested_at: int | None = None, model: str = "m", loaded: str | None = None,
             checkpoints: tuple[int, ...] = ()) -> None:
        """One rank's life: start, batches of `steps`, periodic checkpoints, a drain or the end."""
        ask = drained_at if requested_at is None else requested_at
        self.write(world, rank, {"event": "start", "pid": 1, "world": world, "worldSize": size, "rank": rank,
                                 "resumeStep": resume, "model": loaded})
        for s in steps:
            self.write(world, rank, {"event": "batch", "step": s, "ids": reference_rank(size, rank)[s],
                                     "requested": ask == s + 1, "loss": 1.0})
            if s + 1 in checkpoints:
                self.write(world, rank, {"event": "checkpoint", "step": s + 1, "drained": False,
                                         "model": f"{model}{s + 1}"})
            if drained_at == s + 1:
                self.write(world, rank, {"event": "checkpoint", "step": s + 1, "drained": True,
                                         "model": f"{model}{s + 1}"},
                           {"event": "exit", "reason": "drained"})
        if end:
            self.write(world, rank, {"event": "exit", "reason": "end"})


def check(log_dir: Path, checkpoints: set[int]) -> exactness.Summary:
    return exactness.check(log_dir, checkpoints, REFERENCE_GLOBAL, reference_rank)


def test_a_drained_world_and_its_successor_at_the_agreed_step_are_exact(tmp_path: Path) -> None:
    run = Run(tmp_path)
    for r in range(2):
        run.rank(0, 2, r, 0, range(3), drained_at=3)
    run.rank(1, 1, 0, 3, range(3, TOTAL), end=True, loaded="m3")
    summary = check(tmp_path, {3})
    assert [(w.size, w.resume_step, w.steps, w.ended, w.agreed_step) for w in summary.worlds] == [
        (2, 0, 3, exactness.DRAINED, 3), (1, 3, 3, exactness.END, None)]
    assert summary.replayed == 0


def test_ranks_that_drained_at_different_steps_fail(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.rank(0, 2, 0, 0, range(3), drained_at=3)
    run.rank(0, 2, 1, 0, range(4), requested_at=3, drained_at=4)
    run.rank(1, 1, 0, 3, range(3, TOTAL), end=True)
    with pytest.raises(AssertionError, match="different steps"):
        check(tmp_path, {3, 4})


def test_batches_past_the_agreed_step_fail_even_when_every_rank_drained_there(tmp_path: Path) -> None:
    run = Run(tmp_path)
    for r in range(2):
        run.rank(0, 2, r, 0, range(3), drained_at=3)
    run.write(0, 1, {"event": "batch", "step": 3, "ids": reference_rank(2, 1)[3], "requested": False, "loss": 1})
    run.rank(1, 1, 0, 3, range(3, TOTAL), end=True)
    with pytest.raises(AssertionError, match="replayed by the next world"):
        check(tmp_path, {3})


def test_a_successor_that_does_not_resume_at_the_agreed_step_fails(tmp_path: Path) -> None:
    run = Run(tmp_path)
    for r in range(2):
        run.rank(0, 2, r, 0, range(3), drained_at=3, checkpoints=(2,))
    run.rank(1, 1, 0, 2, range(2, TOTAL), end=True)
    with pytest.raises(AssertionError, match="resumed at 2, not there"):
        check(tmp_path, {2, 3})


def test_a_failed_world_resumes_from_its_last_complete_checkpoint_and_counts_its_replays(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.rank(0, 2, 0, 0, range(5), checkpoints=(2, 4))  # killed after step 4: no exit
    run.rank(0, 2, 1, 0, range(4), checkpoints=(2, 4))  # its all-reduce failed after step 3
    run.rank(1, 2, 0, 2, range(2, TOTAL), end=True, loaded="m2")
    run.rank(1, 2, 1, 2, range(2, TOTAL), end=True, loaded="m2")
    summary = check(tmp_path, {2})
    assert [w.ended for w in summary.worlds] == [exactness.FAILED, exactness.END]
    assert summary.replayed == 3 + 2


def test_ranks_that_disagree_on_checkpoint_requested_fail(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.rank(0, 2, 0, 0, range(3), drained_at=3)
    run.rank(0, 2, 1, 0, range(3), drained_at=3, requested_at=2)
    run.rank(1, 1, 0, 3, range(3, TOTAL), end=True)
    with pytest.raises(AssertionError, match="checkpoint_requested differs"):
        check(tmp_path, {3})


def test_a_resumed_model_that_is_missing_or_not_the_one_saved_fails(tmp_path: Path) -> None:
    run = Run(tmp_path)
    for r in range(2):
        run.rank(0, 2, r, 0, range(3), drained_at=3)
    run.rank(1, 1, 0, 3, range(3, TOTAL), end=True, loaded="other")
    with pytest.raises(AssertionError, match="the model checkpointed there was m3"):
        check(tmp_path, {3})
    (tmp_path / "w1-r0.jsonl").unlink()
    run.write(1, 0, {"event": "start", "pid": 1, "world": 1, "worldSize": 1, "rank": 0, "resumeStep": 3,
                     "model": None}, {"event": "model-missing", "step": 3, "path": "models/step-000003.pt"})
    with pytest.raises(AssertionError, match="model was never saved"):
        check(tmp_path, {3})


def test_commit_markers_make_a_step_complete(tmp_path: Path) -> None:
    step = tmp_path / f"step-{3:012d}"
    step.mkdir()
    for r in range(2):
        (step / f"rank-{r:05d}-of-00002.json").write_text("{}")
    (step / "rank-00000-of-00002.commit").write_text("")
    assert exactness.complete_checkpoints(tmp_path) == set()
    (step / "rank-00001-of-00002.commit").write_text("")
    assert exactness.complete_checkpoints(tmp_path) == {3}


def test_commit_markers_of_one_world_make_a_step_complete_also_a_level_deeper(tmp_path: Path) -> None:
    step = tmp_path / "job-uid" / f"step-{5:012d}"
    step.mkdir(parents=True)
    for name in ("w000001-rank-00000-of-00002", "w000002-rank-00001-of-00002"):
        (step / f"{name}.json").write_text("{}")
        (step / f"{name}.commit").write_text("")
    assert exactness.complete_checkpoints(tmp_path) == set(), "ranks of two worlds make no complete step"
    for name in ("w000001-rank-00001-of-00002",):
        (step / f"{name}.json").write_text("{}")
        (step / f"{name}.commit").write_text("")
    assert exactness.complete_checkpoints(tmp_path) == {5}
