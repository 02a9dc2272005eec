"""`make bench`, preprocessing: rows/s a trainer receives and the trainer's own CPU.

image: a table of JPEG-encoded images (Pillow) and labels; the transform decodes
and normalises (tests/bench/transforms.py). Through a `splitfeed sidecar` process
(numWorkers 1 and 2) against lancedb's StreamingDataLoader with the same transform
in the trainer's process (num_workers 0 and 2). Trainer CPU is this process's own
(time.process_time: its threads, not its children), per 1,000 rows.
packing: lancedb's pack_sequences of a token column, through the sidecar against
StreamingDataLoader in-process (num_workers 0).
Each figure is the best and the worst of REPEATS runs in this process.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from splitfeed.trainer_client.client import StreamClient

ROOT = Path(__file__).resolve().parents[2]
REPEATS = 2
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


def _measure(batches: Callable[[], Any], rows_of: Callable[[Any], int]) -> tuple[float, float]:
    """(rows/s, trainer CPU s per 1,000 rows) over an iterator, its first batch excluded."""
    it = iter(batches())
    next(it)
    wall, cpu = time.perf_counter(), time.process_time()
    rows = 0
    for batch in it:
        rows += rows_of(batch)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return rows / wall, cpu / rows * 1000


def _sidecar(data: dict[str, Any], workdir: Path) -> Any:
    from splitfeed.trainer_client import specs

    job = specs.parse_job({"apiVersion": specs.API_VERSION, "kind": specs.KIND,
                           "metadata": {"name": "bench"}, "spec": {"data": data}})
    config = workdir / "config.json"
    config.write_text(json.dumps(job.data_config()))
    sockets = Path(tempfile.mkdtemp(prefix="sf-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    env = {**os.environ, "SPLITFEED_SOCKET_DIR": str(sockets), "RANK": "0", "WORLD_SIZE": "1",
           "SPLITFEED_RESUME": "none"}
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


def _runs(name: str, make: Callable[[], Any], rows_of: Callable[[Any], int]) -> dict[str, Any]:
    figures = [_measure(make, rows_of) for _ in range(REPEATS)]
    best, worst = max(f[0] for f in figures), min(f[0] for f in figures)
    cpu = min(f[1] for f in figures)
    print(f"  {name}: {best:,.0f} rows/s (worst {worst:,.0f}), trainer CPU {cpu:.3f} s / 1,000 rows",
          flush=True)
    return {"rows_per_s": round(best), "worst_rows_per_s": round(worst), "trainer_cpu_s_per_1000": round(cpu, 4)}


def bench_image() -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="sf-bench-img-"))
    try:
        uri = str(workdir / "db")
        print(f"  writing {IMAGE_ROWS} {IMAGE_SIDE}x{IMAGE_SIDE} JPEGs (Pillow) with labels", flush=True)
        write_images(uri)
        from tests.bench.transforms import decode_normalise

        out: dict[str, Any] = {}
        for k in (1, 2):
            data = {"uri": uri, "table": "images", "numSplits": IMAGE_SPLITS, "globalBatchSize": IMAGE_BATCH,
                    "transform": "tests.bench.transforms:decode_normalise", "numWorkers": k}
            out[f"sidecar_workers_{k}"] = _runs(f"sidecar, numWorkers={k}", lambda: _sidecar(data, workdir),
                                                lambda b: len(b["label"]))
        for k in (0, 2):
            out[f"inprocess_workers_{k}"] = _runs(
                f"StreamingDataLoader in-process, num_workers={k}",
                lambda: _inprocess(uri, "images", k, IMAGE_BATCH, num_splits=IMAGE_SPLITS,
                                   transform=decode_normalise),
                lambda b: len(b["label"]))
        ours = max(out[f"sidecar_workers_{k}"]["rows_per_s"] for k in (1, 2))
        theirs = max(out[f"inprocess_workers_{k}"]["rows_per_s"] for k in (0, 2))
        our_cpu = min(out[f"sidecar_workers_{k}"]["trainer_cpu_s_per_1000"] for k in (1, 2))
        their_cpu = min(out[f"inprocess_workers_{k}"]["trainer_cpu_s_per_1000"] for k in (0, 2))
        out["throughput_ratio"] = round(ours / theirs, 2)
        out["trainer_cpu_ratio"] = round(their_cpu / max(our_cpu, 1e-9), 2)
        return out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def bench_packing() -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="sf-bench-pack-"))
    try:
        uri = str(workdir / "db")
        print(f"  writing {DOCS} token lists of 50..500 tokens", flush=True)
        write_tokens(uri)
        pack = {"column": "tokens", "blockSize": BLOCK, "eosId": 2, "padId": 0, "blocksPerEpoch": BLOCKS}
        data = {"uri": uri, "table": "docs", "numSplits": PACK_SPLITS, "globalBatchSize": PACK_BATCH,
                "packSequences": pack}
        out = {"sidecar": _runs("packing through the sidecar", lambda: _sidecar(data, workdir),
                                lambda b: len(b["input_ids"]))}
        out["inprocess"] = _runs(
            "pack_sequences in-process (StreamingDataLoader, num_workers=0)",
            lambda: _inprocess(uri, "docs", 0, PACK_BATCH, num_splits=PACK_SPLITS, columns=["tokens"],
                               pack_sequences=BLOCK, eos_id=2, pad_id=0, blocks_per_epoch=BLOCKS),
            lambda b: len(b["input_ids"]))
        out["throughput_ratio"] = round(out["sidecar"]["rows_per_s"] / out["inprocess"]["rows_per_s"], 2)
        out["trainer_cpu_ratio"] = round(
            out["inprocess"]["trainer_cpu_s_per_1000"] / max(out["sidecar"]["trainer_cpu_s_per_1000"], 1e-9), 2)
        return out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps({"image": bench_image(), "packing": bench_packing()}, indent=2))
