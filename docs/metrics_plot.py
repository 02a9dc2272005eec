"""Make docs/metrics.png from series really scraped off the sidecars' /metrics during a local run.

    .venv/bin/pip install matplotlib   # not a splitfeed dependency
    .venv/bin/python docs/metrics_plot.py [--out docs/metrics.png]

Writes a small LanceDB table to a temporary directory, runs a 2-replica job with
`splitfeed local` (SPLITFEED_METRICS_PORT: replica r's sidecar serves on PORT + r),
scrapes both sidecars every 0.25 s with the Prometheus client's parser, and plots
rows per second, the data-stall share and data-ready p50/p95/p99 per rank. The
trainer "computes" 40 ms per step for its first 200 steps and nothing after: the
second half is data-bound, so the stall share and the latencies rise there.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import lancedb
import numpy as np
import pyarrow as pa
from prometheus_client.parser import text_string_to_metric_families

from splitfeed.trainer_client.contract import stalls

ROOT = Path(__file__).resolve().parent.parent
TRAINER = textwrap.dedent("""
    import time
    from splitfeed.trainer_client import StreamClient

    client = StreamClient()
    for batch in client:
        if batch.global_step < 200:
            time.sleep(0.04)  # a model step
    s = client.stats.stall
    print(f"rank {client.rank}: stall share {s.stall_share:.1%}, data-ready p50 {s.p50_s}, p99 {s.p99_s}")
    client.close()
""")


def job(work: Path) -> dict:
    return {"apiVersion": "splitfeed.io/v1alpha1", "kind": "StreamingJob", "metadata": {"name": "metrics-demo"},
            "spec": {"replicas": 2, "data": {"uri": str(work / "db"), "table": "frames", "numSplits": 24,
                                             "globalBatchSize": 48, "epochs": 4, "shuffle": True},
                     "sidecar": {"prefetchBatches": 4},
                     "trainer": {"template": {"spec": {"containers": [
                         {"name": "trainer", "command": [sys.executable, str(work / "trainer.py")]}]}}}}}


def free_ports(n: int) -> int:
    """A base port with the n after it free (good enough for a local script)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65536 and all(_free(base + i) for i in range(n)):
            return base


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def scrape(port: int) -> dict[str, dict]:
    """rank -> {rows, wait, wall, buckets} from one sidecar; {} if it does not answer."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            rank = s.labels.get("rank")
            if rank is None:
                continue
            r = out.setdefault(rank, {"buckets": {}})
            if s.name == "splitfeed_rows_delivered_total":
                r["rows"] = s.value
            elif s.name == "splitfeed_data_wait_seconds_total":
                r["wait"] = s.value
            elif s.name == "splitfeed_trainer_seconds_total":
                r["wall"] = s.value
            elif s.name == "splitfeed_data_ready_seconds_bucket":
                r["buckets"][s.labels["le"]] = s.value
    return out


def per_bucket(cumulative: dict[str, float]) -> list[int]:
    """Prometheus' cumulative le buckets back to per-bucket counts (stalls.BUCKETS_S order)."""
    keys = [repr(b) for b in stalls.BUCKETS_S] + ["+Inf"]
    values = [cumulative.get(k, 0.0) for k in keys]
    return [int(v - (values[i - 1] if i else 0)) for i, v in enumerate(values)]


def run(work: Path) -> list[tuple[float, dict[str, dict]]]:
    lancedb.connect(str(work / "db")).create_table("frames", pa.table({
        "id": pa.array(np.arange(8192), pa.int64()),
        "features": pa.FixedSizeListArray.from_arrays(
            pa.array(np.random.default_rng(0).standard_normal(8192 * 256).astype(np.float32)), 256),
    }))
    (work / "trainer.py").write_text(TRAINER)
    (work / "job.json").write_text(json.dumps(job(work)))
    base = free_ports(2)
    env = {**os.environ, "SPLITFEED_METRICS_PORT": str(base)}
    launcher = subprocess.Popen([sys.executable, "-m", "splitfeed.trainer_client.cli", "local", "-f",
                                 str(work / "job.json"), "--resume", "none", "--quiet"], env=env, cwd=work)
    series: list[tuple[float, dict[str, dict]]] = []
    started = time.monotonic()
    while launcher.poll() is None:
        sample: dict[str, dict] = {}
        for port in (base, base + 1):
            sample.update(scrape(port))
        if sample:
            series.append((time.monotonic() - started, sample))
        time.sleep(0.25)
    if launcher.returncode != 0:
        raise SystemExit(f"splitfeed local failed ({launcher.returncode})")
    return series


def plot(series: list[tuple[float, dict[str, dict]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    window = 4  # samples (1 s)
    for rank in sorted({r for _, s in series for r in s}):
        points = [(t, s[rank]) for t, s in series if rank in s and "wall" in s[rank]]
        ts, rate, share, p50, p95, p99 = [], [], [], [], [], []
        for (t0, a), (t1, b) in zip(points, points[window:]):
            wall = b["wall"] - a["wall"]
            if wall <= 0:
                continue
            ts.append(t1)
            rate.append((b["rows"] - a["rows"]) / (t1 - t0))
            share.append((b["wait"] - a["wait"]) / wall)
            counts = [y - x for x, y in zip(per_bucket(a["buckets"]), per_bucket(b["buckets"]))]
            p50.append(max(0.01, (stalls.quantile(counts, 0.5) or 0) * 1000))
            p95.append(max(0.01, (stalls.quantile(counts, 0.95) or 0) * 1000))
            p99.append(max(0.01, (stalls.quantile(counts, 0.99) or 0) * 1000))
        axes[0].plot(ts, rate, label=f"rank {rank}")
        axes[1].plot(ts, share, label=f"rank {rank}")
        for values, style, q in ((p50, "-", "p50"), (p95, "--", "p95"), (p99, ":", "p99")):
            axes[2].plot(ts, values, style, label=f"rank {rank} {q}")
    axes[0].set_ylabel("rows / s")
    axes[1].set_ylabel("data-stall share")
    axes[1].set_ylim(0, 1.05)
    axes[2].set_ylabel("data-ready latency (ms)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("seconds since `splitfeed local` started (rates over 1 s windows)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=3)
    fig.suptitle("splitfeed local, 2 ranks: the trainer computes 40 ms/step until step 200, then nothing\n"
                 "(scraped from the sidecars' /metrics every 0.25 s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "metrics.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="splitfeed-metrics-") as tmp:
        series = run(Path(tmp))
    if len(series) < 8:
        raise SystemExit(f"only {len(series)} scrapes: the run was too short to plot")
    plot(series, args.out)
    print(f"{len(series)} scrapes -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
