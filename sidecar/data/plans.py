"""One epoch's split permutation as a file: built once by lancedb, read split by split.

lancedb's `StreamingDataset` builds the whole permutation (row id and split id of
every row, ~16 B a row) in each process that opens it, then reads each split
through a reader that costs O(table rows) to open. On 10^7-10^9 rows that is
minutes and gigabytes per sidecar, per epoch. Here the permutation is built once
per epoch per job, by the same lancedb builder with the same arguments
StreamingDataset passes (so the order is lancedb's), streamed out of lancedb's
in-memory table into a file, and each reader loads only the row ids of its own
splits (one ranged read: a rank's splits are contiguous) and takes rows by id.

File (`epoch-<e:06d>.plan`): every split's row ids as little-endian uint64, split
0 first, each split `splitSize` long (lancedb's builder drops the surplus rows
so that every split is as long), then a JSON footer (the key it was built for,
the epoch, the lancedb version that built it, a CRC-32 per split), then the
footer's length (uint64) and MAGIC. The footer comes last so that the ids can be
written as they stream out of lancedb. The builder checks a stored plan's footer
alone (size, key, a CRC per split) at each world start; a reader checks the key,
the size and its own splits' CRCs, and marks a damaged plan for its builder to build
again (`refuse_damaged`): a foreign or damaged plan is never used.

Where plans live: with spec.checkpoint.uri, next to the job's checkpoints
(`<job uid>/plans/<key digest>/`), built by the world's coordinator and read by
every sidecar of every later world; without it, in a directory of the sidecar's
own, built by each sidecar for itself.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import pyarrow.fs as pafs

from splitfeed.trainer_client.contract import errors, specs, topology

from . import cgroups

log = logging.getLogger(__name__)

FORMAT = 1
MAGIC = b"SFPLAN01"
_TAIL = struct.Struct("<Q8s")  # footer length, MAGIC
ID_BYTES = 8
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


class PlanError(errors.DataError):
    """A plan that cannot be built, or one that must not be used (damaged or foreign)."""


@dataclasses.dataclass(frozen=True)
class PlanKey:
    """What fixes an epoch's permutation: the table at one version and the order fields.

    Not columns, batch sizes or transforms (they read the plan, they do not change it),
    and not the lancedb version: a stored plan keeps its order whatever lancedb reads
    it; `Footer.lancedb` says which built it, and `Plans` refuses to mix versions.
    """

    uri: str
    table: str
    version: int
    filter: str | None
    num_splits: int
    shuffle: bool
    shuffle_seed: int
    shuffle_clump_size: int

    @classmethod
    def of(cls, data: specs.DataSpec) -> PlanKey:
        if not isinstance(data.version, int):
            raise ValueError("a plan is for one pinned table version (reading.pin)")
        return cls(data.uri, data.table, data.version, data.filter, data.num_splits, data.shuffle,
                   data.shuffle_seed, data.shuffle_clump_size)

    def fields(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.fields(), sort_keys=True).encode()).hexdigest()[:20]


@dataclasses.dataclass(frozen=True)
class Footer:
    """What a plan file says about itself."""

    key: dict[str, Any]
    epoch: int
    num_splits: int
    split_size: int
    crcs: list[int]
    lancedb: str
    format: int = FORMAT

    @property
    def ids_bytes(self) -> int:
        return self.num_splits * self.split_size * ID_BYTES


def lancedb_version() -> str:
    import lancedb

    return str(lancedb.__version__)


def file_name(epoch: int) -> str:
    return f"epoch-{epoch:06d}.plan"


# --- what a plan and an epoch's reads cost ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cost:
    """What one epoch of a plain job costs (`splitfeed plan --read-table` prints it)."""

    plan_bytes: int
    """The epoch's plan file: 8 B a row."""
    rank_ids_bytes: int
    """The row ids one rank holds for an epoch (twice that at an epoch's end: the next's)."""
    requests: int
    """Reads of the store: one per row per column read, or one per clump of rows."""
    read_bytes: int


def cost(rows: int, num_splits: int, world_size: int, clump: int, columns: int,
         row_bytes: float) -> Cost:
    """An epoch's plan and reads. Rows shuffled one by one are scattered over the whole
    table, so each costs a ranged GET per column (lance merges only neighbours: on a small
    table it needs fewer); shuffleClumpSize C reads C neighbouring rows at once."""
    size = rows // num_splits
    kept = size * num_splits
    per_request = max(1, clump)
    return Cost(kept * ID_BYTES, size * (num_splits // world_size) * ID_BYTES,
                -(-kept // per_request) * max(1, columns), int(kept * row_bytes))


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
        raise PlanError(
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
            raise PlanError(
                f"lancedb's permutation of epoch {epoch} is not {data.num_splits} splits of "
                f"{size} rows in split order; splitfeed cannot serve it (lancedb "
                f"{lancedb_version()})")
        _add_crcs(crcs, ids, written, size)
        out.write(ids.data.cast("B"))
        written += len(ids)
    if written != size * data.num_splits:
        raise PlanError(
            f"lancedb's permutation of epoch {epoch} holds {written:,} rows, not the "
            f"{size * data.num_splits:,} of {data.num_splits} splits of {size:,} rows counted "
            "on the table")
    return crcs


def build(table: Any, data: specs.DataSpec, epoch: int, path: str, *, rows: int) -> Footer:
    """Build epoch `epoch`'s plan of `rows` rows (the filtered count) into local file `path`."""
    free, limited = cgroups.free_memory()
    check_fits(rows, free, limited)
    key = PlanKey.of(data)
    started = time.monotonic()
    unsized = MEMORY_ENV not in os.environ  # a caller that did not size it (a tool, a test)
    if unsized:
        size_pool(rows, free)
    try:
        permutation = _permutation(table, data, epoch)
    except (RuntimeError, OSError) as exc:
        if "memory" in str(exc).lower():
            raise PlanError(
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
        footer = Footer(key.fields(), epoch, data.num_splits, size, crcs, lancedb_version())
        blob = json.dumps(dataclasses.asdict(footer)).encode()
        out.write(blob)
        out.write(_TAIL.pack(len(blob), MAGIC))
        out.flush()
        os.fsync(out.fileno())
    log.info("built the plan of epoch %d: %d splits of %d rows in %.1f s (lancedb's permutation "
             "%.1f s, its export %.1f s)", epoch, data.num_splits, size, time.monotonic() - started,
             built - started, time.monotonic() - built)
    return footer


# --- where plans live ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Location:
    """A directory of plans: a filesystem uri (local path or s3://) and storage options.
    Picklable: loader worker processes read their splits from it themselves."""

    uri: str
    storage_options: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def filesystem(self) -> tuple[pafs.FileSystem, str]:
        """The filesystem and root, made once per Location (on a store, an S3 client)."""
        made = self.__dict__.get("_filesystem")
        if made is None:
            from ..world.checkpoints import filesystem

            made = filesystem(self.uri, self.storage_options)
            object.__setattr__(self, "_filesystem", made)  # a cache, not a field: frozen stays true
        return cast(tuple[pafs.FileSystem, str], made)

    def path(self, epoch: int) -> str:
        return f"{self.filesystem()[1]}/{file_name(epoch)}"

    @property
    def local(self) -> bool:
        """On this machine's filesystem, not an object store: a rename is atomic, a look is cheap."""
        return isinstance(self.filesystem()[0], pafs.LocalFileSystem)


def location_for(data: specs.DataSpec, root: str | None,
                 storage_options: Mapping[str, str] | None = None) -> Location:
    """Plans of `data` under `root` (a job's checkpoint directory), or in a new private
    directory of this process when the job has no store to share them."""
    digest = PlanKey.of(data).digest()
    if root is None:  # its own: sidecars run as threads of one process in tests
        root = tempfile.mkdtemp(prefix="sidecar-", dir=private_root())
    return Location(f"{root.rstrip('/')}/plans/{digest}", dict(storage_options or {}))


_PRIVATE: list[str] = []


def private_root() -> str:
    """This process's own directory of plans, removed when it exits (a sidecar without a
    store to share plans writes an epoch's row ids here: 8 B a row, not to be left behind)."""
    if not _PRIVATE:
        _PRIVATE.append(tempfile.mkdtemp(prefix="splitfeed-plans-"))
        atexit.register(shutil.rmtree, _PRIVATE[0], True)
    return _PRIVATE[0]


def _read_footer(fs: pafs.FileSystem, path: str) -> tuple[Footer, int]:
    """The footer and the file's size; PlanError for a file that is not a whole plan."""
    with fs.open_input_file(path) as f:
        size = f.size()
        if size < _TAIL.size:
            raise PlanError(f"plan {path} is torn ({size} bytes)")
        length, magic = _TAIL.unpack(f.read_at(_TAIL.size, size - _TAIL.size))
        if magic != MAGIC or length > size - _TAIL.size:
            raise PlanError(f"plan {path} is not a splitfeed plan or is torn")
        try:
            found = json.loads(f.read_at(length, size - _TAIL.size - length))
            footer = Footer(**found)
        except (ValueError, TypeError) as exc:
            raise PlanError(f"plan {path} has a damaged footer ({exc})") from exc
    if footer.format != FORMAT or footer.ids_bytes + length + _TAIL.size != size:
        raise PlanError(f"plan {path} is of format {footer.format} or torn ({size} bytes)")
    crcs = footer.crcs
    if (not isinstance(crcs, list) or len(crcs) != footer.num_splits
            or not all(isinstance(c, int) and 0 <= c < 1 << 32 for c in crcs)):
        raise PlanError(f"plan {path} has a damaged footer (not one CRC-32 per split)")
    return footer, size


def _check_key(footer: Footer, key: PlanKey, epoch: int, path: str) -> None:
    ours = key.fields()
    differs = sorted(k for k in ours if footer.key.get(k) != ours[k])
    if differs or footer.epoch != epoch:
        raise PlanError(
            f"plan {path} was built for other data ({', '.join(differs) or 'epoch'} differ): "
            "it is never used for this job")


def _load(location: Location, key: PlanKey, epoch: int, splits: Sequence[int]) -> np.ndarray | str:
    """`read_splits`' ids, or what is damaged in the plan (a torn file, a split failing its
    CRC). A plan built for another key raises PlanError: it was never this job's."""
    fs, _ = location.filesystem()
    path = location.path(epoch)
    try:
        footer, _ = _read_footer(fs, path)
    except PlanError as exc:
        return str(exc).removeprefix(f"plan {path} ")
    _check_key(footer, key, epoch, path)
    first, count = splits[0], len(splits)
    if list(splits) != list(range(first, first + count)) or first + count > footer.num_splits:
        raise ValueError(f"splits {list(splits)} are not a contiguous block of {footer.num_splits}")
    width = footer.split_size * ID_BYTES
    with fs.open_input_file(path) as f:
        raw = f.read_at(width * count, width * first)
    if len(raw) != width * count:
        return f"is torn (split {first + count - 1} is short)"
    ids = np.frombuffer(raw, dtype="<u8").reshape(count, footer.split_size)
    for i in range(count):
        if zlib.crc32(ids[i]) != footer.crcs[first + i]:
            return f"is damaged (split {first + i} fails its CRC)"
    return ids


def read_splits(location: Location, key: PlanKey, epoch: int, splits: Sequence[int]) -> np.ndarray:
    """Row ids of `splits` (contiguous, ascending) of epoch `epoch`: shape (len, splitSize).

    One ranged read, each split checked against its CRC (the only full check of a plan:
    `verify` reads its footer alone). Raises FileNotFoundError while the plan does not
    exist yet, PlanError for a plan built for another key, and for a damaged one
    (`refuse_damaged`) a UserError that a restart cures: the builder builds it again."""
    got = _load(location, key, epoch, splits)
    if isinstance(got, str):
        raise refuse_damaged(location, epoch, got)
    return got


DAMAGED = ".damaged"
"""Beside a plan a reader found damaged: its builder's `verify` then builds it again."""


def refuse_damaged(location: Location, epoch: int, what: str) -> errors.UserError:
    """Report a damaged plan where its builder looks (`verify`) and say so in one line.

    Not a PlanError (a DataError fails the job for good): the world restarts within the
    operator's restart budget and replica 0's sidecar builds the plan again before its
    readers use it. Where the mark cannot be written, the line says to delete the plan."""
    path = location.path(epoch)
    try:
        fs, root = location.filesystem()
        fs.create_dir(root, recursive=True)
        with fs.open_output_stream(f"{path}{DAMAGED}") as out:
            out.write(what.encode())
    except OSError as exc:
        log.warning("cannot mark plan %s damaged: %s", path, exc)
        return errors.UserError(
            f"plan {path} {what} and is never used: delete it, and replica 0's sidecar builds it "
            "again when the job's next world starts")
    return errors.UserError(
        f"plan {path} {what} and is never used: marked {file_name(epoch)}{DAMAGED} for "
        "replica 0's sidecar to build it again when the job's next world starts (if it "
        "recurs, delete the plan)")


def damaged(location: Location, epoch: int) -> str | None:
    """What a reader found damaged in epoch `epoch`'s plan, if one did (`refuse_damaged`)."""
    try:
        fs, _ = location.filesystem()
        with fs.open_input_stream(f"{location.path(epoch)}{DAMAGED}") as f:
            return bytes(f.read()).decode(errors="replace")
    except (FileNotFoundError, OSError):
        return None


def clear_damaged(location: Location, epoch: int) -> None:
    with contextlib.suppress(OSError):
        fs, _ = location.filesystem()
        fs.delete_file(f"{location.path(epoch)}{DAMAGED}")


def verify(location: Location, key: PlanKey, epoch: int) -> Footer | None:
    """The footer of a whole plan for `key` and `epoch`, from its footer alone: its size,
    MAGIC and format, key and epoch, and a CRC for every split (each reader checks its own
    splits' CRCs as it loads them: reading every split here cost a 10^9-row plan's 8 GB at
    every world start). None when there is none, when it is torn or foreign, or when a
    reader found it damaged (`refuse_damaged`): then it is to be rebuilt."""
    fs, path = _fs_path(location, epoch)
    try:
        footer, _ = _read_footer(fs, path)
        _check_key(footer, key, epoch, path)
    except FileNotFoundError:
        return None
    except PlanError as exc:
        log.warning("%s; building it again", exc)
        return None
    why = damaged(location, epoch)
    if why is not None:
        log.warning("plan %s %s (a reader found it); building it again", path, why)
        return None
    return footer


def _fs_path(location: Location, epoch: int) -> tuple[pafs.FileSystem, str]:
    fs, _ = location.filesystem()
    return fs, location.path(epoch)


def publish(location: Location, local_file: str, epoch: int) -> None:
    """Put a built plan at its place whole: a rename locally, one (multipart) put on S3."""
    fs, root = location.filesystem()
    path = location.path(epoch)
    if location.local:
        fs.create_dir(root, recursive=True)
        os.replace(local_file, path)
        return
    # No create_dir on an object store: a put makes its key's prefix, and the directory
    # markers arrow would write cost 5 requests a plan (of 11 in all, counted at the endpoint).
    with open(local_file, "rb") as src, fs.open_output_stream(path) as dst:
        while chunk := src.read(16 << 20):
            dst.write(chunk)
    os.unlink(local_file)


def built_by(location: Location) -> set[str]:
    """lancedb versions that built the plans already stored at `location`."""
    fs, root = location.filesystem()
    found: set[str] = set()
    for info in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
        if info.base_name.endswith(".plan"):
            with contextlib.suppress(PlanError, OSError):
                found.add(_read_footer(fs, info.path)[0].lancedb)
    return found


def check_builder(location: Location) -> None:
    """Refuse to add a plan built by another lancedb than the job's stored ones: its order
    could differ from theirs, and an epoch must never be reordered against its checkpoints."""
    ours = lancedb_version()
    others = built_by(location) - {ours}
    if others:
        raise PlanError(
            f"this job's plans at {location.uri} were built by lancedb {', '.join(sorted(others))} "
            f"and this image has lancedb {ours}, whose order may differ: run the job on an image "
            "with the lancedb that started it, or start a new StreamingJob")


def mark_failed(location: Location, epoch: int, why: str) -> None:
    """Tell the readers waiting for epoch `epoch`'s plan that its builder gave up, and why."""
    with contextlib.suppress(OSError):
        fs, root = location.filesystem()
        fs.create_dir(root, recursive=True)
        with fs.open_output_stream(f"{location.path(epoch)}.failed") as out:
            out.write(why.encode())


def clear_failed(location: Location, epoch: int) -> None:
    with contextlib.suppress(OSError):
        fs, _ = location.filesystem()
        fs.delete_file(f"{location.path(epoch)}.failed")


def failed(location: Location, epoch: int) -> str | None:
    """Why the builder of epoch `epoch`'s plan gave up, if it did."""
    try:
        fs, _ = location.filesystem()
        with fs.open_input_stream(f"{location.path(epoch)}.failed") as f:
            return bytes(f.read()).decode(errors="replace")
    except (FileNotFoundError, OSError):
        return None


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

    def __init__(self, location: Location, *, needed: bool = True) -> None:
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


def wait_for(location: Location, key: PlanKey, epoch: int, splits: Sequence[int], *,
             timeout_s: float, build: Callable[[], None] | None = None,
             pace: Pace | None = None) -> np.ndarray:
    """`read_splits`, waiting for the plan's builder; or building it with `build` (the
    builder's own readers, a job without a shared store) when it is missing."""
    pace = pace or Pace(location)
    while True:
        try:
            got = _load(location, key, epoch, splits)
            if not isinstance(got, str):
                return got
            if build is None:
                raise refuse_damaged(location, epoch, got)
            log.warning("plan %s %s; building it again", location.path(epoch), got)
            build()
            build = None
            continue
        except FileNotFoundError:
            if build is not None:
                build()
                build = None
                continue
            why = failed(location, epoch)
            if why is not None:
                raise PlanError(f"the plan of epoch {epoch} could not be built: {why}") from None
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


def build_and_publish(table: Any, data: specs.DataSpec, location: Location, epoch: int, *,
                      rows: int) -> Footer:
    """Build epoch `epoch`'s plan and put it at `location` (a local build file first: on a
    local store in the same directory, so that the rename is atomic)."""
    root = location.filesystem()[1]
    local = location.local
    if local:
        os.makedirs(root, exist_ok=True)
    path = temp_file(root if local else None)
    try:
        footer = build(table, data, epoch, path, rows=rows)
        publish(location, path, epoch)
        clear_damaged(location, epoch)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return footer


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a reader gets its splits' row ids: a plan location, and whether the reader
    builds a missing plan itself (it does when no sidecar builds for it: tests, tools)."""

    location: Location
    builds: bool = False
    timeout_s: float = PLAN_WAIT_S

    def ids(self, table: Any, data: specs.DataSpec, epoch: int, splits: Sequence[int],
            rows: int, *, pace: Pace | None = None) -> np.ndarray:
        """(len(splits), splitSize) row ids of `splits` in epoch `epoch`, lancedb's order."""
        def build_here() -> None:
            build_and_publish(table, data, self.location, epoch, rows=rows)

        return wait_for(self.location, PlanKey.of(data), epoch, splits, timeout_s=self.timeout_s,
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
