"""Getting an epoch's plan: building it with lancedb's permutation builder, or waiting for it.

The plan file itself (its format, key, where it lives, its damage and failure marks) is
sidecar/table/plans.py. Here: `build` runs lancedb's builder with StreamingDataset's arguments
in a memory pool sized for the container (`size_pool`) and streams the permutation into a
plan file, `build_and_publish` puts it at its place, and a reader's `Source` loads its
splits' row ids, waiting at a growing pace (`Pace`) for the builder's plan or building a
missing one itself where nobody builds for it; `Ahead` loads the next epoch's in a thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from splitfeed.trainer_client.contract import errors, specs, topology

from . import cgroups, plans

log = logging.getLogger(__name__)

EXPORT_BATCH_ROWS = 1 << 20
"""Rows per batch read out of lancedb's in-memory permutation table: its default of
1,024 made the export cost more than the build (8 s against 5 s at 20M rows)."""

MEMORY_ENV = "LANCEDB_PERM_BUILDER_MEMORY_LIMIT"
"""lancedb's builder sorts with a DataFusion pool of 100 MiB unless this says otherwise:
at ~4M rows its external sort fails ("Not enough memory to continue external sort")."""
MIN_POOL = 256 << 20
MAX_POOL = 8 << 30
BYTES_PER_ROW_BUILT = 16
"""lancedb keeps the built permutation (row_id, split_id: uint64 each) in memory."""


EPOCH_PRIME = 100_003
"""lancedb.streaming's _EPOCH_PRIME: epoch e's seed is shuffleSeed + e * EPOCH_PRIME. Written
here because importing lancedb.streaming imports torch (180 MiB) into every sidecar;
tests/reading/test_plans.py holds it equal to lancedb's."""


# --- building ------------------------------------------------------------------------


def builder_pool_bytes(rows: int, free: int | None) -> int:
    """The sort pool for lancedb's builder: what the build may use beside the permutation it
    keeps in memory, capped by what the container has free (half of it: the sidecar and
    its workers hold the rest), within [MIN_POOL, MAX_POOL]. It spills to disk past this."""
    if free is None:
        return MIN_POOL
    spare = free // 2 - rows * BYTES_PER_ROW_BUILT
    return max(MIN_POOL, min(MAX_POOL, spare))


def check_fits(rows: int, free: int | None, limited: bool) -> None:
    """Refuse a build that cannot fit the container, naming the field to raise."""
    need = rows * BYTES_PER_ROW_BUILT + MIN_POOL
    if limited and free is not None and need > free:
        raise plans.PlanError(
            f"building the permutation of {rows:,} rows needs about {_mib(need)} of memory and "
            f"the sidecar container has {_mib(free)} free: raise "
            f"spec.sidecar.resources.limits.memory by at least {_mib(need - free)}")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


OURS_ENV = "SPLITFEED_PERM_POOL_SET"
"""Set beside MEMORY_ENV when splitfeed chose it (a user's own setting is never changed)."""


def size_pool(rows: int, free: int | None) -> None:
    """Set lancedb's builder pool for `rows` rows in this process's environment, unless the
    user set one. Call it before threads that may read the environment start (the sidecar
    at start, a build's child first thing): setenv beside a concurrent getenv can crash."""
    if MEMORY_ENV in os.environ and OURS_ENV not in os.environ:
        return
    os.environ[MEMORY_ENV] = str(builder_pool_bytes(rows, free))
    os.environ[OURS_ENV] = "1"


def _permutation(table: Any, data: specs.DataSpec, epoch: int) -> Any:
    """lancedb's permutation table, built exactly as StreamingDataset.__init__ builds it."""
    from lancedb.permutation import permutation_builder

    builder = permutation_builder(table)
    if data.filter is not None:
        builder = builder.filter(data.filter)
    if data.shuffle:
        return builder.split_random(
            fixed=data.num_splits, seed=data.shuffle_seed + epoch * EPOCH_PRIME,
            clump_size=data.shuffle_clump_size or None).execute()
    return builder.split_sequential(fixed=data.num_splits).execute()


def _add_crcs(crcs: list[int], ids: np.ndarray, written: int, size: int) -> None:
    """Fold `ids`, the rows from `written` on (splits in order, `size` rows each, as checked),
    into each split's CRC: by slices, as a batch may start or end inside a split."""
    at = 0
    while at < len(ids):
        split = (written + at) // size
        end = min(len(ids), (split + 1) * size - written)
        crcs[split] = zlib.crc32(ids[at:end].data.cast("B"), crcs[split])
        at = end


def _export(permutation: Any, out: Any, data: specs.DataSpec, epoch: int, size: int) -> list[int]:
    """Stream lancedb's permutation table into `out`, checking that it is `num_splits`
    splits of `size` rows in split order; each split's CRC. (A thread that folded the CRCs
    and wrote while the next batch was decoded saved 0.05 s of 0.4 s at 20M rows.)"""
    crcs = [0] * data.num_splits
    written = 0
    batches = permutation.search().select(["row_id", "split_id"]).limit(None).to_batches(
        batch_size=EXPORT_BATCH_ROWS)
    for batch in batches:
        ids = batch.column("row_id").to_numpy().astype("<u8", copy=False)
        splits = batch.column("split_id").to_numpy()
        expected = (np.arange(written, written + len(ids)) // max(1, size)).astype(np.uint64)
        if size == 0 or not np.array_equal(splits, expected) or written // size >= data.num_splits:
            raise plans.PlanError(
                f"lancedb's permutation of epoch {epoch} is not {data.num_splits} splits of "
                f"{size} rows in split order; splitfeed cannot serve it (lancedb "
                f"{plans.lancedb_version()})")
        _add_crcs(crcs, ids, written, size)
        out.write(ids.data.cast("B"))
        written += len(ids)
    if written != size * data.num_splits:
        raise plans.PlanError(
            f"lancedb's permutation of epoch {epoch} holds {written:,} rows, not the "
            f"{size * data.num_splits:,} of {data.num_splits} splits of {size:,} rows counted "
            "on the table")
    return crcs


def build(table: Any, data: specs.DataSpec, epoch: int, path: str, *, rows: int) -> plans.Footer:
    """Build epoch `epoch`'s plan of `rows` rows (the filtered count) into local file `path`."""
    free, limited = cgroups.free_memory()
    check_fits(rows, free, limited)
    key = plans.PlanKey.of(data)
    started = time.monotonic()
    unsized = MEMORY_ENV not in os.environ  # a caller that did not size it (a tool, a test)
    if unsized:
        size_pool(rows, free)
    try:
        permutation = _permutation(table, data, epoch)
    except (RuntimeError, OSError) as exc:
        if "memory" in str(exc).lower():
            raise plans.PlanError(
                f"lancedb ran out of memory building the permutation of {rows:,} rows: raise "
                f"spec.sidecar.resources.limits.memory (about "
                f"{_mib(rows * BYTES_PER_ROW_BUILT * 2 + MIN_POOL)} is enough)") from exc
        raise
    finally:
        if unsized:
            os.environ.pop(MEMORY_ENV, None)
            os.environ.pop(OURS_ENV, None)
    built = time.monotonic()
    size = topology.split_size(rows, data.num_splits)
    with open(path, "wb") as out:
        crcs = _export(permutation, out, data, epoch, size)
        footer = plans.Footer(key.fields(), epoch, data.num_splits, size, crcs, plans.lancedb_version())
        plans.write_footer(out, footer)
        out.flush()
        os.fsync(out.fileno())
    log.info("built the plan of epoch %d: %d splits of %d rows in %.1f s (lancedb's permutation "
             "%.1f s, its export %.1f s)", epoch, data.num_splits, size, time.monotonic() - started,
             built - started, time.monotonic() - built)
    return footer


POLL_SHARE = 0.1
POLL_FIRST_S = {True: 0.005, False: 0.05}
"""The first look again, on a local filesystem (a stat) and on an object store (a request
per reader: 512 ranks looking every 5 ms would be 100k requests a second)."""
POLL_MAX_S = {True: 0.1, False: 1.0}
"""The longest wait between looks. Locally a look is a stat: at 1 s, a reader of a 20M-row
plan (a 5-10 s build) learnt of it 0.25-0.5 s late on average, on the way to a cold start's
first batch; ten stats a second cost nothing. On an object store, 1 s: a request a look."""


def next_poll_s(waited_s: float, local: bool = True) -> float:
    """When a reader waiting for a plan looks again: after a tenth of what it has waited so
    far (at least POLL_FIRST_S, at most POLL_MAX_S), so it learns of the plan at most ~10%
    late, in a few dozen looks for a minute's build on a store. Doubling from 50 ms made a
    reader of a plan that came 60 ms after it asked wait 150 ms: the stall at every epoch
    start of a fast job."""
    return min(POLL_MAX_S[local], max(POLL_FIRST_S[local], waited_s * POLL_SHARE))


class Pace:
    """When a reader waiting for a plan looks again (`next_poll_s` of the time since it came
    to need the plan) and when it gives up. A reader that loads an epoch's ids ahead
    (`Ahead`) does not need them until its reads get there (`need`): until then it looks at
    the pace of a wait begun when it started, and no timeout runs. `close` ends the wait."""

    def __init__(self, location: plans.Location, *, needed: bool = True) -> None:
        self._local = location.local
        self._since = time.monotonic()
        self._needed = needed
        self._wake = threading.Event()
        self._closed = False

    def need(self) -> None:
        """The reads got to the plan: look again soon, and time out from now."""
        if not self._needed:
            self._needed = True
            self._since = time.monotonic()
            self._wake.set()

    def expired(self, timeout_s: float) -> bool:
        return self._needed and time.monotonic() - self._since > timeout_s

    def sleep(self) -> None:
        """Until the next look; CancelledError once closed (its reads ended first)."""
        self._wake.wait(next_poll_s(time.monotonic() - self._since, self._local))
        self._wake.clear()
        if self._closed:
            raise concurrent.futures.CancelledError

    def close(self) -> None:
        self._closed = True
        self._wake.set()


def wait_for(location: plans.Location, key: plans.PlanKey, epoch: int, splits: Sequence[int], *,
             timeout_s: float, build: Callable[[], None] | None = None,
             pace: Pace | None = None) -> np.ndarray:
    """`read_splits`, waiting for the plan's builder; or building it with `build` (the
    builder's own readers, a job without a shared store) when it is missing."""
    pace = pace or Pace(location)
    while True:
        try:
            got = plans.load_splits(location, key, epoch, splits)
            if not isinstance(got, str):
                return got
            if build is None:
                raise plans.refuse_damaged(location, epoch, got)
            log.warning("plan %s %s; building it again", location.path(epoch), got)
            build()
            build = None
            continue
        except FileNotFoundError:
            if build is not None:
                build()
                build = None
                continue
            why = plans.failed(location, epoch)
            if why is not None:
                raise plans.PlanError(f"the plan of epoch {epoch} could not be built: {why}") from None
        if pace.expired(timeout_s):
            raise errors.UserError(
                f"the plan of epoch {epoch} did not appear at {location.uri} within "
                f"{timeout_s:.0f} s: replica 0's sidecar builds it (is it running?)")
        pace.sleep()


def temp_file(directory: str | None = None) -> str:
    """A local file to build a plan into (the build streams to disk, never to memory)."""
    return os.path.join(directory or tempfile.gettempdir(), f"splitfeed-plan-{uuid.uuid4().hex}.tmp")


PLAN_WAIT_S = 1800.0
"""How long a reader waits for the builder's plan: a 10^9-row build takes minutes."""


def build_and_publish(table: Any, data: specs.DataSpec, location: plans.Location, epoch: int, *,
                      rows: int) -> plans.Footer:
    """Build epoch `epoch`'s plan and put it at `location` (a local build file first: on a
    local store in the same directory, so that the rename is atomic)."""
    root = location.filesystem()[1]
    local = location.local
    if local:
        os.makedirs(root, exist_ok=True)
    path = temp_file(root if local else None)
    try:
        footer = build(table, data, epoch, path, rows=rows)
        plans.publish(location, path, epoch)
        plans.clear_damaged(location, epoch)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return footer


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a reader gets its splits' row ids: a plan location, and whether the reader
    builds a missing plan itself (it does when no sidecar builds for it: tests, tools)."""

    location: plans.Location
    builds: bool = False
    timeout_s: float = PLAN_WAIT_S

    def ids(self, table: Any, data: specs.DataSpec, epoch: int, splits: Sequence[int],
            rows: int, *, pace: Pace | None = None) -> np.ndarray:
        """(len(splits), splitSize) row ids of `splits` in epoch `epoch`, lancedb's order."""
        def build_here() -> None:
            build_and_publish(table, data, self.location, epoch, rows=rows)

        return wait_for(self.location, plans.PlanKey.of(data), epoch, splits, timeout_s=self.timeout_s,
                        build=build_here if self.builds else None, pace=pace)

    def ahead(self, table: Any, data: specs.DataSpec, epoch: int, splits: Sequence[int],
              rows: int) -> Ahead:
        """Load epoch `epoch`'s ids of `splits` in the background (`Ahead`)."""
        return Ahead(self, table, data, epoch, splits, rows)


class Ahead:
    """An epoch's row ids, loaded in a thread while the epoch before it is read. At an
    epoch start the reader then waits neither for a look at the store (a request on an
    object store, 10-50 ms) nor for the ids' ranged read (16 MB a rank at 10^9 rows and 512
    ranks); it holds this and the next epoch's ids, as docs/architecture.md counts. Where
    the plan is not built yet, the reads stop before the epoch until it arrives
    (takes.Barrier: it may wait for steps that only the reads before it let the trainers
    publish)."""

    def __init__(self, source: Source, table: Any, data: specs.DataSpec, epoch: int,
                 splits: Sequence[int], rows: int) -> None:
        self._pace = Pace(source.location, needed=False)
        self._loaded: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()

        def load() -> None:
            try:
                self._loaded.set_result(source.ids(table, data, epoch, splits, rows, pace=self._pace))
            except concurrent.futures.CancelledError:
                self._loaded.cancel()
            except BaseException as exc:  # noqa: BLE001 - handed to the reader that asks (ids)
                self._loaded.set_exception(exc)

        threading.Thread(target=load, name=f"splitfeed-plan-ahead-{epoch}", daemon=True).start()

    def arrived(self) -> bool:
        """The ids are loaded (or their load failed: `ids` says how), without waiting."""
        return self._loaded.done()

    def need(self) -> None:
        """The reads got here: look for a missing plan at a waiting reader's pace (Pace.need)."""
        self._pace.need()

    def ids(self) -> np.ndarray:
        """The ids, waiting for them (PlanError, UserError: as Source.ids)."""
        self.need()
        return self._loaded.result()

    def close(self) -> None:
        """Stop waiting for a plan that the reads will not use (they ended)."""
        self._pace.close()
