"""Rows of a table by row id, in the order asked, with several takes in flight.

lancedb's `take_row_ids` promises no row order, and one take waits for its
object-store requests (10-50 ms each) before the next can begin: a loader that
took one batch at a time waited for every round trip in turn. `Takes` keeps up to
`depth` takes running on a small thread pool (lancedb's sync call parks its thread
on lancedb's own event loop, so the threads overlap their I/O without holding the
GIL), sized from a byte budget once the first take shows how large a row is, and
hands results back in the order they were asked for, each row where it was asked.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
import pyarrow as pa

from splitfeed.trainer_client import errors

T = TypeVar("T")

ROW_ID = "_rowid"
MAX_IN_FLIGHT = 32
"""Takes one loader keeps running at most: each also fans out into lancedb's own
concurrent range requests (about 64), and past this a pod's network is the limit."""
TAKES_PER_CPU = 2
"""A take from local disk is CPU work (decoding the pages its rows sit in), so more
takes than CPUs only contend: on 2 CPUs, 4 in flight read a 20M-row table at 318k
rows/s in 493 MiB and 32 at 239k rows/s in 1,034 MiB. An object store's latency is
partly hidden inside one take by lancedb's own concurrent requests; takes from one wait
on the network, so they are not held to this."""
SCATTERED_ROW_BYTES = 512
"""Memory a take holds per row beyond the row itself while it decodes: a row shuffled on
its own sits in a page of its own (measured: ~15 MB for a take of 26,400 rows of 12 B
from a 4M-row table); a clump of rows shares its pages."""
TAKE_BYTES = 64 << 20
"""A take asks for at most this many bytes of rows, once the first take says how large a
row is: with 64 KiB rows, readBatchSize 1024 made 1.6 GB takes and a sidecar of 1.7 GiB."""
FIRST_DEPTH = 2
"""Takes in flight before the first result says how many bytes a row holds."""
_END: Any = object()


def take_rows(table: Any, ids: np.ndarray, columns: Sequence[str] | None) -> pa.RecordBatch:
    """The rows `ids` (unique row ids of the table's checked-out version), in that order."""
    wanted = np.sort(ids)
    query = table.take_row_ids(wanted.tolist())
    if columns:
        query = query.select(list(columns))
    got = query.with_row_id().to_arrow()
    found = got.column(ROW_ID).to_numpy()
    at = np.zeros(0, dtype=np.int64)
    if len(found) == len(ids):
        order = np.argsort(found, kind="stable")
        at = order[np.searchsorted(found, ids, sorter=order).clip(0, len(found) - 1)]
    if len(found) != len(ids) or not np.array_equal(found[at], ids):
        raise errors.SidecarFailed(
            f"lancedb returned {len(found)} rows for {len(ids)} row ids: the table's version "
            "changed under the reader, or its row ids are not stable")
    rows = got.drop_columns([ROW_ID]).take(pa.array(at))
    return rows.combine_chunks().to_batches(max_chunksize=len(ids))[0]


def depth_for(budget_bytes: int, rows_per_take: int, bytes_per_row: float, *, clump: int = 0,
              cpus: int | None = 1) -> int:
    """Takes in flight that fit `budget_bytes` (spec.data.readAheadBytes) with what each
    holds while it decodes, at most MAX_IN_FLIGHT and, reading local files (`cpus` given),
    TAKES_PER_CPU x `cpus`; at least 1. An object store's takes wait on the network."""
    per_row = bytes_per_row + SCATTERED_ROW_BYTES / max(1, clump)
    per_take = max(1.0, rows_per_take * per_row)
    cap = MAX_IN_FLIGHT if cpus is None else min(MAX_IN_FLIGHT, TAKES_PER_CPU * max(1, cpus))
    return max(1, min(cap, int(budget_bytes // per_take)))


BARRIER = None
"""A request that says: what comes next may block (an epoch whose plan is still being
built). Takes hands back every result asked before it, then asks for more only when the
consumer asks for the next result: a plan built once a step before it is published
must never wait for reads that wait for it."""


class Takes(Generic[T]):
    """Iterate (tag, rows) over `requests` of (tag, row ids), up to `depth` takes running."""

    def __init__(self, table: Any, columns: Sequence[str] | None,
                 requests: Iterator[tuple[T, np.ndarray] | None], budget_bytes: int, *,
                 clump: int = 0, cpus: int | None = 1) -> None:
        self._table = table
        self._columns = list(columns) if columns else None
        self._requests = requests
        self._budget = budget_bytes
        self._clump = clump
        self._cpus = cpus
        self._depth = FIRST_DEPTH
        self._sized = False
        self._row_bytes: float | None = None
        self._running: collections.deque[tuple[T, int, concurrent.futures.Future[pa.RecordBatch]]] = (
            collections.deque())
        self._pool = concurrent.futures.ThreadPoolExecutor(
            depth_for(1 << 62, 1, 0.0, cpus=cpus), thread_name_prefix="splitfeed-take")
        self._exhausted = False
        self._at_barrier = False

    def _fill(self, *, cross: bool) -> None:
        while not self._exhausted and len(self._running) < self._depth:
            if self._at_barrier:
                if self._running or not cross:
                    return
                self._at_barrier = False
            request = next(self._requests, _END)
            if request is _END:
                self._exhausted = True
                return
            if request is BARRIER:
                self._at_barrier = True
                continue
            assert isinstance(request, tuple)
            tag, ids = request
            future = self._pool.submit(take_rows, self._table, ids, self._columns)
            self._running.append((tag, len(ids), future))

    def __iter__(self) -> Iterator[tuple[T, pa.RecordBatch]]:
        return self

    def steps_per_take(self, most: int, rows_per_step: int) -> int:
        """Steps the next take asks for: one until the first take says how large a row is
        (a table of 64 KiB rows must not start with a 1.6 GB take), then up to `most`."""
        if self._row_bytes is None:
            return 1
        return max(1, min(most, int(TAKE_BYTES // max(1.0, rows_per_step * self._row_bytes))))

    def __next__(self) -> tuple[T, pa.RecordBatch]:
        self._fill(cross=True)
        if not self._running:
            raise StopIteration
        tag, rows, future = self._running.popleft()
        batch = future.result()
        if not self._sized and batch.num_rows:
            self._sized = True
            self._row_bytes = batch.nbytes / batch.num_rows
            self._depth = depth_for(self._budget, min(rows, max(1, int(TAKE_BYTES // self._row_bytes))),
                                    self._row_bytes, clump=self._clump, cpus=self._cpus)
        self._fill(cross=False)
        return tag, batch

    def close(self) -> None:
        """Stop: takes not started are dropped, running ones finish in the background."""
        self._exhausted = True
        for _, _, future in self._running:
            future.cancel()
        self._running.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
