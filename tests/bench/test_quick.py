"""`python -m tests.bench.run --quick`: every bench of `make bench` runs at a small size and the
results file holds each section. Not a measurement (CI's figures on a shared machine mean
nothing): a bench that can no longer run (as the lone-sidecar benches could not once the
control plane needed a keypair) fails here, not on the day someone measures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = {"transport", "end_to_end", "adapters", "preprocessing", "tables", "object_store", "rescale",
            "coordinator", "machine"}


@pytest.mark.timeout(900)
def test_every_bench_runs_at_a_small_size_and_writes_its_results(tmp_path):
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, "-m", "tests.bench.run", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=880)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert set(results) == SECTIONS
    assert results["transport"][0]["gbps"] > 0 and results["end_to_end"]["rows_per_s"] > 0
    assert [t["rows"] for t in results["tables"]["tables"]] == [100_000]
    assert list(results["coordinator"]["runs"]) == ["64"]
    assert "goal:" in done.stdout and "written to" in done.stdout
