"""The fastest cross-process hand-off this machine allows: no control path at all.

A writer process copies each batch into one of N shared slots and bumps a
counter; the reader (this process) spins on the counter and touches every
byte. No messages, no Arrow, no Python per-batch bookkeeping beyond a counter:
what is left is the copy plus moving freshly written cache lines to the other
core. `make bench`'s transport goal is against it: the transport's best run at
least 0.8x the floor's best run (tests/bench/run.py, FLOOR_GOAL).
"""

from __future__ import annotations

import multiprocessing
import os
import multiprocessing.shared_memory as shm
import time

import numpy as np


def _writer(name: str, size: int, slots: int, count: int) -> None:
    block = shm.SharedMemory(name=name)
    try:
        counters = np.ndarray((2,), np.int64, buffer=block.buf, offset=0)
        data = np.ndarray((slots, size), np.uint8, buffer=block.buf, offset=64)
        source = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
        for i in range(count):
            while counters[1] < i - slots + 1:  # wait for the reader to free slot i % slots
                os.sched_yield()
            np.copyto(data[i % slots], source)
            counters[0] = i + 1
        del counters, data
    finally:
        block.close()


def floor_gbps(size: int, count: int, slots: int = 4) -> float:
    block = shm.SharedMemory(create=True, size=64 + slots * size)
    try:
        counters = np.ndarray((2,), np.int64, buffer=block.buf, offset=0)
        counters[:] = 0
        data = np.ndarray((slots, size), np.uint8, buffer=block.buf, offset=64)
        writer = multiprocessing.get_context("spawn").Process(
            target=_writer, args=(block.name, size, slots, count))
        writer.start()
        start = None
        warmup = slots + 1  # as the transport's WARMUP: every slot's pages written once before the clock
        for i in range(count):
            spins = 0
            while counters[0] <= i:
                os.sched_yield()
                spins += 1
                if spins % 4096 == 0 and not writer.is_alive() and counters[0] <= i:
                    raise RuntimeError(f"the floor's writer process exited with {writer.exitcode} "
                                       f"after {int(counters[0])} of {count} batches")
            if i == warmup:
                start = time.perf_counter()
            int(data[i % slots].view(np.uint64).sum())
            counters[1] = i + 1
        elapsed = time.perf_counter() - (start or 0.0)
        writer.join()
        if writer.exitcode != 0:
            raise RuntimeError(f"the floor's writer process exited with {writer.exitcode}")
        return (count - warmup) * size / elapsed / 1e9
    finally:
        counters = data = None  # numpy views pin the block's buffer
        block.close()
        block.unlink()
