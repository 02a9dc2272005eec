"""`make bench`: transport and end-to-end throughput, as ratios against baselines
measured in the same run (these machines are noisy). Writes bench/results.json.
Exits non-zero only when something broke (an exception, a child that failed, batches
or bytes missing); every goal is printed as met or missed, none fails the run.

transport: sidecar -> trainer hand-off of batches already in memory, the
trainer touching every byte once (tests/bench/memory_sidecar.py), at 1, 8 and
64 MiB, TRANSPORT_RUNS runs alternating with as many runs of the bare
cross-process floor (tests/bench/floor.py: the same copy and touch with no
control path at all), so that both see the same load. The goal here (#23): the
transport's best run at least FLOOR_GOAL x the floor's best run. Each run is
also timed between two memcpy measurements of the same batches (one thread
copying into as many slots as the ring has); the worst run against the better
of its two, issue #9's MEMCPY_GOAL, is printed as information: on this 2-core VM
the floor's own worst run misses it, so it is judged on a machine with a GPU
and more cores.
end_to_end: rows/s a trainer receives through a `splitfeed sidecar` process
reading a LanceDB table, against lancedb's StreamingDataLoader iterated in the
trainer's own process (the better of num_workers 0 and 2).
preprocessing: the same with a JPEG decode-and-normalise transform, and with
sequence packing (tests/bench/preprocessing.py, which says what its CPU figures
count); reported, not a pass/fail goal.
tables: start-up, sidecar memory and rows/s on 1M-50M-row tables beside lancedb
in-process (tests/bench/tables.py); object_store: the same reads through an S3
endpoint with latency (tests/bench/object_store.py); rescale: what a rescale costs,
recreated and in place (tests/bench/rescale.py); coordinator: a drain agreed by 64 to 1,024
members and the coordinator's cost at rest (tests/bench/coordinator.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from splitfeed.trainer_client.script.client import StreamClient
from tests.bench.floor import floor_gbps

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
PREFETCH = 4
TRANSPORT_RUNS = 5
TRANSPORT_SIZES = ((1, 1500), (8, 250), (64, 40))
"""(MiB a batch, batches a run)."""
FLOOR_GOAL = 0.8
"""The transport's goal here (#23): its best run at least this much of the bare floor's best run,
both of the same size in the same bench."""
MEMCPY_GOAL = 0.5
"""The worst of TRANSPORT_RUNS against a memcpy around it (#9): judged on a machine with a GPU and
more cores; on a 2-core VM the bare floor's own worst run misses it, so it is printed, not judged."""
WARMUP = PREFETCH + 2
"""Batches before the clock starts: by then every slot the ring uses has been written once."""


class Broken(RuntimeError):
    """The bench did not measure what it says: a child failed, or batches or bytes went missing."""


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
    """One run: `count` batches of `size` bytes through tests/bench/memory_sidecar.py, each touched."""
    directory = Path(tempfile.mkdtemp(prefix="sf-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    proc = subprocess.Popen([sys.executable, "-m", "tests.bench.memory_sidecar", str(directory),
                             str(size), str(count), str(PREFETCH)], cwd=ROOT)
    try:
        with StreamClient(directory, 0, as_tensors=False, timeout_s=60) as client:
            it = iter(client)
            for _ in range(WARMUP):  # start-up and each slot's first use, as memcpy_gbps's slots
                column = next(it)["x"]
                if column.nbytes != size:
                    raise Broken(f"a batch of {column.nbytes} bytes, not {size}")
                touch(column)
                del column
            start = time.perf_counter()
            received = 0
            for batch in it:
                touch(batch["x"])
                received += 1
            elapsed = time.perf_counter() - start
        if proc.wait(30) != 0:
            raise Broken(f"the bench's sidecar exited with {proc.returncode}")
        if received != count - WARMUP:
            raise Broken(f"{received} batches after the warm-up, not {count - WARMUP}")
        return received * size / elapsed / 1e9
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


def _series(size: int, count: int, runs: int = TRANSPORT_RUNS) -> dict[str, list[float]]:
    """TRANSPORT_RUNS transport runs and as many floor runs, alternated so that both see the
    same load (it changes within seconds here), each between two memcpy measurements."""
    series: dict[str, list[float]] = {"runs": [], "floors": [], "run_memcpy": [], "floor_memcpy": [], "loads": []}
    before = memcpy_gbps(size, count)
    for _ in range(runs):
        series["loads"].append(os.getloadavg()[0])
        for runs, baselines, measure in (("runs", "run_memcpy", transport_gbps),
                                         ("floors", "floor_memcpy", floor_gbps)):
            series[runs].append(measure(size, count))
            after = memcpy_gbps(size, count)
            series[baselines].append(max(before, after))
            before = after
    return series


def transport_row(size: int, series: dict[str, list[float]]) -> dict:
    """One size's figures: the goal against the floor, the worst run against memcpy beside it."""
    runs, floors = series["runs"], series["floors"]
    ratios = [r / b for r, b in zip(runs, series["run_memcpy"])]
    floor_ratios = [f / b for f, b in zip(floors, series["floor_memcpy"])]
    best, worst, floor = max(runs), min(runs), max(floors)
    base = max(series["run_memcpy"])
    return {"batch_bytes": size, "runs_gbps": [round(r, 3) for r in runs],
            "run_memcpy_gbps": [round(b, 3) for b in series["run_memcpy"]],
            "run_ratios": [round(r, 3) for r in ratios], "run_load_average": series["loads"],
            "gbps": round(best, 3), "worst_gbps": round(worst, 3),
            # the goal here: best run against the best run of the bare floor
            "cross_process_floor_gbps": round(floor, 3), "floor_runs_gbps": [round(f, 3) for f in floors],
            "vs_floor": round(best / floor, 3), "goal_met": best / floor >= FLOOR_GOAL,
            # judged on a GPU machine with more cores, reported here
            "memcpy_gbps": round(base, 3), "ratio": round(max(ratios), 3), "worst_ratio": round(min(ratios), 3),
            "worst_vs_best_memcpy": round(worst / base, 3), "memcpy_goal_met": min(ratios) >= MEMCPY_GOAL,
            "floor_ratio": round(max(floor_ratios), 3), "floor_worst_ratio": round(min(floor_ratios), 3)}


def bench_transport(sizes: tuple[tuple[int, int], ...] = TRANSPORT_SIZES, runs: int = TRANSPORT_RUNS) -> list[dict]:
    results = []
    for mib, count in sizes:
        series = _series(mib * MiB, count, runs)
        row = transport_row(mib * MiB, series)
        results.append(row)
        loads = series["loads"]
        print(f"  transport {mib:>3} MiB: runs {' '.join(f'{r:.2f}' for r in series['runs'])} GB/s, bare floor "
              f"{' '.join(f'{f:.2f}' for f in series['floors'])} GB/s -> best/best {row['vs_floor']:.2f}; "
              f"vs memcpy around each run best {row['ratio']:.2f}, worst {row['worst_ratio']:.2f} "
              f"(floor {row['floor_ratio']:.2f}/{row['floor_worst_ratio']:.2f}); "
              f"load {min(loads):.1f}-{max(loads):.1f}", flush=True)
    return results


def transport_verdicts(rows: list[dict]) -> list[str]:
    """The goal against the floor, met or missed; the worst run against memcpy as information."""
    lines = []
    for row in rows:
        name = f"transport {row['batch_bytes'] // MiB} MiB"
        lines.append(f"{name}: best run {row['gbps']:.2f} GB/s = {row['vs_floor']:.2f} x the bare floor's best "
                     f"{row['cross_process_floor_gbps']:.2f} GB/s >= {FLOOR_GOAL}: "
                     f"{'met' if row['goal_met'] else 'MISSED'}")
    for row in rows:
        lines.append(f"transport {row['batch_bytes'] // MiB} MiB: worst of {TRANSPORT_RUNS} runs "
                     f"{row['worst_ratio']:.2f} x memcpy around it >= {MEMCPY_GOAL}: judged on a machine with a "
                     f"GPU and more cores, not here (the floor's own worst: {row['floor_worst_ratio']:.2f})")
    return lines


E2E_ROWS = 200_000
E2E_SPLITS = 16
E2E_BATCH = 1024
E2E_GOAL = 5
"""Rows/s through the sidecar against lancedb's loader in the trainer's own process."""
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


def bare_loop(client: StreamClient) -> Iterator[int]:
    """The README's loop, doing nothing with its batches: the rows of each."""
    for batch in client:
        yield len(batch["id"])


def sidecar_env(workdir: Path, **extra: str) -> tuple[Path, dict[str, str]]:
    """A fresh socket directory (in /dev/shm where there is one) and the environment of a lone
    sidecar serving rank 0 of 1 from it, with a keypair of its own under `workdir`, as a pod's."""
    from splitfeed.trainer_client.contract import wellknown
    from splitfeed.trainer_client.transport import keys

    sockets = Path(tempfile.mkdtemp(prefix="sf-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    if not (workdir / "keys").exists():
        keys.create(workdir / "keys")
    return sockets, {**os.environ, wellknown.SOCKET_DIR_ENV: str(sockets), wellknown.RANK: "0",
                     wellknown.WORLD_SIZE: "1", wellknown.RESUME_ENV: "none",
                     wellknown.KEYS_DIR_ENV: str(workdir / "keys"), **extra}


def sidecar_rows_per_s(uri: str, workdir: Path, loop: Callable[[StreamClient], Iterator[int]] = bare_loop,
                       epochs: int = 1) -> float:
    """Rows/s that `loop` takes from one sidecar over `epochs` epochs of the bench table, its
    first batch excluded."""
    from splitfeed.trainer_client.contract import specs

    job = specs.parse_job({
        "apiVersion": specs.API_VERSION, "kind": specs.KIND, "metadata": {"name": "bench"},
        "spec": {"data": {"uri": uri, "table": "bench", "numSplits": E2E_SPLITS,
                          "globalBatchSize": E2E_BATCH, "columns": ["id", "label", "vector"],
                          "readBatchSize": 1024, "epochs": epochs}}})
    config = workdir / "config.json"
    config.write_text(json.dumps(job.data_config()))
    sockets, env = sidecar_env(workdir)
    proc = subprocess.Popen([sys.executable, "-m", "splitfeed.trainer_client.cli", "sidecar",
                             "--config", str(config)], env=env, cwd=ROOT)
    try:
        with StreamClient(sockets, 0, timeout_s=120) as client:
            it = loop(client)
            next(it)
            start = time.perf_counter()
            got = sum(it)
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


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much of each bench a run does: FULL for `make bench`, QUICK (`--quick`) for the smoke
    run CI does (tests/bench/test_quick.py), whose figures say nothing but that it all runs."""

    transport: tuple[tuple[int, int], ...]
    transport_runs: int
    adapter_runs: int
    prep_repeats: int
    table_rows: list[int]
    payload_rows: int
    table_steps: int
    epoch_starts: bool
    store_seconds: float
    store_latencies: list[float]
    rescale_repeats: int
    rescale_modes: tuple[str, ...]
    members: list[int]
    coordinator_repeats: int


FULL = Plan(TRANSPORT_SIZES, TRANSPORT_RUNS, 5, 3, [1_000_000, 20_000_000, 50_000_000], 16_384, 300, True,
            8.0, [0.0, 0.01, 0.05], 3, ("recreate", "agent", "in-process"), [64, 256, 1024], 3)
QUICK = Plan(((1, 60),), 1, 1, 1, [100_000], 0, 40, False, 2.0, [0.0], 1, ("in-process",), [64], 1)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.bench.run")
    parser.add_argument("--quick", action="store_true", help="a smoke run of every bench at a small size")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results.json")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    began = time.monotonic()

    def section(title: str) -> None:  # a long run shows where it is
        print(f"[{time.monotonic() - began:.0f} s, load {os.getloadavg()[0]:.1f}] {title}", flush=True)

    section("transport (sidecar -> trainer, batches in memory):")
    transport = bench_transport(plan.transport, plan.transport_runs)
    section("end to end (LanceDB -> trainer):")
    end_to_end = bench_end_to_end()
    section("framework adapters (rows/s against the bare StreamClient loop, same sidecar and table):")
    from tests.bench import adapters, preprocessing

    adapted = adapters.bench(plan.adapter_runs)
    adapted["verdicts"] = adapters.verdicts(adapted)
    section("preprocessing (image decode; sequence packing):")

    prep = {"image": preprocessing.bench_image(plan.prep_repeats),
            "packing": preprocessing.bench_packing(plan.prep_repeats)}
    section("real tables (launch to first batch, sidecar memory, rows/s as tables grow):")
    from tests.bench import object_store, tables

    big = tables.bench(plan.table_rows, plan.payload_rows, 150.0, plan.table_steps)
    if plan.epoch_starts:
        big["epoch_starts"] = tables.bench_epoch_starts()
    big["verdicts"] = tables.verdicts(big)
    section("object storage (an S3 endpoint with 0, 10 and 50 ms a request):")
    store = object_store.bench(plan.store_seconds, plan.store_latencies, quick=args.quick)
    store["verdicts"] = object_store.verdicts(store)
    section("rescale (request to the new world's first batch: recreate, in place by agent, in process):")
    from tests.bench import rescale

    rescales = rescale.bench(plan.rescale_repeats, plan.rescale_modes)
    rescales["verdicts"] = rescale.verdicts(rescales)
    section("coordinator at scale (a drain agreed by 64, 256 and 1,024 members; the world at rest):")
    from tests.bench import coordinator

    coordinated = coordinator.bench(plan.members, plan.coordinator_repeats)
    coordinated["summary"] = coordinator.summary(coordinated)
    coordinated["verdicts"] = coordinator.verdicts(coordinated)
    results = {"transport": transport, "end_to_end": end_to_end, "adapters": adapted, "preprocessing": prep,
               "tables": big, "object_store": store, "rescale": rescales, "coordinator": coordinated,
               "machine": {"cpus": os.cpu_count(), "load_average": round(os.getloadavg()[0], 2)}}
    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\n{'benchmark':<22}{'best':>14}{'worst':>14}{'floor best':>14}{'best/floor':>12}{'goal':>7}"
          f"{'memcpy':>14}{'vs memcpy':>11}")
    for row in transport:
        print(f"{'transport ' + str(row['batch_bytes'] // MiB) + ' MiB':<22}{row['gbps']:>10.2f} GB/s"
              f"{row['worst_gbps']:>10.2f} GB/s{row['cross_process_floor_gbps']:>10.2f} GB/s"
              f"{row['vs_floor']:>12.2f}{'>=' + str(FLOOR_GOAL):>7}{row['memcpy_gbps']:>9.2f} GB/s"
              f"{row['ratio']:>6.2f}/{row['worst_ratio']:.2f}")
    e = end_to_end
    print(f"{'end to end':<22}{e['rows_per_s']:>9,} rows/s{'':>14}{e['inprocess_rows_per_s']:>7,} rows/s"
          f"{e['ratio']:>12.2f}{'>=' + str(E2E_GOAL):>7}")
    for case in ("image", "packing"):
        p = prep[case]
        print(f"{case + ' preprocessing':<22}rows/s {p['throughput_ratio']:.2f} x in-process "
              f"(worst {p['worst_throughput_ratio']:.2f}), trainer CPU per row {p['trainer_cpu_ratio']:.2f} x "
              f"lower (worst {p['worst_trainer_cpu_ratio']:.2f}; {p['trainer_pod_cpu_ratio']:.2f} x with "
              "in-process workers counted)")
    e2e = [f"end to end rows/s = {e['ratio']:.2f} x in-process >= {E2E_GOAL}: "
           f"{'met' if e['ratio'] >= E2E_GOAL else 'MISSED'}"]
    for line in (transport_verdicts(transport) + e2e + adapted["verdicts"] + big["verdicts"] + store["verdicts"]
                 + rescales["verdicts"] + coordinated["verdicts"]):
        print(f"goal: {line}")
    print(f"checkpoint write (record + commit) at 50 ms a request: {store['checkpoint_write_s_at_50ms']} s")
    print(f"\nwritten to {out}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0  # a missed goal is printed above; only something broken (an exception) fails the run


if __name__ == "__main__":
    sys.exit(main())
