"""Plans built in a child forked from the sidecar's helper (sidecar/forks/forking.py), in a process
of their own (tests/reading/building.py) that forks the helper first, as a sidecar does.

The oracle is StreamingDataset iterated in-process, as in test_plans.py: split s of the
plan, taken by row id, must give rank s's `id` column of a world of N ranks over N splits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from splitfeed.sidecar.data import reading
from splitfeed.sidecar.table import plans, takes
from tests.reading.tables import data_spec, ids_of, reference_rows

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]


def build_in_own_process(uri: str, root: Path, order: dict[str, Any], *extra: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "tests.reading.building", uri, str(root), json.dumps(order),
                           *extra], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def assert_plan_is_lancedbs(uri: str, order: dict[str, Any], location: plans.Location) -> None:
    table, data = reading.pin(data_spec(uri, **order))
    ids = plans.read_splits(location, plans.PlanKey.of(data), 0, range(data.num_splits))
    for split in range(data.num_splits):
        expected = [r["id"] for r in reference_rows(data, epoch=0, rank=split, world_size=data.num_splits)]
        assert ids_of(takes.take_rows(table, ids[split], ["id"])) == expected, f"split {split}"


def gone(pid: int, within_s: float = 30.0) -> bool:
    """Whether process `pid` has ended (or is a zombie nobody reaped) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("order", [pytest.param({}, id="shuffled"),
                                   pytest.param({"filter": "label != 3"}, id="filtered")])
def test_a_plan_built_through_the_sidecars_helper_is_lancedbs_and_starts_no_fork_server(
        db_uri: str, tmp_path: Path, order: dict[str, Any]) -> None:
    """The build child comes from the helper forked at the start (no fork server importing
    lancedb again: seconds on the way to a cold start's first batch), and its plan is
    lancedb's order; the helper ends with the process that forked it."""
    got = build_in_own_process(db_uri, tmp_path, order)
    assert got["fork_server"] is None, "the build waited for multiprocessing's fork server"
    assert_plan_is_lancedbs(db_uri, order, plans.Location(got["location"]))
    assert gone(got["helper"]), "the helper outlived its sidecar"


def test_a_dying_child_is_reported_and_a_lost_helper_leaves_the_fork_server_to_build(
        db_uri: str, tmp_path: Path) -> None:
    """A child that dies without a word is reported with its exit code (the sidecar names the
    memory limit for it); once the helper is gone, the plan is still built, from the fork server."""
    got = build_in_own_process(db_uri, tmp_path, {}, "--kill-helper")
    assert got["died"] == 3
    assert got["fork_server"] is not None
    assert_plan_is_lancedbs(db_uri, {}, plans.Location(got["location"]))
