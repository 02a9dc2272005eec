"""CPU per batch on both sides of the transport: what `make bench`'s wall-clock ratios cannot show
on a shared machine (docs/testing.md, "Transport speed").

    python -m tests.bench.transport_cpu [RUNS]

For each batch size, RUNS runs of the same hand-off as `make bench`'s transport
(tests/bench/memory_sidecar.py, the trainer touching every byte), each printing
per batch: the trainer's thread CPU inside `next()` and inside the touch, the
sidecar process's CPU (all its threads, from /proc: Linux only, 10 ms ticks over
the timed window), the trainer's sleeps (`trainer_waiting` episodes) and both
processes' context switches, with the load average. Not a pass/fail goal.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from splitfeed.trainer_client.script.client import StreamClient
from tests.bench.run import MiB, PREFETCH, ROOT, WARMUP, touch


def _cpu_ns(pid: int) -> float:
    """User + system CPU of every thread of `pid`, live or exited (/proc/PID/stat's utime, stime)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1e9 / os.sysconf("SC_CLK_TCK")


def one_run(size: int, count: int) -> dict[str, float]:
    directory = Path(tempfile.mkdtemp(prefix="sf-cpu-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    proc = subprocess.Popen([sys.executable, "-m", "tests.bench.memory_sidecar", str(directory),
                             str(size), str(count), str(PREFETCH)], cwd=ROOT)
    try:
        with StreamClient(directory, 0, as_tensors=False, timeout_s=60) as client:
            it = iter(client)
            for _ in range(WARMUP):
                touch(next(it)["x"])
            waits, sidecar = client._waits, _cpu_ns(proc.pid)
            mine = resource.getrusage(resource.RUSAGE_SELF)
            started, in_next, in_touch, received = time.perf_counter(), 0.0, 0.0, 0
            while True:
                before = time.thread_time()
                try:
                    batch = next(it)
                except StopIteration:
                    break
                between = time.thread_time()
                touch(batch["x"])
                in_touch += time.thread_time() - between
                in_next += between - before
                received += 1
                if received == count - WARMUP - PREFETCH - 2:  # before the publisher may exit
                    sidecar = _cpu_ns(proc.pid) - sidecar
            elapsed = time.perf_counter() - started
            after = resource.getrusage(resource.RUSAGE_SELF)
            waits = client._waits - waits
        _, _, theirs = os.wait4(proc.pid, 0)
        proc.returncode = 0
        timed = count - WARMUP - PREFETCH - 2
        return {"gbps": received * size / elapsed / 1e9, "trainer_next_us": in_next / received * 1e6,
                "trainer_touch_us": in_touch / received * 1e6, "sidecar_us": sidecar / timed / 1e3,
                "trainer_sleeps": waits, "trainer_csw": after.ru_nvcsw - mine.ru_nvcsw,
                "sidecar_csw": theirs.ru_nvcsw}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


def main() -> int:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for mib, count in ((1, 1500), (8, 250), (64, 40)):
        for _ in range(runs):
            row = one_run(mib * MiB, count)
            print(f"{mib:>3} MiB load {os.getloadavg()[0]:4.1f}: "
                  + " ".join(f"{key} {value:.1f}" for key, value in row.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
