"""`make demo`: train on 2 ranks, checkpoint, resume on 4, and show that every
global batch is the one a 1-rank run sees.

Writes a small synthetic LanceDB table under .demo/, then runs
examples/demo-job.yaml three times with `splitfeed local`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import lancedb
import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / ".demo"
JOB = ROOT / "examples" / "demo-job.yaml"
ROWS = 4096
STOP_AT = 20


def write_table() -> None:
    rng = np.random.default_rng(0)
    features = rng.standard_normal((ROWS, 16)).astype(np.float32)
    table = pa.table({
        "id": pa.array(np.arange(ROWS), pa.int64()),
        "label": pa.array(rng.integers(0, 10, ROWS), pa.int32()),
        "features": pa.FixedSizeListArray.from_arrays(pa.array(features.ravel()), 16),
    })
    lancedb.connect(str(DEMO / "db")).create_table("frames", table, mode="overwrite")


def local(replicas: int, out: str, *extra: str, resume: str = "latest") -> None:
    cmd = [sys.executable, "-m", "splitfeed.trainer_client.cli", "local", "-f", str(JOB),
           "--replicas", str(replicas), "--resume", resume, "--",
           sys.executable, "examples/train.py", "--out", out, *extra]
    print(f"\n$ splitfeed local -f examples/demo-job.yaml --replicas {replicas} --resume {resume}"
          f" -- python examples/train.py --out {out} {' '.join(extra)}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def global_steps(run: Path) -> dict[int, list[int]]:
    """Global step -> sorted ids, gathered from every rank's log."""
    steps: dict[int, list[int]] = defaultdict(list)
    for path in run.glob("ids-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps[record["step"]].extend(record["ids"])
    return {step: sorted(ids) for step, ids in steps.items()}


def digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:12]


def main() -> int:
    shutil.rmtree(DEMO, ignore_errors=True)
    DEMO.mkdir()
    print(f"writing a {ROWS}-row LanceDB table to .demo/db", flush=True)
    write_table()
    local(1, ".demo/one-rank", resume="none")
    local(2, ".demo/elastic", "--stop-at-step", str(STOP_AT), resume="none")
    print(f"\n(2 ranks checkpointed after global step {STOP_AT}; resuming on 4 ranks)")
    local(4, ".demo/elastic")

    one, elastic = global_steps(DEMO / "one-rank"), global_steps(DEMO / "elastic")
    print(f"\n{'global step':>11}  {'1 rank':>12}  {'2 then 4 ranks':>14}")
    same = 0
    for step in sorted(set(one) | set(elastic)):
        a, b = one.get(step), elastic.get(step)
        ok = a is not None and a == b
        same += ok
        if step < 3 or STOP_AT - 2 <= step <= STOP_AT + 1 or step >= max(one) - 1 or not ok:
            print(f"{step:>11}  {digest(a) if a else '-':>12}  {digest(b) if b else '-':>14}"
                  f"  {'same' if ok else 'DIFFERENT'}")
        elif step == 3:
            print(f"{'...':>11}")
    total = len(set(one) | set(elastic))
    print(f"\n{same}/{total} global steps identical across the resize "
          f"({len(one[0])} rows each).")
    return 0 if same == total and total > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
