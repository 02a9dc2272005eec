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

This module is the file and its place; building one and waiting for one is
sidecar/table/planning.py.

Where plans live: with spec.checkpoint.uri, next to the job's checkpoints
(`<job uid>/plans/<key digest>/`), built by the world's coordinator and read by
every sidecar of every later world; without it, in a directory of the sidecar's
own, built by each sidecar for itself.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import pyarrow.fs as pafs

from splitfeed.trainer_client.contract import errors, specs

log = logging.getLogger(__name__)

FORMAT = 1
MAGIC = b"SFPLAN01"
_TAIL = struct.Struct("<Q8s")  # footer length, MAGIC
ID_BYTES = 8


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


def write_footer(out: Any, footer: Footer) -> None:
    """End a plan file whose ids are written: the JSON footer, its length and MAGIC (`_read_footer`)."""
    blob = json.dumps(dataclasses.asdict(footer)).encode()
    out.write(blob)
    out.write(_TAIL.pack(len(blob), MAGIC))


def _check_key(footer: Footer, key: PlanKey, epoch: int, path: str) -> None:
    ours = key.fields()
    differs = sorted(k for k in ours if footer.key.get(k) != ours[k])
    if differs or footer.epoch != epoch:
        raise PlanError(
            f"plan {path} was built for other data ({', '.join(differs) or 'epoch'} differ): "
            "it is never used for this job")


def load_splits(location: Location, key: PlanKey, epoch: int, splits: Sequence[int]) -> np.ndarray | str:
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
    got = load_splits(location, key, epoch, splits)
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
