"""Object storage: rows/s, data stall and requests through an S3 endpoint with real latency (issue 20).

    python -m tests.bench.object_store [--seconds 8] [--latencies 0,0.01,0.05] [--quick]

The table is written locally and served as s3://bench/db by tests/support/s3_endpoint.py
in a process of its own (its own GIL), with a per-request latency of 0, 10 and 50 ms.
For a 512 B and a 64 KiB payload, rows shuffled one by one and in clumps of 64:
- the sidecar: a `splitfeed sidecar` process reading through `s3://` with storage options
  as a user gives them, its batches taken by a StreamClient here (rows/s after the first
  batch, the client's data-stall share);
- lancedb in-process: StreamingDataset iterated here over the same endpoint;
each with the requests per 1,000 rows the endpoint counted. The bench's trainer does no
work, so its data-stall share is near 100% whenever the store, not the trainer, sets the
pace: it says which side a run is waiting on, not how a model would fare. Goal (issue 20): at 10 and
50 ms, sidecar rows/s >= 0.7 x min(Q x r / L, the sidecar's rows/s at 0 ms), Q = 32 takes
in flight, r = rows per request as counted; and >= 5 x lancedb in-process. The drain's
checkpoint write is timed at 50 ms too, and (shown, not judged) the 512 B table's
shuffled reads with the epoch plans in the store beside the checkpoints, as a job with
spec.checkpoint.uri keeps them: its epochs last half a second, so each plan is built,
put and loaded through the latency twice a second.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from tests.bench import run

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "bench"
Q = 32
SPLITS, BATCH = 24, 480

SERVER = """
import json, sys
from tests.support.s3_endpoint import S3Endpoint
with S3Endpoint(sys.argv[1]) as endpoint:
    print(json.dumps({"url": endpoint.url, "options": endpoint.storage_options()}), flush=True)
    for line in sys.stdin:
        word, _, arg = line.strip().partition(" ")
        if word == "latency":
            endpoint.latency_s = float(arg)
        elif word == "reset":
            endpoint.reset_counters()
        print(json.dumps({"requests": sum(endpoint.requests.values()), "bytes": endpoint.bytes_sent,
                          "max_in_flight": endpoint.max_in_flight, "by_method": dict(endpoint.requests),
                          "statuses": {str(k): v for k, v in endpoint.statuses.items()}}), flush=True)
"""


class Endpoint:
    """The endpoint's process, told what to do one line at a time."""

    def __init__(self, root: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(root)], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        hello = json.loads(self.proc.stdout.readline())
        self.options: dict[str, str] = hello["options"]

    def say(self, line: str) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def write_table(path: str, rows: int, payload: int) -> None:
    import lancedb

    rng = np.random.default_rng(0)
    schema = pa.schema([("id", pa.int64()), ("payload", pa.binary())])
    chunk = max(1, (32 << 20) // payload)

    def batches():  # type: ignore[no-untyped-def]
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            blob = rng.bytes(payload * n)
            values = pa.array([blob[i * payload:(i + 1) * payload] for i in range(n)], pa.binary())
            yield pa.record_batch([pa.array(np.arange(start, start + n, dtype=np.int64)), values], schema=schema)

    lancedb.connect(path).create_table("t", pa.RecordBatchReader.from_batches(schema, batches()),
                                       mode="overwrite")


def spec(options: dict[str, str], clump: int) -> dict:
    endpoint = {k: v for k, v in options.items() if not k.startswith("aws_access") and "secret" not in k}
    return {"uri": f"s3://{BUCKET}/db", "table": "t", "numSplits": SPLITS, "globalBatchSize": BATCH,
            "shuffleClumpSize": clump, "storageOptions": endpoint, "readBatchSize": 64, "epochs": EPOCHS}


EPOCHS = 1000
"""More than a run reads in --seconds: every figure is of reads in the steady state."""


def sidecar_run(work: Path, endpoint: Endpoint, clump: int, seconds: float, *, store: str | None = None) -> dict:
    """A `splitfeed sidecar` through the endpoint: rows/s after the first batch, stall, requests.
    With `store` (spec.checkpoint.uri on the same endpoint) its epoch plans live there, as a
    job's do, instead of in the sidecar's own directory."""
    from splitfeed.trainer_client.contract import specs
    from splitfeed.trainer_client.script.client import StreamClient

    body: dict = {"data": spec(endpoint.options, clump)}
    if store:
        body["checkpoint"] = {"uri": store}
    job = specs.parse_job({"apiVersion": specs.API_VERSION, "kind": specs.KIND, "metadata": {"name": "bench"},
                           "spec": body})
    config = work / "config.json"
    config.write_text(json.dumps(job.data_config()))
    creds = work / "creds"
    creds.mkdir(exist_ok=True)
    for key in ("aws_access_key_id", "aws_secret_access_key"):
        (creds / key).write_text(endpoint.options[key])
    sockets, env = run.sidecar_env(work, SPLITFEED_JOB_UID=f"bench-{time.time_ns()}")
    proc = subprocess.Popen([sys.executable, "-m", "splitfeed.trainer_client.cli", "sidecar", "--config",
                             str(config), "--storage-options-dir", str(creds)], env=env, cwd=ROOT,
                            stderr=subprocess.DEVNULL)
    try:
        with StreamClient(sockets, 0, timeout_s=300, as_tensors=False) as client:
            batches = iter(client)
            next(batches)
            endpoint.say("reset")
            rows, started = 0, time.perf_counter()
            for batch in batches:
                rows += len(batch["id"])
                if time.perf_counter() - started > seconds:
                    break
            elapsed = time.perf_counter() - started
            counted = endpoint.say("counters")
            stall = client.stats.stall.stall_share
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(sockets, ignore_errors=True)
    return {"rows_per_s": round(rows / elapsed), "stall": round(stall, 3),
            "requests_per_1000_rows": round(1000 * counted["requests"] / max(1, rows), 1),
            "rows_per_request": round(rows / max(1, counted["requests"]), 2),
            "max_in_flight": counted["max_in_flight"]}


def lancedb_run(endpoint: Endpoint, clump: int, seconds: float) -> dict:
    """lancedb's StreamingDataset in this process over the same endpoint (rank 0 of 1)."""
    import lancedb
    from lancedb.streaming import StreamingDataset

    table = lancedb.connect(f"s3://{BUCKET}/db", storage_options=endpoint.options).open_table("t")

    def epochs():  # type: ignore[no-untyped-def]
        for epoch in range(EPOCHS):  # a new dataset per epoch, as a training loop makes them
            yield from StreamingDataset(table, num_splits=SPLITS, shuffle=True, shuffle_seed=0, rank=0,
                                        world_size=1, shuffle_clump_size=clump or None, read_batch_size=64,
                                        epoch=epoch)

    rows_iter = epochs()
    next(rows_iter)
    endpoint.say("reset")
    rows, started = 0, time.perf_counter()
    for _ in rows_iter:
        rows += 1
        if rows % 64 == 0 and time.perf_counter() - started > seconds:
            break
    elapsed = time.perf_counter() - started
    counted = endpoint.say("counters")
    rows_iter.close()
    return {"rows_per_s": round(rows / elapsed),
            "requests_per_1000_rows": round(1000 * counted["requests"] / max(1, rows), 1)}


def checkpoint_write(endpoint: Endpoint) -> float:
    """Seconds for one rank's drain checkpoint (record, then commit marker) through the store."""
    from splitfeed.sidecar.world import checkpoints
    from splitfeed.sidecar.data import positions
    from splitfeed.trainer_client.contract import specs

    data = specs.DataSpec(uri="x", table="t", num_splits=SPLITS, global_batch_size=BATCH)
    store = checkpoints.Store(f"s3://{BUCKET}/ckpt", "bench", "job", endpoint.options, uid="u",
                              provenance=checkpoints.provenance(data, table_version=1, job_uid="u",
                                                                world_epoch=0))
    state = positions.state_dict(data, positions.Position(0, 7))
    started = time.perf_counter()
    store.write(global_step=7, rank=0, world_size=1, state=state)
    store.commit(global_step=7, rank=0, world_size=1)
    return time.perf_counter() - started


def bench(seconds: float, latencies: list[float], quick: bool) -> dict:
    cases = [(512, 48_000 if quick else 96_000), (64 * 1024, 1_536 if quick else 3_072)]
    results: dict = {"cases": [], "q": Q}
    for payload, rows in cases:
        work = Path(tempfile.mkdtemp(prefix="sf-bench-s3-"))
        try:
            write_table(str(work / "root" / BUCKET / "db"), rows, payload)
            endpoint = Endpoint(work / "root")
            try:
                for clump in (0, 64):
                    case: dict = {"payload": payload, "rows": rows, "clump": clump, "latencies": {}}
                    for latency in latencies:
                        endpoint.say(f"latency {latency}")
                        ours = sidecar_run(work, endpoint, clump, seconds)
                        base = lancedb_run(endpoint, clump, seconds)
                        case["latencies"][str(latency)] = {"sidecar": ours, "lancedb": base}
                        print(f"  {payload} B x {rows:,}, clump {clump}, {latency * 1000:.0f} ms: sidecar "
                              f"{ours['rows_per_s']:,} rows/s (stall {ours['stall']:.0%}, "
                              f"{ours['requests_per_1000_rows']} req/1000 rows, {ours['max_in_flight']} in "
                              f"flight), lancedb {base['rows_per_s']:,} rows/s "
                              f"({base['requests_per_1000_rows']} req/1000 rows)", flush=True)
                    results["cases"].append(case)
                endpoint.say("latency 0.05")
                if payload == 512:  # short epochs (0.5 s): a plan built and read every half second
                    stored = sidecar_run(work, endpoint, 0, seconds, store=f"s3://{BUCKET}/ckpt")
                    clump_0 = next(c for c in results["cases"] if (c["payload"], c["clump"]) == (payload, 0))
                    own = clump_0["latencies"].get("0.05", {}).get("sidecar", {})
                    results["plans_in_store_at_50ms"] = {"sidecar": stored, "own_plans": own}
                    print(f"  {payload} B x {rows:,}, clump 0, 50 ms, plans in the store (checkpoint.uri): "
                          f"{stored['rows_per_s']:,} rows/s against {own.get('rows_per_s', 0):,} with the "
                          "sidecar's own plans", flush=True)
                results["checkpoint_write_s_at_50ms"] = round(checkpoint_write(endpoint), 3)
            finally:
                endpoint.close()
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return results


def verdicts(results: dict) -> list[str]:
    lines = []
    for case in results["cases"]:
        zero = case["latencies"].get("0.0") or case["latencies"].get("0")
        for latency, got in case["latencies"].items():
            if float(latency) == 0 or zero is None:
                continue
            ours = got["sidecar"]
            ceiling = min(Q * ours["rows_per_request"] / float(latency), zero["sidecar"]["rows_per_s"])
            ratio = got["sidecar"]["rows_per_s"] / max(1, got["lancedb"]["rows_per_s"])
            name = f"{case['payload']} B, clump {case['clump']}, {float(latency) * 1000:.0f} ms"
            lines.append(f"{name}: {ours['rows_per_s']:,} rows/s >= 0.7 x {ceiling:,.0f}: "
                         f"{'met' if ours['rows_per_s'] >= 0.7 * ceiling else 'MISSED'}; "
                         f"{ratio:.1f} x lancedb >= 5: {'met' if ratio >= 5 else 'MISSED'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--latencies", default="0,0.01,0.05")
    parser.add_argument("--quick", action="store_true", help="smaller tables")
    args = parser.parse_args(argv)
    results = bench(args.seconds, [float(x) for x in args.latencies.split(",")], args.quick)
    results["verdicts"] = verdicts(results)
    results["machine"] = {"cpus": os.cpu_count(), "load_average": round(os.getloadavg()[0], 2)}
    for line in results["verdicts"]:
        print(f"  {line}")
    print(f"  checkpoint write (record + commit) at 50 ms: {results['checkpoint_write_s_at_50ms']} s")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
