"""`make demo`: a DDP job scaled 2 -> 4 -> 3 ranks while it runs, and proof that
every global batch is the one a 1-rank run sees.

Writes a small synthetic LanceDB table under .demo/, runs examples/demo-job.yaml
on 1 rank, then on 2 ranks rescaled live (`--scale-at`) to 4 and then 3, each
rescale through the same drain agreement and resume as on a cluster, and prints
a digest of every global batch side by side; then the same rescales in place
(`--rescale inPlace`), whose timings print beside the first run's.
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
SCALE_AT = ((10, 4), (25, 3))


def write_table() -> None:
    rng = np.random.default_rng(0)
    features = rng.standard_normal((ROWS, 16)).astype(np.float32)
    table = pa.table({
        "id": pa.array(np.arange(ROWS), pa.int64()),
        "label": pa.array(rng.integers(0, 10, ROWS), pa.int32()),
        "features": pa.FixedSizeListArray.from_arrays(pa.array(features.ravel()), 16),
    })
    lancedb.connect(str(DEMO / "db")).create_table("frames", table, mode="overwrite")


def local(replicas: int, out: str, *extra: str) -> None:
    cmd = [sys.executable, "-m", "splitfeed.trainer_client.cli", "local", "-f", str(JOB),
           "--replicas", str(replicas), "--resume", "none", *extra, "--",
           sys.executable, "examples/train.py", "--out", out]
    shown = " ".join(["splitfeed local -f examples/demo-job.yaml", "--replicas", str(replicas), *extra])
    print(f"\n$ {shown} -- python examples/train.py --out {out}", flush=True)
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


def compare(one: dict[int, list[int]], elastic: dict[int, list[int]], rescaled_at: list[int]) -> int:
    """Print the side-by-side digests; the number of global steps that differ (or are missing)."""
    print(f"\n{'global step':>11}  {'1 rank':>12}  {'2 -> 4 -> 3 ranks':>17}")
    steps = sorted(set(one) | set(elastic))
    bad = 0
    for step in steps:
        a, b = one.get(step), elastic.get(step)
        ok = a is not None and a == b
        bad += not ok
        near = any(abs(step - s) <= 1 for s in rescaled_at)
        if step < 2 or near or step >= max(steps) - 1 or not ok:
            mark = "  <- rescaled here" if step in rescaled_at else ""
            print(f"{step:>11}  {digest(a) if a else '-':>12}  {digest(b) if b else '-':>17}"
                  f"  {'same' if ok else 'DIFFERENT'}{mark}")
        elif step == 2 or any(step == s + 2 for s in rescaled_at):
            print(f"{'...':>11}")
    rows = len(one[0]) if 0 in one else 0
    print(f"\n{len(steps) - bad}/{len(steps)} global steps identical across the rescales ({rows} rows each).")
    return bad


def resumed_at(run: Path) -> list[int]:
    """The first global step of every world after the first (where each rescale cut)."""
    firsts: dict[str, int] = {}
    for path in run.glob("ids-*.jsonl"):
        steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
        if steps:
            firsts[path.name] = min(firsts.get(path.name, steps[0]), steps[0])
    return sorted({s for s in firsts.values() if s > 0})


def main() -> int:
    shutil.rmtree(DEMO, ignore_errors=True)
    DEMO.mkdir()
    print(f"writing a {ROWS}-row LanceDB table to .demo/db", flush=True)
    write_table()
    local(1, ".demo/one-rank")
    scale = [arg for step, n in SCALE_AT for arg in ("--scale-at", f"{step}:{n}")]
    local(2, ".demo/elastic", *scale)
    one, elastic = global_steps(DEMO / "one-rank"), global_steps(DEMO / "elastic")
    bad = compare(one, elastic, resumed_at(DEMO / "elastic"))
    # The same rescales in place: the processes of the replicas that stay keep running, and
    # `splitfeed run` starts the same train.py again in each world (README, "Rescaling in place").
    local(2, ".demo/in-place", *scale, "--rescale", "inPlace")
    bad += compare(one, global_steps(DEMO / "in-place"), resumed_at(DEMO / "in-place"))
    return 1 if bad or not one else 0


if __name__ == "__main__":
    raise SystemExit(main())
