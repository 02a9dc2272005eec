"""sidecar/world/commitments.py: the drain step a sidecar committed to, kept for the sidecar that restarts after it."""

from __future__ import annotations

from pathlib import Path

from splitfeed.sidecar.world import commitments


def test_a_kept_commitment_is_read_back_for_its_own_world_only(tmp_path: Path) -> None:
    assert commitments.load(tmp_path, 3) is None  # none kept: a first start
    commitments.save(tmp_path, 3, 17, "rescale", 2)
    assert commitments.load(tmp_path, 3) == (17, "rescale", 2)
    assert commitments.load(tmp_path, 4) is None  # a later world of a pod kept in place: not its drain
    commitments.save(tmp_path, 4, 30, "preempt", 0)
    assert commitments.load(tmp_path, 4) == (30, "preempt", 0)
    assert list(tmp_path.iterdir()) == [tmp_path / commitments.FILE]  # written whole: no temporary left


def test_a_damaged_commitment_is_ignored_not_fatal(tmp_path: Path) -> None:
    for text in ("{", "[]", '{"worldEpoch": 1}', '{"worldEpoch": 1, "step": "x", "reason": "r", "nextReplicas": 0}'):
        (tmp_path / commitments.FILE).write_text(text)
        assert commitments.load(tmp_path, 1) is None, text


def test_an_unwritable_directory_only_warns(tmp_path: Path) -> None:
    commitments.save(tmp_path / "missing", 1, 5, "rescale", 0)  # the drain goes on without it
    assert commitments.load(tmp_path / "missing", 1) is None
