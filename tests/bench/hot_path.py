"""Python per batch on each side of the ring, in one process and with no waits: what is left
beside the copy and the touch (docs/testing.md, "Transport speed").

    python -m tests.bench.hot_path [BATCH_BYTES] [BATCHES] [ROUNDS]

A real Publisher writes each batch into its ring and a real Receiver takes it, one
thread doing both in turn, so neither ever waits and the clock sees only each side's
own work: the sidecar's loop body (room, gate, IPC write, post, the trainer's flag),
and the trainer's `next()` as StreamClient makes it (releases, the take, the stats)
with the batch of the step before dropped as a loop over batches drops it. The copy is
the IPC write's: at 1 KiB it is ~nothing. Prints the median and best of ROUNDS per
side, in microseconds per batch, and the load average. Not a pass/fail goal.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa

from splitfeed.sidecar.serving.publishing import Publisher
from splitfeed.trainer_client.script import client, counters, taking
from splitfeed.trainer_client.transport import ring
from splitfeed.trainer_client.script.receiving import Receiver

PREFETCH = 4


def _trainer(directory: Path, instance: str) -> tuple[Any, Receiver, counters.Stats]:
    control = ring.Control(ring.control_path(directory, instance, 0), create=False)
    session = SimpleNamespace(control=control, next_step=0, instance=instance, steps_per_epoch=10**9)
    taker = taking.Taker(directory, 0, as_tensors=False)
    receiver = Receiver(session, SimpleNamespace(), taker, client.pace(), timeout_s=60.0,  # type: ignore[arg-type]
                        heartbeat_s=5.0, on_welcome=lambda _: None, before_wait=lambda: None)
    stats = counters.Stats(None)
    stats.attach(control)
    return session, receiver, stats


def one_round(size: int, count: int) -> tuple[float, float]:
    """(sidecar, trainer) microseconds per batch over `count` batches after a warm-up."""
    directory = Path(tempfile.mkdtemp(prefix="sf-hot-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    payload = pa.record_batch({"x": pa.array(np.zeros(max(1, size // 8), np.int64))})
    warmup = PREFETCH + 2
    total = warmup + count
    publisher = Publisher(directory=directory, instance="hot", local_rank=0, rank=0,
                          factory=lambda rank, first: iter(()), prefetch=PREFETCH, start_step=0,
                          total_steps=total + 1)
    session, receiver, stats = _trainer(directory, "hot")
    clock = {"sidecar": 0.0, "trainer": 0.0}

    def trainer_next() -> taking.Batch:
        receiver.flush_releases()  # StreamClient.__next__'s work, less what is a no-op here
        started = time.perf_counter()
        batch = receiver.next_batch()
        assert batch is not None
        stats.record(batch, time.perf_counter() - started)
        return batch

    def source() -> Any:
        batch: Any = None
        left = time.perf_counter()
        for step in range(total):
            back = time.perf_counter()
            if step > warmup:
                clock["sidecar"] += back - left
            if step:
                batch = trainer_next()  # the batch before is dropped here, as a loop drops it
            if step > warmup:
                clock["trainer"] += time.perf_counter() - back
            left = time.perf_counter()
            yield step, payload
        del batch

    try:
        publisher._publish_each(source(), 0, threading.Event())
        timed = count - 1
        return clock["sidecar"] / timed * 1e6, clock["trainer"] / timed * 1e6
    finally:
        publisher.close()
        session.control.close()
        shutil.rmtree(directory, ignore_errors=True)


def main() -> int:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
    sidecar, trainer = zip(*(one_round(size, count) for _ in range(rounds)))
    print(f"{size} B x {count}, {rounds} rounds, load {os.getloadavg()[0]:.1f}: per batch "
          f"sidecar median {statistics.median(sidecar):.1f} best {min(sidecar):.1f} us, "
          f"trainer median {statistics.median(trainer):.1f} best {min(trainer):.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
