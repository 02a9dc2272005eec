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
import dataclasses
import itertools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar, cast

import numpy as np
import pyarrow as pa

from . import scans
from splitfeed.trainer_client.contract import errors

T = TypeVar("T")
log = logging.getLogger(__name__)

ROW_ID = scans.ROW_ID
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
SHARED_GAP_ROWS = 256
"""Rows of a take share lance's reads and decoding once they sit about this many rows
apart or closer. Measured: 26,400 shuffled rows from spans of 1M, 4M, 16M and 50M rows of
a 50M-row table took 35, 39, 57 and 120 ms."""

# A scan of the whole table gathers the rows of many requests at once (`scan_rows`): lance
# scans a narrow table ~150x faster a row than it takes one by id, so where the rows wanted
# are many against the table's, a scan costs less than their takes. The costs (seconds, on
# a 2-CPU machine, local disk; docs/architecture.md, "Rows/s as a table grows"):
TAKE_ROW_S = 1.5e-6
"""A take by row id, a row: 1.5 us (26,400 shuffled rows of 12 B from a 1M-row table, where
they share pages; 2.1-4.1 us from a 50M-row table)."""
TAKE_BYTE_S = 1.0e-9
"""A take, a byte of its rows (960 rows of 64 KiB: 66-86 us a row)."""
SCAN_START_S = 2.0e-3
"""A scan's start, whatever the table's rows: the query planned, its first batch (a 1,000-row
table: 1.7-2.2 ms of CPU)."""
SCAN_ROW_S = 3.0e-9
"""A scan with row ids, a row of the table (rows of 12 B, SCAN_BYTE_S included: 50M in
0.19-0.21 s of CPU reading SCAN_READAHEAD fragments ahead, 0.26-0.39 s with lance's default;
1M in 5.2-6.5 ms)."""
SCAN_BYTE_S = 1.0e-10
"""A scan, a byte of the table's rows (16,384 rows of 64 KiB: 6.6-9 us a row)."""
GATHER_ROW_S = 8.0e-8
"""Finding a row in the scan and putting it where it was asked (scans.gather, rows of 12 B:
46-50 ns a row gathering 62K rows of a 1M-row table, 81-85 ns gathering 2-4M of a 50M-row
one, whose asked ids and result no longer sit in a CPU cache; up to 122 ns under load)."""
GATHER_BYTE_S = 3.0e-10
"""Picking a row, a byte of it: copied twice."""
SCAN_GAIN = 2.0
"""A scan replaces takes only where it is estimated at least this many times cheaper."""
SCAN_HELD_BYTES = 28 << 20
"""What lance holds while it scans a local table, whatever is gathered: its read-ahead of
SCAN_READAHEAD fragments. Measured (the bench's 50M-row table, rows of 12 B, peak RSS above
a warm process's): a bare scan 4-18 MiB; gathering 1, 2, 3, 4 and 6M rows 46-53, 60-73,
89-94, 114-123 and 162-163 MiB, which this and SCAN_HELD_PER_* bound."""
SCAN_HELD_BYTES_UNSET = 148 << 20
"""... where LANCE_DEFAULT_FRAGMENT_READAHEAD is not SCAN_READAHEAD (lance's default or the
user's): a bare scan 105-135 MiB; gathering 1, 2, 3, 4 and 5M rows 149-164, 186-195,
200-213, 231-241 and 237-248 MiB."""
SCAN_HELD_PER_BYTE = 3.0
"""A scan holds the rows it gathers in columns of other than fixed width (strings, booleans,
nested) about three times at its peak: picked per batch, joined, put in the order asked."""
SCAN_IN_PLACE_PER_BYTE = 1.0
"""... and once where every column is fixed-width: scans.Into puts those where they were asked."""
SCAN_HELD_PER_ROW = 12
"""... and its indexes: the row ids asked (8 B) and their order by bucket (4 B)."""
SCANS_AT_ONCE = 1
"""Scans a reader runs at once: a scan is CPU work that lance already spreads over its own
threads, and the next window's scan runs while this one's rows are handed out, so a second
only contends and delays the first window (the bench's steady rows/s, three runs each at load
2-5: 50M-row table 4.5-5.6M one at a time, 2.5-4.2M two at a time; 1M-row table 3.1-3.8M and
3.2-4.5M)."""
SCAN_READAHEAD = 2
"""Fragments lance reads ahead in a scan of a local table (LANCE_DEFAULT_FRAGMENT_READAHEAD,
set by `prefer_local_scans`). Unset, lance reads ahead many more, and holds what it decoded:
a scan of the bench's 50M-row table held 105-135 MiB instead of 4-18, and took 0.26-0.39 s of
CPU instead of 0.19-0.21 (1 fragment: 0-10 MiB, 0.17-0.31 s)."""
READAHEAD_ENV = "LANCE_DEFAULT_FRAGMENT_READAHEAD"
SCAN_BATCH_BYTES = 4 << 20
"""Bytes of a batch a scan asks lance for (rows and row ids): lancedb hands each batch over
from its event loop's thread (a wake-up and a lock each), so 50M rows of 12 B in batches
of 64K rows took 0.81 s, of 256K rows 0.68 s; at most SCAN_BATCH_ROWS."""
SCAN_BATCH_ROWS = 1 << 18


_END: Any = object()


def take_rows(table: Any, ids: np.ndarray, columns: Sequence[str] | None) -> pa.RecordBatch:
    """The rows `ids` (row ids of the table's checked-out version), in that order; a row id
    asked twice (two epochs' requests taken at once) is read once and given twice."""
    wanted = np.sort(ids)
    if len(wanted) > 1 and bool((wanted[1:] == wanted[:-1]).any()):
        wanted = np.unique(wanted)
    query = table.take_row_ids(wanted.tolist())
    if columns:
        query = query.select(list(columns))
    got = query.with_row_id().to_arrow()
    found = got.column(ROW_ID).to_numpy()
    at = np.zeros(0, dtype=np.int64)
    if len(found) == len(wanted):
        order = np.argsort(found, kind="stable")
        at = order[np.searchsorted(found, ids, sorter=order).clip(0, len(found) - 1)]
    if len(found) != len(wanted) or not np.array_equal(found[at], ids):
        raise errors.SidecarFailed(
            f"lancedb returned {len(found)} rows for {len(wanted)} row ids: the table's version "
            "changed under the reader, or its row ids are not stable")
    rows = got.drop_columns([ROW_ID]).take(pa.array(at))
    return rows.combine_chunks().to_batches(max_chunksize=max(1, len(ids)))[0]


def scan_rows(table: Any, ids: np.ndarray, columns: Sequence[str] | None,
              row_bytes: float = 12.0) -> pa.RecordBatch:
    """`take_rows` by one scan of the whole table: each scanned batch gives the rows of
    `ids` it holds (found by row id, checked), each put where it was asked (scans.gather).
    Cheaper than a take where `ids` are many against the table's rows (`scan_pays`). A row
    the scan did not find is asked of `take_rows`, which says why it is missing."""
    query = table.search()
    if columns:
        query = query.select(list(columns))
    batch_rows = int(min(SCAN_BATCH_ROWS, max(1024, SCAN_BATCH_BYTES // max(1.0, row_bytes + 8))))
    batches = iter(query.with_row_id(True).limit(None).to_batches(batch_size=batch_rows))
    first = next(batches, None)  # lance reads ahead on its own threads while the ids are grouped
    got = scans.gather(itertools.chain([first] if first is not None else [], batches),
                       np.ascontiguousarray(ids).view(np.int64))
    return got if got is not None else take_rows(table, ids, columns)


def scan_cost(table_rows: int, bytes_per_row: float) -> float:
    """Seconds a scan of the table costs, before anything is gathered."""
    return SCAN_START_S + table_rows * (SCAN_ROW_S + bytes_per_row * SCAN_BYTE_S)


def scan_pays(rows: int, bytes_per_row: float, table_rows: int) -> bool:
    """A scan of the table gathering `rows` rows costs SCAN_GAIN times less than their takes."""
    take = rows * (TAKE_ROW_S + bytes_per_row * TAKE_BYTE_S)
    scan = (scan_cost(table_rows, bytes_per_row)
            + rows * (GATHER_ROW_S + bytes_per_row * GATHER_BYTE_S))
    return scan * SCAN_GAIN <= take


def prefer_local_scans() -> None:
    """Have lance read SCAN_READAHEAD fragments ahead in this process's scans (a value the
    user set is kept). lance reads it once, at the process's first scan or take, so this is
    called where a process opens a local table (reading.open_table); object stores keep
    lance's default, whose read-ahead hides their latency."""
    os.environ.setdefault(READAHEAD_ENV, str(SCAN_READAHEAD))


def lance_held() -> int:
    """What lance holds while it scans (SCAN_HELD_BYTES, or SCAN_HELD_BYTES_UNSET where the
    read-ahead is not SCAN_READAHEAD)."""
    return SCAN_HELD_BYTES if os.environ.get(READAHEAD_ENV) == str(SCAN_READAHEAD) else SCAN_HELD_BYTES_UNSET


def scan_held(rows: int, bytes_per_row: float, per_byte: float = SCAN_HELD_PER_BYTE) -> float:
    """What a scan gathering `rows` rows holds at its peak (`lance_held`, SCAN_HELD_PER_*):
    `per_byte` times their bytes (SCAN_IN_PLACE_PER_BYTE where every column is put in place)."""
    return lance_held() + rows * (per_byte * bytes_per_row + SCAN_HELD_PER_ROW)


def scan_window(budget_bytes: int, bytes_per_row: float, table_rows: int,
                per_byte: float = SCAN_HELD_PER_BYTE) -> int:
    """Rows one scan gathers: as many as let it (`scan_held`) and its result, consumed
    while the next scan runs, fit `budget_bytes`, and no more than make the scan's share
    of a row's cost as small as its gather's; 0 where a scan of that many does not pay
    (`scan_pays`: a wide row, a small budget, or a table too large for the budget)."""
    room = (budget_bytes - lance_held()) / ((per_byte + 1) * bytes_per_row + SCAN_HELD_PER_ROW)
    enough = scan_cost(table_rows, bytes_per_row) / (GATHER_ROW_S + bytes_per_row * GATHER_BYTE_S)
    rows = int(min(room, max(1.0, enough)))
    return rows if rows > 0 and scan_pays(rows, bytes_per_row, table_rows) else 0


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


def merged_rows(budget_bytes: int, bytes_per_row: float, clump: int, table_rows: int) -> int:
    """Rows to take at once from requests already drawn: enough that a take's rows sit
    SHARED_GAP_ROWS apart in a table of `table_rows` rows, within `rows_per_take`. 0 on a
    table whose requests' rows already share (a take of 26,400 of 1M rows: merging them
    only cost CPU, 25% more a row)."""
    return min(rows_per_take(budget_bytes, bytes_per_row, clump), table_rows // SHARED_GAP_ROWS)


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


def _never() -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class Barrier:
    """A request that says: what comes next may block (an epoch whose plan is still being
    built) until `opened()` says it will not. Until then Takes hands back every result
    asked before it, then asks for more only when the consumer asks for the next result:
    a plan built once a step before it is published must never wait for reads that wait
    for it. Once `opened()` (the plan arrived: `planning.Ahead`), reads run on past it, so
    the next epoch's first rows are taken before its first step is asked for."""

    opened: Callable[[], bool] = _never


class Takes(Generic[T]):
    """Iterate (tag, rows) over `requests` of (tag, row ids), takes running while they fit.

    What runs is held to `budget_bytes` in bytes, take by take: the `held_bytes` of every
    take in flight plus the rows of the last result handed out (its consumer still holds
    them), and to `in_flight_cap(cpus)` takes. Until a first result says how large a row
    is, FIRST_DEPTH takes run (and the consumer asks for one step a take: steps_per_take).

    On a large table, requests already drawn are taken together (`merged_rows`): lance
    reads a shuffled row with reads and decoding of its own unless its take holds rows
    near it, so a take of more rows costs less a row there (docs/architecture.md, "Rows/s
    as a table grows"). With `scans`, requests drawn are instead gathered by one scan of
    the table where that costs less than their takes (`scan_window`, `scan_rows`), one scan
    at a time, the next running while this one's rows are handed out. Each request's rows
    still come back as one result of its own."""

    def __init__(self, table: Any, columns: Sequence[str] | None,
                 requests: Iterator[tuple[T, np.ndarray] | Barrier], budget_bytes: int, *,
                 clump: int = 0, cpus: int | None = 1, scans: bool = False) -> None:
        self._table = table
        self._columns = list(columns) if columns else None
        self._requests = requests
        self._budget = budget_bytes
        self._clump = clump
        self._cap = in_flight_cap(cpus)
        self._row_bytes: float | None = None
        self._merged = 0
        """Rows to take at once (`merged_rows`), once a row's size is known."""
        self._scans = scans
        self._table_rows = 0
        self._scanned = 0
        """Rows to gather by one scan (`scan_window`), once a row's size is known; 0: takes."""
        self._per_byte = SCAN_HELD_PER_BYTE
        """What a scan holds a byte of its rows (SCAN_IN_PLACE_PER_BYTE: fixed-width columns)."""
        self._running: collections.deque[
            tuple[list[tuple[T, int]], float, concurrent.futures.Future[pa.RecordBatch], bool]] = collections.deque()
        """(requests and their rows, bytes held while it runs, its result, whether a scan) of each
        take or scan."""
        self._scanning = 0
        """Scans running (SCANS_AT_ONCE at most)."""
        self._pending: collections.deque[tuple[T, np.ndarray]] = collections.deque()
        """Requests drawn from `requests` that are not taken yet."""
        self._ready: collections.deque[tuple[T, pa.RecordBatch]] = collections.deque()
        """Results of a take of several requests, not handed out yet."""
        self._consumed = 0
        """Bytes of the last take's result: the consumer holds it while asking for more."""
        self._pool = concurrent.futures.ThreadPoolExecutor(self._cap, thread_name_prefix="splitfeed-take")
        self._exhausted = False
        self._barrier: Barrier | None = None
        """The barrier drawn and not passed yet."""

    def _held(self, rows: int) -> float:
        assert self._row_bytes is not None
        return held_bytes(rows, self._row_bytes, self._clump)

    def _fits(self, held: float) -> bool:
        """One more take holding `held` bytes may start now (one always may when none runs)."""
        if not self._running:
            return True
        if len(self._running) >= self._cap:
            return False
        if self._row_bytes is None:
            return len(self._running) < FIRST_DEPTH
        return sum(h for _, h, _, _ in self._running) + held + self._consumed <= self._budget

    def _window_fits(self) -> bool:
        """Where scans gather, a window's requests are drawn once its scan may start (one scan
        at a time, SCANS_AT_ONCE): drawn earlier, their row ids would wait, held, while the scan
        before it runs."""
        return not self._scanned or (self._scanning < SCANS_AT_ONCE and self._fits(
            scan_held(self._scanned, cast(float, self._row_bytes), self._per_byte)))

    def _draw(self, *, cross: bool) -> bool:
        """Draw the next request into `_pending`; False when there is none to draw now.
        A Barrier is passed once it opened, or when `cross` and every result before it is
        handed out."""
        while not self._exhausted:
            if self._barrier is not None:
                if not self._barrier.opened() and (
                        self._running or self._ready or self._pending or not cross):
                    return False
                self._barrier = None
            request = next(self._requests, _END)
            if request is _END:
                self._exhausted = True
                return False
            if isinstance(request, Barrier):
                self._barrier = request
                continue
            self._pending.append(request)
            return True
        return False

    def _group(self, most: int) -> tuple[int, int]:
        """(rows, requests) of the pending requests taken together: up to `most` rows, at
        least one request; draws more (never across a barrier) to fill it."""
        rows, count = len(self._pending[0][1]), 1
        while rows < most and (count < len(self._pending) or self._draw(cross=False)):
            more = len(self._pending[count][1])
            if rows + more > most:
                break
            rows, count = rows + more, count + 1
        return rows, count

    def _fill(self, *, cross: bool) -> None:
        while self._window_fits() and (self._pending or self._draw(cross=cross)):
            scan = False
            if self._scanned:
                rows, count = self._group(self._scanned)
                assert self._row_bytes is not None
                scan = scan_pays(rows, self._row_bytes, self._table_rows)
            if scan:
                held = scan_held(rows, cast(float, self._row_bytes), self._per_byte)
            else:  # no scans, or too few rows drawn for one to pay (a barrier, the end)
                rows, count = self._group(self._merged)
                held = self._held(rows) if self._row_bytes is not None else 0.0
            if not self._fits(held):
                return
            group = [self._pending.popleft() for _ in range(count)]
            ids = group[0][1] if count == 1 else np.concatenate([ids for _, ids in group])
            if scan:
                future = self._pool.submit(scan_rows, self._table, ids, self._columns,
                                           cast(float, self._row_bytes))
            else:
                future = self._pool.submit(take_rows, self._table, ids, self._columns)
            self._running.append(([(tag, len(ids)) for tag, ids in group], held, future, scan))
            self._scanning += scan

    def _count_rows(self) -> int:
        """The table's rows (all of them: where rows sit, not which pass a filter); 0, and
        no merging, where the table cannot say."""
        try:
            return int(self._table.count_rows())
        except Exception as exc:  # noqa: BLE001 - merging is an optimisation only
            log.warning("takes are not merged: the table's row count failed (%s)", str(exc))
            return 0

    def __iter__(self) -> Iterator[tuple[T, pa.RecordBatch]]:
        return self

    def steps_per_take(self, most: int, rows_per_step: int) -> int:
        """Steps the next request asks for: one until the first take says how large a row is
        (a table of 64 KiB rows must not start with a 1.6 GB take), then up to `most`
        within `rows_per_take` of the budget."""
        if self._row_bytes is None:
            return 1
        rows = rows_per_take(self._budget, self._row_bytes, self._clump)
        return max(1, min(most, rows // max(1, rows_per_step)))

    def __next__(self) -> tuple[T, pa.RecordBatch]:
        if self._ready:
            self._fill(cross=False)
            return self._ready.popleft()
        self._fill(cross=True)
        if not self._running:
            self.close()  # its threads end with it
            raise StopIteration
        asked, _, future, scanned = self._running.popleft()
        self._scanning -= scanned
        batch = future.result()
        if self._row_bytes is None and batch.num_rows:
            self._row_bytes = batch.nbytes / batch.num_rows
            self._table_rows = self._count_rows()
            self._merged = merged_rows(self._budget, self._row_bytes, self._clump, self._table_rows)
            if self._scans and self._table_rows:
                if scans.in_place(batch.schema):
                    self._per_byte = SCAN_IN_PLACE_PER_BYTE
                self._scanned = scan_window(self._budget, self._row_bytes, self._table_rows, self._per_byte)
        at = 0
        for tag, rows in asked:
            self._ready.append((tag, batch.slice(at, rows)))
            at += rows
        self._consumed += batch.nbytes  # the consumer still holds the last one until this returns
        self._fill(cross=False)
        self._consumed = batch.nbytes
        return self._ready.popleft()

    def close(self) -> None:
        """Stop: takes not started are dropped, running ones finish in the background."""
        self._exhausted = True
        self._pending.clear()
        self._ready.clear()
        for _, _, future, _ in self._running:
            future.cancel()
        self._running.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
