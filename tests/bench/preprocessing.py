"""`make bench`, preprocessing: rows/s a trainer receives and the CPU it spends.

image: a table of JPEG-encoded images (Pillow) and labels; the transform decodes
and normalises (tests/bench/transforms.py, the same function both ways). Through
a `splitfeed sidecar` process (numWorkers 1 and 2) against lancedb's
StreamingDataLoader with the same transform in the trainer's process (num_workers
0 and 2). packing: lancedb's pack_sequences of a token column, through the
sidecar against StreamingDataLoader in-process (num_workers 0).

What is measured, the same way for every configuration: the first batch is
warm-up (process start, imports, the loaders' start) and is excluded; the window
runs from it to the last batch (the pipeline's shut-down is excluded too).
- rows/s: rows received in the window / its wall time;
- trainer CPU: this process's own CPU (time.process_time: all its threads, so
  lancedb's transform pool when num_workers=0 and ZeroMQ's I/O thread, but not
  its child processes), per 1,000 rows;
- helper CPU: the CPU of this process's descendants in the window (the sidecar
  and its loader workers, or the DataLoader's worker processes), per 1,000 rows.
  The in-process DataLoader workers run in the trainer's container, so trainer
  + helper CPU is what the trainer's pod spends when num_workers > 0;
- load: the 1-minute load average when the run started (the machine is shared).
Configurations take turns, REPEATS rounds, and each figure is the best and the
worst of its runs. `python -m tests.bench.preprocessing image|packing [--repeats
N] [--only NAME ...]` runs one case (or some configurations) in isolation.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from splitfeed.trainer_client.script.client import StreamClient
from tests.bench import run

ROOT = Path(__file__).resolve().parents[2]
REPEATS = 3
IMAGE_ROWS, IMAGE_SIDE, IMAGE_SPLITS, IMAGE_BATCH = 6_144, 64, 16, 256
DOCS, BLOCK, PACK_SPLITS, PACK_BATCH, BLOCKS = 20_000, 512, 8, 64, 8 * 64 * 12


def write_images(uri: str) -> None:
    import lancedb
    import pyarrow as pa
    from PIL import Image

    rng = np.random.default_rng(0)
    jpegs = []
    base = rng.integers(0, 255, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)
    for i in range(IMAGE_ROWS):
        pixels = np.roll(base, i, axis=(0, 1))  # real-looking content, cheap to make
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
        jpegs.append(buf.getvalue())
    lancedb.connect(uri).create_table("images", pa.table({
        "jpeg": pa.array(jpegs, pa.binary()),
        "label": pa.array(rng.integers(0, 1000, IMAGE_ROWS), pa.int32()),
    }), mode="overwrite")


def write_tokens(uri: str) -> None:
    import lancedb
    import pyarrow as pa

    rng = np.random.default_rng(1)
    lengths = rng.integers(50, 500, DOCS)
    values = rng.integers(3, 50_000, int(lengths.sum()), dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    lancedb.connect(uri).create_table("docs", pa.table({
        "tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
    }), mode="overwrite")


@dataclass(frozen=True)
class Run:
    rows_per_s: float
    trainer_cpu: float  # CPU s per 1,000 rows, this process (its threads, not its children)
    helper_cpu: float  # CPU s per 1,000 rows, its child processes (sidecar, loader workers)
    load: float  # 1-minute load average at the start


def _cpu_of(procs: list[psutil.Process]) -> dict[int, float]:
    cpu = {}
    for proc in procs:
        try:
            times = proc.cpu_times()
            cpu[proc.pid] = times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return cpu


def _reaped_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _helpers_cpu(before: dict[int, float], reaped: float) -> float:
    """CPU of this process's descendants since `before` (live ones by pid, reaped ones by rusage)."""
    now = _cpu_of(psutil.Process().children(recursive=True))
    gone = sum(cpu for pid, cpu in before.items() if pid not in now)
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in now.items()) + (_reaped_cpu() - reaped) - gone


def _measure(batches: Callable[[], Any], rows_of: Callable[[Any], int], total: int) -> Run:
    """One run over an iterator of `total` rows: its first batch is warm-up, the window ends at the last."""
    it = iter(batches())
    seen = rows_of(next(it))
    load = os.getloadavg()[0]
    before, reaped = _cpu_of(psutil.Process().children(recursive=True)), _reaped_cpu()
    wall, cpu = time.perf_counter(), time.process_time()
    rows, end = 0, None
    for batch in it:
        rows += rows_of(batch)
        if seen + rows == total:
            end = time.perf_counter() - wall, time.process_time() - cpu, _helpers_cpu(before, reaped)
    if end is None:
        raise RuntimeError(f"the loader gave {seen + rows} rows, not the table's {total}")
    del batch, it  # the last batch and the loader: the sidecar or workers shut down
    wall, cpu, helpers = end
    return Run(rows / wall, cpu / rows * 1000, helpers / rows * 1000, load)


def _sidecar(data: dict[str, Any], workdir: Path) -> Any:
    from splitfeed.trainer_client.contract import specs

    job = specs.parse_job({"apiVersion": specs.API_VERSION, "kind": specs.KIND,
                           "metadata": {"name": "bench"}, "spec": {"data": data}})
    config = workdir / "config.json"
    config.write_text(json.dumps(job.data_config()))
    sockets, env = run.sidecar_env(workdir)
    proc = subprocess.Popen([sys.executable, "-m", "splitfeed.trainer_client.cli", "sidecar",
                             "--config", str(config)], env=env, cwd=ROOT)
    try:
        with StreamClient(sockets, 0, timeout_s=300) as client:
            yield from client
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(sockets, ignore_errors=True)


def _inprocess(uri: str, table: str, num_workers: int, batch_size: int, **kwargs: Any) -> Any:
    import lancedb
    from lancedb.streaming import StreamingDataLoader, StreamingDataset

    dataset = StreamingDataset(lancedb.connect(uri).open_table(table), shuffle=True, shuffle_seed=0,
                               **kwargs)
    extra = {"multiprocessing_context": "spawn"} if num_workers else {}  # lancedb is not fork-safe
    loader = StreamingDataLoader(dataset, batch_size=batch_size, num_workers=num_workers, **extra)
    yield from loader


def _rounds(configs: dict[str, Callable[[], Any]], rows_of: Callable[[Any], int], total: int,
            repeats: int) -> dict[str, list[Run]]:
    """REPEATS rounds in which the configurations take turns, so that each sees the load of each round."""
    runs: dict[str, list[Run]] = {name: [] for name in configs}
    for round_ in range(repeats):
        for name, make in configs.items():
            run = _measure(make, rows_of, total)
            runs[name].append(run)
            print(f"  [{round_ + 1}/{repeats}] {name}: {run.rows_per_s:,.0f} rows/s, trainer CPU "
                  f"{run.trainer_cpu:.4f} + helpers {run.helper_cpu:.4f} s / 1,000 rows "
                  f"(load {run.load:.1f})", flush=True)
    return runs


def _summary(runs: list[Run]) -> dict[str, Any]:
    """Best and worst of a configuration's runs (best rows/s is the highest, best CPU the lowest)."""
    rate = [r.rows_per_s for r in runs]
    trainer = [r.trainer_cpu for r in runs]
    helpers = [r.helper_cpu for r in runs]
    total = [r.trainer_cpu + r.helper_cpu for r in runs]
    return {
        "rows_per_s": round(max(rate)), "worst_rows_per_s": round(min(rate)),
        "trainer_cpu_s_per_1000": round(min(trainer), 4), "worst_trainer_cpu_s_per_1000": round(max(trainer), 4),
        "helper_cpu_s_per_1000": round(min(helpers), 4),
        "total_cpu_s_per_1000": round(min(total), 4), "worst_total_cpu_s_per_1000": round(max(total), 4),
        "load_average": [round(r.load, 1) for r in runs],
    }


def _compare(out: dict[str, Any], ours: list[str], theirs: list[str]) -> None:
    """The ratios the issue's goals are about, best against best and worst against worst."""
    def pick(names: list[str], key: str, better: Callable[..., float]) -> float:
        return better(out[n][key] for n in names)

    out["throughput_ratio"] = round(pick(ours, "rows_per_s", max) / pick(theirs, "rows_per_s", max), 2)
    out["worst_throughput_ratio"] = round(
        pick(ours, "worst_rows_per_s", max) / pick(theirs, "worst_rows_per_s", max), 2)
    # Trainer CPU: the trainer process alone on both sides (in-process workers excluded) ...
    out["trainer_cpu_ratio"] = round(
        pick(theirs, "trainer_cpu_s_per_1000", min) / pick(ours, "trainer_cpu_s_per_1000", min), 2)
    out["worst_trainer_cpu_ratio"] = round(
        pick(theirs, "worst_trainer_cpu_s_per_1000", min) / pick(ours, "worst_trainer_cpu_s_per_1000", min), 2)
    # ... and the trainer's pod: in-process, the DataLoader's workers are the trainer's children.
    pod = min(out[n]["trainer_cpu_s_per_1000"] + out[n]["helper_cpu_s_per_1000"] for n in theirs)
    out["trainer_pod_cpu_ratio"] = round(pod / pick(ours, "trainer_cpu_s_per_1000", min), 2)


def bench_image(repeats: int = REPEATS, only: list[str] | None = None) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="sf-bench-img-"))
    try:
        uri = str(workdir / "db")
        print(f"  writing {IMAGE_ROWS} {IMAGE_SIDE}x{IMAGE_SIDE} JPEGs (Pillow) with labels", flush=True)
        write_images(uri)
        from tests.bench.transforms import decode_normalise

        def sidecar(k: int) -> Callable[[], Any]:
            data = {"uri": uri, "table": "images", "numSplits": IMAGE_SPLITS, "globalBatchSize": IMAGE_BATCH,
                    "transform": "tests.bench.transforms:decode_normalise", "numWorkers": k}
            return lambda: _sidecar(data, workdir)

        def inprocess(k: int) -> Callable[[], Any]:
            return lambda: _inprocess(uri, "images", k, IMAGE_BATCH, num_splits=IMAGE_SPLITS,
                                      transform=decode_normalise)

        configs = {"sidecar_workers_1": sidecar(1), "sidecar_workers_2": sidecar(2),
                   "inprocess_workers_0": inprocess(0), "inprocess_workers_2": inprocess(2)}
        configs = {n: c for n, c in configs.items() if not only or n in only}
        runs = _rounds(configs, lambda b: len(b["label"]), IMAGE_ROWS, repeats)
        out: dict[str, Any] = {name: _summary(r) for name, r in runs.items()}
        ours = [n for n in out if n.startswith("sidecar")]
        theirs = [n for n in out if n.startswith("inprocess")]
        if ours and theirs:
            _compare(out, ours, theirs)
        return out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def bench_packing(repeats: int = REPEATS, only: list[str] | None = None) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="sf-bench-pack-"))
    try:
        uri = str(workdir / "db")
        print(f"  writing {DOCS} token lists of 50..500 tokens", flush=True)
        write_tokens(uri)
        pack = {"column": "tokens", "blockSize": BLOCK, "eosId": 2, "padId": 0, "blocksPerEpoch": BLOCKS}
        data = {"uri": uri, "table": "docs", "numSplits": PACK_SPLITS, "globalBatchSize": PACK_BATCH,
                "packSequences": pack}
        configs = {
            "sidecar": lambda: _sidecar(data, workdir),
            "inprocess": lambda: _inprocess(uri, "docs", 0, PACK_BATCH, num_splits=PACK_SPLITS,
                                            columns=["tokens"], pack_sequences=BLOCK, eos_id=2, pad_id=0,
                                            blocks_per_epoch=BLOCKS),
        }
        configs = {n: c for n, c in configs.items() if not only or n in only}
        runs = _rounds(configs, lambda b: len(b["input_ids"]), BLOCKS, repeats)
        out: dict[str, Any] = {name: _summary(r) for name, r in runs.items()}
        if len(out) == 2:
            _compare(out, ["sidecar"], ["inprocess"])
        return out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="make bench's preprocessing cases, one at a time")
    parser.add_argument("case", choices=["image", "packing"])
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--only", nargs="*", help="configurations to run, e.g. sidecar_workers_1")
    args = parser.parse_args()
    bench = bench_image if args.case == "image" else bench_packing
    print(json.dumps(bench(args.repeats, args.only), indent=2))


if __name__ == "__main__":
    main()
