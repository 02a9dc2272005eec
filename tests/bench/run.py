"""`make bench`: transport and end-to-end throughput, as ratios against baselines
measured in the same run (these machines are noisy). Writes bench/results.json.

transport: sidecar -> trainer hand-off of batches already in memory, the
trainer touching every byte once, against one thread copying the same bytes
into as many slots as the ring has. Run TRANSPORT_RUNS times, each run between
two memcpy measurements of the same batches (so that both see the same load:
on a shared machine the load changes within seconds); a run's ratio is against
the better of its two. The worst run's ratio, not only the best, must reach
TRANSPORT_GOAL (`make bench` fails otherwise). The worst run against the best
memcpy of the whole series is reported beside it, and so is the bare
cross-process floor (tests/bench/floor.py: the same copy and touch with no
control path at all), REPEATS runs each between two memcpy measurements too:
where the floor's own worst run is below the goal, the machine, not the
transport, sets the worst run.
end_to_end: rows/s a trainer receives through a `splitfeed sidecar` process
reading a LanceDB table, against lancedb's StreamingDataLoader iterated in the
trainer's own process (the better of num_workers 0 and 2).
preprocessing: the same with a JPEG decode-and-normalise transform, and with
sequence packing (tests/bench/preprocessing.py, which says what its CPU figures
count); reported, not a pass/fail goal.
tables: start-up, sidecar memory and rows/s on 1M-50M-row tables beside lancedb
in-process (tests/bench/tables.py); object_store: the same reads through an S3
endpoint with latency (tests/bench/object_store.py); rescale: what a rescale costs,
recreated and in place (tests/bench/rescale.py). Their goals are printed as met or
missed; they do not fail the run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from splitfeed.trainer_client.client import StreamClient
from tests.bench.floor import floor_gbps

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
PREFETCH = 4
REPEATS = 3
TRANSPORT_RUNS = 5
TRANSPORT_GOAL = 0.5
WARMUP = PREFETCH + 2
"""Batches before the clock starts: by then every slot the ring uses has been written once."""


def touch(array: np.ndarray) -> int:
    return int(array.view(np.uint64).sum())


def memcpy_gbps(size: int, count: int) -> float:
    source = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    slots = [np.empty(size, np.uint8) for _ in range(PREFETCH)]
    for slot in slots:
        slot[:] = source  # fault the pages in, as the ring's slots are after their first use
    start = time.perf_counter()
    for i in range(count):
        np.copyto(slots[i % PREFETCH], source)
    return size * count / (time.perf_counter() - start) / 1e9


def transport_gbps(size: int, count: int) -> float:
    directory = Path(tempfile.mkdtemp(prefix="sf-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    proc = subprocess.Popen([sys.executable, "-m", "tests.bench.memory_sidecar", str(directory),
                             str(size), str(count), str(PREFETCH)], cwd=ROOT)
    try:
        with StreamClient(directory, 0, as_tensors=False, timeout_s=60) as client:
            it = iter(client)
            for _ in range(WARMUP):  # start-up and each slot's first use, as memcpy_gbps's slots
                touch(next(it)["x"])
            start = time.perf_counter()
            received = 0
            for batch in it:
                touch(batch["x"])
                received += 1
            elapsed = time.perf_counter() - start
        proc.wait(30)
        return received * size / elapsed / 1e9
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


def bench_transport() -> list[dict]:
    results = []
    for mib, count in ((1, 1500), (8, 250), (64, 40)):
        size = mib * MiB
        runs, baselines, loads = [], [], []
        before = memcpy_gbps(size, count)
        for _ in range(TRANSPORT_RUNS):
            loads.append(os.getloadavg()[0])
            runs.append(transport_gbps(size, count))
            after = memcpy_gbps(size, count)
            baselines.append(max(before, after))
            before = after
        ratios = [r / b for r, b in zip(runs, baselines)]
        best, worst = max(runs), min(runs)
        base = max(baselines)
        # The bare floor the same way: each run between two memcpy measurements.
        floors, floor_ratios = [], []
        for _ in range(REPEATS):
            floors.append(floor_gbps(size, count, PREFETCH))
            after = memcpy_gbps(size, count)
            floor_ratios.append(floors[-1] / max(before, after))
            before = after
        floor = max(floors)
        results.append({"batch_bytes": size, "runs_gbps": [round(r, 3) for r in runs],
                        "run_memcpy_gbps": [round(b, 3) for b in baselines],
                        "run_ratios": [round(r, 3) for r in ratios], "run_load_average": loads,
                        "gbps": round(best, 3), "worst_gbps": round(worst, 3), "memcpy_gbps": round(base, 3),
                        "ratio": round(max(ratios), 3), "worst_ratio": round(min(ratios), 3),
                        "worst_vs_best_memcpy": round(worst / base, 3),
                        "goal_met": min(ratios) >= TRANSPORT_GOAL,
                        # no control path at all: copy in one process, touch in another
                        "cross_process_floor_gbps": round(floor, 3),
                        "floor_ratio": round(max(floor_ratios), 3), "floor_worst_ratio": round(min(floor_ratios), 3)})
        print(f"  transport {mib:>3} MiB: {' '.join(f'{r:.2f}/{b:.2f}' for r, b in zip(runs, baselines))} GB/s "
              f"(transport/memcpy around it) -> ratio best {max(ratios):.2f}, worst {min(ratios):.2f}; "
              f"worst vs best memcpy {worst / base:.2f}; load {min(loads):.1f}-{max(loads):.1f} "
              f"(bare cross-process copy+touch: {floor:.2f} GB/s, ratio best {max(floor_ratios):.2f}, "
              f"worst {min(floor_ratios):.2f})", flush=True)
    return results


E2E_ROWS = 200_000
E2E_SPLITS = 16
E2E_BATCH = 1024
DIM = 256


def write_table(uri: str) -> None:
    import lancedb
    import pyarrow as pa

    rng = np.random.default_rng(0)
    db = lancedb.connect(uri)
    chunk = 50_000
    for start in range(0, E2E_ROWS, chunk):
        n = min(chunk, E2E_ROWS - start)
        batch = pa.table({
            "id": pa.array(np.arange(start, start + n), pa.int64()),
            "label": pa.array(rng.integers(0, 1000, n), pa.int32()),
            "vector": pa.FixedSizeListArray.from_arrays(
                pa.array(rng.standard_normal(n * DIM).astype(np.float32)), DIM),
        })
        if start == 0:
            db.create_table("bench", batch, mode="overwrite")
        else:
            db.open_table("bench").add(batch)


def inprocess_rows_per_s(uri: str, num_workers: int, rows: int) -> float:
    import lancedb
    from lancedb.streaming import StreamingDataLoader, StreamingDataset

    table = lancedb.connect(uri).open_table("bench")
    dataset = StreamingDataset(table, num_splits=E2E_SPLITS, shuffle=True, shuffle_seed=0,
                               columns=["id", "label", "vector"])
    # spawn: lancedb's runtime is not fork-safe (fork segfaulted a worker here).
    extra = {"multiprocessing_context": "spawn"} if num_workers else {}
    loader = StreamingDataLoader(dataset, batch_size=E2E_BATCH, num_workers=num_workers, **extra)
    it = iter(loader)
    next(it)  # start-up excluded
    start = time.perf_counter()
    got = 0
    for batch in it:
        got += len(batch["id"])
        if got >= rows:
            break
    elapsed = time.perf_counter() - start
    del it
    return got / elapsed


def sidecar_rows_per_s(uri: str, workdir: Path) -> float:
    from splitfeed.trainer_client import specs

    job = specs.parse_job({
        "apiVersion": specs.API_VERSION, "kind": specs.KIND, "metadata": {"name": "bench"},
        "spec": {"data": {"uri": uri, "table": "bench", "numSplits": E2E_SPLITS,
                          "globalBatchSize": E2E_BATCH, "columns": ["id", "label", "vector"],
                          "readBatchSize": 1024}}})
    config = workdir / "config.json"
    config.write_text(json.dumps(job.data_config()))
    sockets = Path(tempfile.mkdtemp(prefix="sf-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    env = {**os.environ, "SPLITFEED_SOCKET_DIR": str(sockets), "RANK": "0", "WORLD_SIZE": "1",
           "SPLITFEED_RESUME": "none"}
    proc = subprocess.Popen([sys.executable, "-m", "splitfeed.trainer_client.cli", "sidecar",
                             "--config", str(config)], env=env, cwd=ROOT)
    try:
        with StreamClient(sockets, 0, timeout_s=120) as client:
            it = iter(client)
            next(it)
            start = time.perf_counter()
            got = 0
            for batch in it:
                got += len(batch["id"])
            elapsed = time.perf_counter() - start
        proc.wait(30)
        return got / elapsed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(sockets, ignore_errors=True)


def bench_end_to_end() -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="sf-bench-e2e-"))
    try:
        uri = str(workdir / "db")
        print(f"  writing a {E2E_ROWS}-row table (int64 id, int32 label, {DIM}-float vector)", flush=True)
        write_table(uri)
        ours = max(sidecar_rows_per_s(uri, workdir) for _ in range(2))
        print(f"  through the sidecar: {ours:,.0f} rows/s", flush=True)
        baselines = {}
        for workers in (0, 2):
            baselines[workers] = inprocess_rows_per_s(uri, workers, rows=30_000)
            print(f"  StreamingDataLoader in-process, num_workers={workers}: {baselines[workers]:,.0f} rows/s",
                  flush=True)
        base = max(baselines.values())
        return {"rows_per_s": round(ours), "inprocess_rows_per_s": round(base),
                "ratio": round(ours / base, 2)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    print("transport (sidecar -> trainer, batches in memory):", flush=True)
    transport = bench_transport()
    print("end to end (LanceDB -> trainer):", flush=True)
    end_to_end = bench_end_to_end()
    print("preprocessing (image decode; sequence packing):", flush=True)
    from tests.bench import preprocessing

    prep = {"image": preprocessing.bench_image(), "packing": preprocessing.bench_packing()}
    print("real tables (launch to first batch, sidecar memory, rows/s as tables grow):", flush=True)
    from tests.bench import object_store, tables

    big = tables.bench([1_000_000, 20_000_000, 50_000_000], 16_384, 150.0, 300)
    big["epoch_starts"] = tables.bench_epoch_starts()
    big["verdicts"] = tables.verdicts(big)
    print("object storage (an S3 endpoint with 0, 10 and 50 ms a request):", flush=True)
    store = object_store.bench(8.0, [0.0, 0.01, 0.05], quick=False)
    store["verdicts"] = object_store.verdicts(store)
    print("rescale (request to the new world's first batch: recreate, in place by agent, in process):",
          flush=True)
    from tests.bench import rescale

    rescales = rescale.bench(3)
    rescales["verdicts"] = rescale.verdicts(rescales)
    results = {"transport": transport, "end_to_end": end_to_end, "preprocessing": prep,
               "tables": big, "object_store": store, "rescale": rescales,
               "machine": {"cpus": os.cpu_count(), "load_average": round(os.getloadavg()[0], 2)}}
    out = ROOT / "bench" / "results.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\n{'benchmark':<22}{'best':>14}{'worst':>14}{'baseline':>14}{'ratio':>13}{'goal':>8}"
          f"{'bare x-proc':>14}{'its ratio':>11}")
    for row in transport:
        ratios = f"{row['ratio']:.2f}/{row['worst_ratio']:.2f}"
        print(f"{'transport ' + str(row['batch_bytes'] // MiB) + ' MiB':<22}{row['gbps']:>10.2f} GB/s"
              f"{row['worst_gbps']:>10.2f} GB/s{row['memcpy_gbps']:>10.2f} GB/s{ratios:>13}"
              f"{'>=' + str(TRANSPORT_GOAL):>8}{row['cross_process_floor_gbps']:>9.2f} GB/s"
              f"{row['floor_ratio']:>6.2f}/{row['floor_worst_ratio']:.2f}")
    e = end_to_end
    print(f"{'end to end':<22}{e['rows_per_s']:>9,} rows/s{'':>14}{e['inprocess_rows_per_s']:>7,} rows/s"
          f"{e['ratio']:>13.2f}{'>=5':>8}")
    for case in ("image", "packing"):
        p = prep[case]
        print(f"{case + ' preprocessing':<22}rows/s {p['throughput_ratio']:.2f} x in-process "
              f"(worst {p['worst_throughput_ratio']:.2f}), trainer CPU per row {p['trainer_cpu_ratio']:.2f} x "
              f"lower (worst {p['worst_trainer_cpu_ratio']:.2f}; {p['trainer_pod_cpu_ratio']:.2f} x with "
              "in-process workers counted)")
    for line in big["verdicts"] + store["verdicts"] + rescales["verdicts"]:
        print(f"goal: {line}")
    print(f"checkpoint write (record + commit) at 50 ms a request: {store['checkpoint_write_s_at_50ms']} s")
    print(f"\nwritten to {out.relative_to(ROOT)}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    missed = [row for row in transport if not row["goal_met"]]
    for row in missed:
        print(f"transport {row['batch_bytes'] // MiB} MiB: the worst of {TRANSPORT_RUNS} runs is "
              f"{row['worst_ratio']:.2f} x memcpy, below the goal of {TRANSPORT_GOAL}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
