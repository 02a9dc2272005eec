"""Rows of a table by row id, in the order asked, with several takes in flight.

lancedb's `take_row_ids` promises no row order, and one take waits for its
object-store requests (10-50 ms each) before the next can begin: a loader that
took one batch at a time waited for every round trip in turn. `Takes` keeps
several takes running on a small thread pool (lancedb's sync call parks its thread
on lancedb's own event loop, so the threads overlap their I/O without holding the
GIL), as many as what they hold while they decode fits a byte budget once the first
take shows how large a row is, and hands results back in the order they were asked
for, each row where it was asked.
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
SCATTERED_ROW_BYTES = 900
"""Memory a take holds per row beyond the row itself while it decodes: a row shuffled on
its own sits in a page of its own (measured: a take of 26,400 rows of 12 B peaked 21-24
MiB above a warm process on a 50M-row table, 794-914 B a row; ~15 MB from a 4M-row
table, 1-12 MiB from a 1M-row one, whose rows share pages); a clump of rows shares its
pages."""
HELD_PER_BYTE = 2.5
"""A take holds this many times its rows' bytes at its peak: lance's decoded pages beside
the batch it assembles, then the reordered copy (take_rows) beside lance's batch. Measured:
one take of 960 rows of 64 KiB (60 MiB) peaked 117 MiB above a warm process's RSS, 145
above a cold one's, whether asked sorted, unsorted or by offsets, as one batch or many."""
TAKE_BYTES = 64 << 20
"""A take asks for at most this many bytes of rows, once the first take says how large a
row is: with 64 KiB rows, readBatchSize 1024 made 1.6 GB takes and a sidecar of 1.7 GiB.
The read-ahead budget may lower it further (`rows_per_take`)."""
MIN_DEPTH = 2
"""Takes of `rows_per_take` rows that fit the budget in flight beside the one consumed."""
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


def held_bytes(rows: int, bytes_per_row: float, clump: int = 0) -> float:
    """What a take of `rows` rows holds while it decodes (HELD_PER_BYTE, SCATTERED_ROW_BYTES)."""
    return rows * (bytes_per_row * HELD_PER_BYTE + SCATTERED_ROW_BYTES / max(1, clump))


def rows_per_take(budget_bytes: int, bytes_per_row: float, clump: int = 0) -> int:
    """Rows a take may ask for: TAKE_BYTES of them at most, and no more than let MIN_DEPTH
    such takes decode (`held_bytes`) beside the one being consumed within `budget_bytes`
    (spec.data.readAheadBytes). At least 1."""
    most = min(TAKE_BYTES / max(1.0, bytes_per_row),
               budget_bytes / (MIN_DEPTH * held_bytes(1, bytes_per_row, clump) + bytes_per_row))
    return max(1, int(most))


def in_flight_cap(cpus: int | None) -> int:
    """Takes in flight at most whatever their size: MAX_IN_FLIGHT, and TAKES_PER_CPU x `cpus`
    reading local files (`cpus` given); an object store's takes wait on the network."""
    return MAX_IN_FLIGHT if cpus is None else min(MAX_IN_FLIGHT, TAKES_PER_CPU * max(1, cpus))


def depth_for(budget_bytes: int, rows_per_take: int, bytes_per_row: float, *, clump: int = 0,
              cpus: int | None = 1) -> int:
    """Takes of `rows_per_take` rows in flight that fit `budget_bytes` (spec.data.readAheadBytes)
    with what each holds while it decodes (`held_bytes`), beside the take whose rows the
    consumer holds; at most `in_flight_cap(cpus)`, at least 1. `Takes` admits takes by the
    same count in bytes, take by take."""
    per_take = max(1.0, held_bytes(rows_per_take, bytes_per_row, clump))
    room = budget_bytes - rows_per_take * bytes_per_row
    return max(1, min(in_flight_cap(cpus), int(room // per_take)))


BARRIER = None
"""A request that says: what comes next may block (an epoch whose plan is still being
built). Takes hands back every result asked before it, then asks for more only when the
consumer asks for the next result: a plan built once a step before it is published
must never wait for reads that wait for it."""


class Takes(Generic[T]):
    """Iterate (tag, rows) over `requests` of (tag, row ids), takes running while they fit.

    What runs is held to `budget_bytes` in bytes, take by take: the `held_bytes` of every
    take in flight plus the rows of the last result handed out (its consumer still holds
    them), and to `in_flight_cap(cpus)` takes. Until a first result says how large a row
    is, FIRST_DEPTH takes run (and the consumer asks for one step a take: steps_per_take)."""

    def __init__(self, table: Any, columns: Sequence[str] | None,
                 requests: Iterator[tuple[T, np.ndarray] | None], budget_bytes: int, *,
                 clump: int = 0, cpus: int | None = 1) -> None:
        self._table = table
        self._columns = list(columns) if columns else None
        self._requests = requests
        self._budget = budget_bytes
        self._clump = clump
        self._cap = in_flight_cap(cpus)
        self._row_bytes: float | None = None
        self._running: collections.deque[tuple[T, int, concurrent.futures.Future[pa.RecordBatch]]] = (
            collections.deque())
        self._next: tuple[T, np.ndarray] | None = None
        """A request drawn from `requests` that did not fit yet."""
        self._consumed = 0
        """Bytes of the last result handed out: the consumer holds it while asking for more."""
        self._pool = concurrent.futures.ThreadPoolExecutor(self._cap, thread_name_prefix="splitfeed-take")
        self._exhausted = False
        self._at_barrier = False

    def _held(self, rows: int) -> float:
        assert self._row_bytes is not None
        return held_bytes(rows, self._row_bytes, self._clump)

    def _fits(self, rows: int) -> bool:
        """One more take of `rows` rows may start now (one always may when none runs)."""
        if not self._running:
            return True
        if len(self._running) >= self._cap:
            return False
        if self._row_bytes is None:
            return len(self._running) < FIRST_DEPTH
        held = sum(self._held(n) for _, n, _ in self._running)
        return held + self._held(rows) + self._consumed <= self._budget

    def _fill(self, *, cross: bool) -> None:
        while not self._exhausted:
            if self._next is None:
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
                self._next = request
            tag, ids = self._next
            if not self._fits(len(ids)):
                return
            self._next = None
            future = self._pool.submit(take_rows, self._table, ids, self._columns)
            self._running.append((tag, len(ids), future))

    def __iter__(self) -> Iterator[tuple[T, pa.RecordBatch]]:
        return self

    def steps_per_take(self, most: int, rows_per_step: int) -> int:
        """Steps the next take asks for: one until the first take says how large a row is
        (a table of 64 KiB rows must not start with a 1.6 GB take), then up to `most`
        within `rows_per_take` of the budget."""
        if self._row_bytes is None:
            return 1
        rows = rows_per_take(self._budget, self._row_bytes, self._clump)
        return max(1, min(most, rows // max(1, rows_per_step)))

    def __next__(self) -> tuple[T, pa.RecordBatch]:
        self._fill(cross=True)
        if not self._running:
            raise StopIteration
        tag, rows, future = self._running.popleft()
        batch = future.result()
        if self._row_bytes is None and batch.num_rows:
            self._row_bytes = batch.nbytes / batch.num_rows
        self._consumed += batch.nbytes  # the consumer still holds the last one until this returns
        self._fill(cross=False)
        self._consumed = batch.nbytes
        return tag, batch

    def close(self) -> None:
        """Stop: takes not started are dropped, running ones finish in the background."""
        self._exhausted = True
        self._next = None
        for _, _, future in self._running:
            future.cancel()
        self._running.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
