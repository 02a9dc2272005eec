"""Model-parallel groups (spec.data.ranksPerBatch): a (dp 2, tp 2) mesh of real gloo trainers under
`splitfeed local`, rescaled live to (dp 1, tp 2), its model and data in one torch DCP checkpoint.

Every rank of a tensor-parallel pair must train the same rows at every step, and each data-parallel
rank's rows must be what lancedb's StreamingDataset gives rank `dp_rank` of `dp_size` in-process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.streaming.harness import manifest
from tests.support.tables import reference_batches

HERE = Path(__file__).parent
pytestmark = pytest.mark.timeout(300)


def logs(directory: Path) -> dict[tuple[int, int], list[dict]]:
    """(world, rank) -> the rank's records."""
    out = {}
    for path in sorted(directory.glob("w*-r*.jsonl")):
        world, rank = path.stem[1:].split("-r")
        out[int(world), int(rank)] = [json.loads(line) for line in path.read_text().splitlines()]
    return out


def test_tensor_parallel_peers_share_batches_and_dcp_resumes_on_another_dp_size(table_uri, tmp_path):
    (tmp_path / "logs").mkdir()
    job = manifest(table_uri, str(tmp_path / "ckpt"), ranksPerBatch=2)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    done = subprocess.run(
        [sys.executable, "-m", "splitfeed.trainer_client.cli", "local", "-f", str(tmp_path / "job.yaml"),
         "--replicas", "4", "--scale-at", "6:2", "--resume", "none", "--quiet", "--",
         sys.executable, str(HERE / "mesh_trainer.py"), str(tmp_path / "logs"), str(tmp_path)],
        capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr
    records = logs(tmp_path / "logs")
    assert sorted(records) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)], sorted(records)
    worlds = {0: (4, 2), 1: (2, 1)}  # world -> (world size, data-parallel size)
    trained: dict[int, list[int]] = {}
    for (world, rank), lines in records.items():
        size, dp = worlds[world]
        exit_line = lines[-1]
        assert exit_line["event"] == "exit", exit_line
        dp_rank = rank // 2  # tp innermost: ranks (0, 1) and (2, 3) are the tensor-parallel pairs
        assert (exit_line["dpRank"], exit_line["dpSize"], exit_line["meshDp"]) == (dp_rank, dp, dp_rank)
        reference = reference_batches(table_uri, {"ranksPerBatch": 2}, dp, dp_rank)
        steps = [line for line in lines if "globalStep" in line]
        assert steps, (world, rank)
        for line in steps:
            assert line["ids"] == reference[line["globalStep"]], (world, rank, line["globalStep"])
            trained.setdefault(line["globalStep"], []).extend(line["ids"] if line["tp"] == 0 else [])
    drain = records[1, 0][-1]["resumeStep"]
    assert 6 <= drain < 20, drain
    # Each step once, all 48 rows of it: 20 global steps, none missing, none repeated.
    assert sorted(trained) == list(range(20))
    whole = reference_batches(table_uri, {"ranksPerBatch": 2}, 1, 0)
    assert all(sorted(trained[s]) == sorted(whole[s]) for s in range(20))
    # Tensor-parallel peers trained the same rows, step for step.
    for world, size in ((0, 4), (1, 2)):
        for first in range(0, size, 2):
            a = [(l["globalStep"], l["ids"]) for l in records[world, first] if "globalStep" in l]
            b = [(l["globalStep"], l["ids"]) for l in records[world, first + 1] if "globalStep" in l]
            assert a == b, (world, first)
    # The second world resumed from the DCP checkpoint of the drain step (its first step).
    assert [l["globalStep"] for l in records[1, 0] if "globalStep" in l][0] == drain
    assert (tmp_path / "models" / str(drain) / ".metadata").exists()
    first = next(l for l in records[1, 0] if "globalStep" in l)
    assert first["before"] == records[0, 0][-1]["after"] != records[0, 0][0]["before"]
