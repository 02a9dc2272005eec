"""Reading a rank's splits from LanceDB, columnar, in StreamingDataset's order.

`lancedb.streaming.StreamingDataset` defines the order: its permutation table,
its rank/worker split assignment, one row per split per cycle. Iterating it
yields one Python dict per row, and it builds the whole permutation and opens
each split at O(table rows) in every process: fine for thousands of rows, minutes
and gigabytes for 10^7-10^9. So a plain job reads each epoch's permutation from a
plan file (sidecar/data/plans.py: built once, by lancedb's own builder with
StreamingDataset's arguments), loads only its splits' row ids, and takes rows by
id in the reference order, several takes in flight (sidecar/data/takes.py). Jobs with a
transform, packing or onTransformError=skip/warn still read through
StreamingDataset itself, up to MAX_PREPROCESSED_ROWS. Tests compare every batch
with StreamingDataset's own in-process iteration, which catches any drift of the
pinned lancedb.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import typing
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import lancedb
import numpy as np
import pyarrow as pa
from lancedb.permutation import Permutation, Transforms

from splitfeed.trainer_client.contract import errors, specs, topology

if TYPE_CHECKING:
    from lancedb.streaming import StreamingDataset

from . import batching, cgroups, plans, positions, preprocessing, storage_errors, takes

log = logging.getLogger(__name__)


def open_table(
    data: specs.DataSpec,
    storage_options: Mapping[str, str] | None = None,
    version: int | str | None = None,
) -> Any:
    """Open `data.table` at `data.uri`, checked out at `version` (default `data.version`).

    Both None: the latest version, not checked out. A missing table, column,
    version or tag is a DataError: the job never falls back to another version.
    A uri that cannot be opened stays a plain UserError: credentials or the
    network may come back, so the operator's restart budget applies.
    """
    options = {**data.storage_options, **(storage_options or {})}
    if not remote(data.uri):
        takes.prefer_local_scans()  # before the process's first scan or take, which fix it
    try:
        db = lancedb.connect(data.uri, storage_options=options or None)
        names = list(db.table_names())
    except Exception as exc:  # lancedb raises many kinds for a bad uri / credentials
        raise errors.UserError(
            f"cannot open LanceDB at spec.data.uri={data.uri!r}: {storage_errors.explain(exc, uri=data.uri)}"
        ) from exc
    if data.table not in names:
        raise errors.DataError(
            f"table spec.data.table={data.table!r} does not exist at {data.uri!r} "
            f"(tables there: {names or 'none'})"
        )
    try:
        table = db.open_table(data.table)
    except Exception as exc:  # listing may pass where reading does not (unsigned, say)
        raise errors.UserError(
            f"cannot open table {data.table!r} at spec.data.uri={data.uri!r}: "
            f"{storage_errors.explain(exc, uri=data.uri)}"
        ) from exc
    wanted = data.version if version is None else version
    if wanted is not None:
        _checkout(table, data, wanted)
    if data.columns:
        missing = sorted(set(data.columns) - set(table.schema.names))
        if missing:
            raise errors.DataError(
                f"spec.data.columns names {missing}, which table {data.table!r} lacks "
                f"(its columns: {table.schema.names})"
            )
    return table


def table_version(table: Any) -> int:
    """The version number a table (checked out or not) reads."""
    return int(table.version)


def pin(
    data: specs.DataSpec,
    storage_options: Mapping[str, str] | None = None,
    *,
    pinned: int | None = None,
) -> tuple[Any, specs.DataSpec]:
    """The job's table, checked out at the version it reads start to end, and `data`
    with `version` set to that number (what workers and checkpoints then use).

    The version is `pinned` when the job already fixed one (status, checkpoints),
    else `data.version` (a tag resolves to its number), else the latest.
    """
    table = open_table(data, storage_options, version=pinned)
    number = table_version(table)
    if pinned is None and data.version is None:
        _checkout(table, data, number)  # stop tracking the latest version
    return table, dataclasses.replace(data, version=number)


def _versions(table: Any) -> list[int]:
    try:
        return sorted(int(v["version"]) for v in table.list_versions())
    except Exception:  # noqa: BLE001 - only for the message
        return []


def version_gone(data: specs.DataSpec, version: int | str, versions: list[int]) -> errors.DataError:
    """The error a job gets when the table version it reads no longer exists."""
    what = f"tag {version!r}" if isinstance(version, str) else f"version {version}"
    held = f"versions {versions[0]}..{versions[-1]}" if versions else "no readable versions"
    return errors.DataError(
        f"table {data.table!r} at {data.uri!r}: {what}, which this job reads from start to "
        f"end, does not exist (the table now holds {held}); it was removed by "
        "cleanup_old_versions / optimize(cleanup_older_than=...) or compaction, or never "
        "existed. splitfeed never falls back to the latest version. To keep a version for a "
        "job, tag it (table.tags.create(name, version): tagged versions are never cleaned up) "
        "and set spec.data.version to the tag, or keep versions longer than jobs run; to "
        "train on the current data, create a new StreamingJob"
    )


def _checkout(table: Any, data: specs.DataSpec, version: int | str) -> None:
    try:
        table.checkout(version)
    except (ValueError, RuntimeError) as exc:  # lancedb: "Version ... no longer exists", tag not found
        raise version_gone(data, version, _versions(table)) from exc


@contextlib.contextmanager
def _version_guard(table: Any, data: specs.DataSpec) -> Iterator[None]:
    """Turn a read failure caused by the checked-out version vanishing into a DataError."""
    try:
        yield
    except (RuntimeError, OSError, ValueError) as exc:
        versions = _versions(table)
        current = table_version(table)
        if versions and current not in versions:
            raise version_gone(data, current, versions) from exc
        raise


def reference_dataset(
    table: Any, data: specs.DataSpec, *, epoch: int, rank: int, world_size: int
) -> StreamingDataset:
    """The StreamingDataset whose in-process order is the determinism contract."""
    from lancedb.streaming import StreamingDataset  # torch, 180 MiB: only for the jobs it reads

    return StreamingDataset(table, epoch=epoch, rank=rank, world_size=world_size, **_order_arguments(data))


def _order_arguments(data: specs.DataSpec) -> dict[str, Any]:
    """The spec's fields that fix StreamingDataset's order, as its keyword arguments."""
    return dict(
        num_splits=data.num_splits,
        shuffle=data.shuffle,
        shuffle_seed=data.shuffle_seed,
        columns=list(data.columns) if data.columns else None,
        filter=data.filter,
        shuffle_clump_size=data.shuffle_clump_size or None,
        read_batch_size=data.read_batch_size,
    )


@dataclasses.dataclass(frozen=True)
class Layout:
    """The size of every epoch, from a row count: each epoch permutes the same rows."""

    rows: int
    split_size: int
    steps_per_epoch: int


def layout(table: Any, data: specs.DataSpec) -> Layout:
    """Count the (filtered) rows and size the epochs, without building a permutation.

    Raises DataError when the filter does not parse, when the rows cannot fill one
    global step, or when the version the job reads has been cleaned up.
    """
    with _version_guard(table, data):
        return _layout(table, data)


def _layout(table: Any, data: specs.DataSpec) -> Layout:
    where = f" after spec.data.filter={data.filter!r}" if data.filter else ""
    try:
        num_rows = int(table.count_rows(data.filter) if data.filter else table.count_rows())
    except ValueError as exc:  # lancedb: "Invalid input, ... (sql parser error: ...)"
        raise errors.DataError(
            f"cannot apply spec.data.filter={data.filter!r} to table {data.table!r}: {exc}"
        ) from exc
    if num_rows < data.num_splits:
        raise errors.DataError(
            f"table {data.table!r} has {num_rows} rows{where}, fewer than "
            f"spec.data.numSplits={data.num_splits}; loosen the filter or use fewer splits"
        )
    split_size = topology.split_size(num_rows, data.num_splits)
    steps = topology.steps_per_epoch(num_rows, data.num_splits, data.global_batch_size)
    if data.pack_sequences is not None:
        steps = _packed_steps(table, data)
    if steps < 1:
        raise errors.DataError(
            f"table {data.table!r} has {num_rows} rows{where}: {data.num_splits} splits of "
            f"{split_size} rows cannot fill one global step of "
            f"spec.data.globalBatchSize={data.global_batch_size} rows"
        )
    return Layout(num_rows, split_size, steps)


MAX_PREPROCESSED_ROWS = 10_000_000
"""Transform, packing and skip jobs read through lancedb's StreamingDataset, whose start
costs O(table rows) per split it reads (measured: 1M rows, 24 splits: ~37 s) and whose
permutation every reader builds again (~16 B a row): past this they are refused."""


def preprocessed_layout(table: Any, data: specs.DataSpec) -> Layout:
    """`layout` for the jobs StreamingDataset reads, refused past MAX_PREPROCESSED_ROWS."""
    sized = layout(table, data)
    if sized.rows > MAX_PREPROCESSED_ROWS:
        kind = "onTransformError=" + data.on_transform_error if data.drops_rows else (
            "spec.data.transform" if data.transform else "spec.data.packSequences")
        raise errors.DataError(
            f"table {data.table!r} has {sized.rows:,} rows: a job with {kind} reads through "
            f"lancedb's StreamingDataset, whose start costs O(table rows) per split, and is "
            f"refused above {MAX_PREPROCESSED_ROWS:,} rows; narrow it with spec.data.filter, or "
            "write the transformed rows to a table and read that without a transform")
    return sized


def sample_row_bytes(table: Any, data: specs.DataSpec, sample: int = 256) -> tuple[int, float]:
    """(columns read, average bytes of a row read) from `sample` rows spread over the table."""
    total = table.count_rows()
    offsets = sorted({int(i) for i in np.linspace(0, max(0, total - 1), min(sample, total))})
    query = table.take_offsets(offsets)
    if data.columns:
        query = query.select(list(data.columns))
    rows = query.to_arrow()
    return rows.num_columns, rows.nbytes / max(1, rows.num_rows)


def import_streaming() -> None:
    """Import lancedb.streaming (and torch) now: a fork server does it once for its children."""
    import lancedb.streaming  # noqa: F401


def remote(uri: str) -> bool:
    """An object store (s3://, gs://, az://, ...): its reads wait on the network, not a CPU."""
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    return scheme not in ("", "file")


def reads_plans(data: specs.DataSpec) -> bool:
    """A plain job (no transform, packing or skip): read from plan files by row id."""
    return not data.transform and data.pack_sequences is None


def job_layout(table: Any, data: specs.DataSpec) -> Layout:
    """The job's epoch size: `layout`, refused past its limit for the StreamingDataset jobs."""
    return layout(table, data) if reads_plans(data) else preprocessed_layout(table, data)


def iter_blocks(
    table: Any,
    data: specs.DataSpec,
    splits: Sequence[int],
    *,
    start_global_step: int,
    stop_global_step: int | None = None,
    resume_state: Mapping[str, Any] | None = None,
    plan: plans.Source | None = None,
) -> Generator[tuple[int, pa.RecordBatch], None, None]:
    """Yield (global_step, block) for `splits`: G/N cycles over them, reference order.

    `splits` is a rank's block (one sidecar, numWorkers=1) or a worker's
    sub-block; blocks of a rank's workers are merged with batching.interleave.
    Runs through every epoch of the job unless `stop_global_step` comes first.
    Plain jobs read the row ids of `splits` from each epoch's `plan` (without one, this
    reader builds the plans it needs itself); transform, packing and skip jobs read
    through StreamingDataset. Under onTransformError=skip/warn an epoch may end early
    (see `_iter_skipping`), each block carries its splits' positions (`take_positions`),
    and a resume mid-epoch needs the checkpoint's merged `resume_state`.
    """
    with _version_guard(table, data):
        if data.drops_rows:
            yield from _iter_skipping(table, data, splits, start_global_step, stop_global_step,
                                      resume_state)
        elif not reads_plans(data):
            yield from _iter_preprocessed(table, data, splits, start_global_step, stop_global_step)
        else:
            if not isinstance(data.version, int):  # a caller that did not pin: this reader's version
                data = dataclasses.replace(data, version=table_version(table))
            source = plan or plans.Source(plans.location_for(data, None), builds=True)
            yield from _iter_planned(table, data, splits, start_global_step, stop_global_step, source)


def step_order(ids: np.ndarray, first: int, steps: int, per_step: int) -> np.ndarray:
    """Row ids of `steps` steps from step `first`, in StreamingDataset's order: per step,
    per cycle, one row of each split. `ids` is (splits, split size), a plan's rows."""
    block = ids[:, first * per_step:(first + steps) * per_step]
    return block.reshape(len(ids), steps, per_step).transpose(1, 2, 0).ravel()


def _epochs_ids(table: Any, data: specs.DataSpec, plan: plans.Source, splits: Sequence[int], rows: int,
                epochs: range) -> Generator[tuple[int, np.ndarray] | takes.Barrier, None, None]:
    """(epoch, row ids of `splits`) of each of `epochs`: the first loaded here, each next one
    in a thread while the one before is read (plans.Ahead), with a Barrier before one whose
    plan is not there yet (the planner builds it once a step of the epoch before is published)."""
    ahead: plans.Ahead | None = None
    try:
        for epoch in epochs:
            if ahead is None:
                ids = plan.ids(table, data, epoch, splits, rows)
            else:
                if not ahead.arrived():
                    ahead.need()
                    yield takes.Barrier(ahead.arrived)
                ids = ahead.ids()
            ahead = plan.ahead(table, data, epoch + 1, splits, rows) if epoch + 1 in epochs else None
            yield epoch, ids
            del ids
    finally:
        if ahead is not None:
            ahead.close()


def _iter_planned(
    table: Any, data: specs.DataSpec, splits: Sequence[int], start_global_step: int,
    stop_global_step: int | None, plan: plans.Source,
) -> Generator[tuple[int, pa.RecordBatch], None, None]:
    """iter_blocks for a plain job: takes by row id from the epoch's plan, several in flight.

    One take serves `steps_per_take` whole steps of every split of `splits` (at least
    readBatchSize rows of each split), asked in the reference order, so its rows are the
    steps' blocks as they are (fewer steps once rows are known to be large: a take
    stays under takes.TAKE_BYTES). Takes run ahead across steps and epochs up to
    spec.data.readAheadBytes (takes.Takes); the next epoch's row ids are loaded in the
    background once an epoch's are (plans.Ahead), so two epochs' ids are held. The
    planner builds the next epochs' plans once a step of epoch e is published, so reads
    run ahead into an epoch whose plan is not there yet only once it arrives
    (takes.Barrier).
    """
    sized = layout(table, data)
    per_step = topology.rows_per_split_per_step(data.global_batch_size, data.num_splits)
    spe = sized.steps_per_epoch
    steps_per_take = max(1, -(-data.read_batch_size // per_step))
    end = data.epochs * spe if stop_global_step is None else min(stop_global_step, data.epochs * spe)
    rows_per_step = per_step * len(splits)

    def requests() -> Generator[tuple[tuple[int, int], np.ndarray] | takes.Barrier, None, None]:
        epochs = range(start_global_step // spe, -(-end // spe)) if start_global_step < end else range(0)
        loaded = _epochs_ids(table, data, plan, splits, sized.rows, epochs)
        try:
            for item in loaded:
                if isinstance(item, takes.Barrier):
                    yield item
                    continue
                epoch, ids = item
                first, last = max(0, start_global_step - epoch * spe), min(spe, end - epoch * spe)
                while first < last:
                    count = min(taken.steps_per_take(steps_per_take, rows_per_step), last - first)
                    yield (epoch * spe + first, count), step_order(ids, first, count, per_step)
                    first += count
                del ids, item
        finally:
            loaded.close()

    # Each of the numWorkers loaders reads ahead its share: together they hold readAheadBytes.
    budget = specs.parse_quantity_bytes(str(data.read_ahead_bytes), "spec.data.readAheadBytes")
    asked = requests()
    taken = takes.Takes(table, data.columns, asked, max(1, budget // max(1, data.num_workers)),
                        clump=data.shuffle_clump_size,
                        cpus=None if remote(data.uri) else max(1, cgroups.process_cpus() // data.num_workers),
                        scans=not remote(data.uri))
    try:
        for (first, count), rows in taken:
            for i in range(count):
                yield first + i, rows.slice(i * rows_per_step, rows_per_step)
    finally:
        taken.close()
        asked.close()  # and its next epoch's ids stop loading


# --- transforms and packing: lancedb's StreamingDataset does the work ---------------


def blocks_per_epoch(table: Any, data: specs.DataSpec) -> int:
    """packSequences.blocksPerEpoch, with "auto" estimated by lancedb from epoch 0.

    lancedb re-estimates "auto" for each epoch's permutation; splitfeed fixes the
    epoch-0 estimate for the whole job, so that every epoch has the same number
    of steps and a global step maps to one (epoch, step).
    """
    pack = data.pack_sequences
    if pack is None:
        raise ValueError("the job does not pack sequences")
    if pack.blocks_per_epoch != "auto":
        return int(pack.blocks_per_epoch)
    dataset = _streaming_dataset(table, data, epoch=0, rank=0, world_size=1, transform=None,
                                 blocks="auto")
    return int(cast(int, dataset._blocks_per_epoch))  # lancedb's __init__ resolved "auto"


def _packed_steps(table: Any, data: specs.DataSpec) -> int:
    blocks = blocks_per_epoch(table, data)
    steps = (blocks // data.num_splits) // topology.rows_per_split_per_step(
        data.global_batch_size, data.num_splits
    )
    if steps < 1:
        raise errors.DataError(
            f"spec.data.packSequences.blocksPerEpoch={blocks}: {blocks // data.num_splits} "
            f"blocks per split cannot fill one global step of spec.data.globalBatchSize="
            f"{data.global_batch_size} blocks"
        )
    return steps


def transform_parallelism(data: specs.DataSpec, cpus: int) -> int:
    """spec.data.transformParallelism, or the `cpus` this sidecar may use shared among its
    numWorkers loader processes (each runs its own StreamingDataset and thread pool)."""
    if data.transform_parallelism is not None:
        return data.transform_parallelism
    return max(1, -(-cpus // data.num_workers))


def _streaming_dataset(
    table: Any, data: specs.DataSpec, *, epoch: int, rank: int, world_size: int,
    transform: Any, blocks: int | str | None,
) -> StreamingDataset:
    """reference_dataset plus the job's transform or packing."""
    pack = data.pack_sequences
    arguments = _order_arguments(data)
    if pack is not None:
        arguments.update(columns=[pack.column], pack_sequences=pack.block_size, eos_id=pack.eos_id,
                         pad_id=pack.pad_id, blocks_per_epoch=blocks)
    try:
        from lancedb.streaming import StreamingDataset

        return StreamingDataset(
            table,
            epoch=epoch,
            rank=rank,
            world_size=world_size,
            transform=transform,
            transform_parallelism=transform_parallelism(data, cgroups.process_cpus()),
            transform_queue_depth=data.transform_queue_depth,
            **arguments,
        )
    except ValueError as exc:  # lancedb's checks of packing arguments against the table
        raise errors.DataError(f"spec.data.packSequences: {exc}") from exc


def _iter_preprocessed(
    table: Any, data: specs.DataSpec, splits: Sequence[int], start_global_step: int,
    stop_global_step: int | None,
) -> Generator[tuple[int, pa.RecordBatch], None, None]:
    """iter_blocks for a job with a transform or packing: StreamingDataset's own rows.

    `splits` (a rank's block or a worker's sub-block) is exactly what rank
    splits[0]/m of a world of N/m ranks owns (m = len(splits)), so that
    StreamingDataset yields the block's rows, transformed in its thread pool, in
    the reference order; a step is the next G/N cycles of them. A transform job
    resumes with load_state_dict at the step boundary; a packing job replays the
    epoch's packing up to it (packing state is token buffers, not a position).
    """
    m = len(splits)
    cycles = topology.rows_per_split_per_step(data.global_batch_size, data.num_splits)
    per_step = cycles * m
    name = data.transform or ""
    guarded = (
        preprocessing.Guarded(preprocessing.load_transform(data), name) if data.transform else None
    )
    blocks = blocks_per_epoch(table, data) if data.pack_sequences is not None else None
    spe = preprocessed_layout(table, data).steps_per_epoch
    end = data.epochs * spe if stop_global_step is None else min(stop_global_step, data.epochs * spe)
    global_step = start_global_step
    while global_step < end:
        pos = positions.position_of(global_step, spe)
        dataset = _streaming_dataset(
            table, data, epoch=pos.epoch, rank=splits[0] // m, world_size=data.num_splits // m,
            transform=guarded, blocks=blocks,
        )
        if guarded is not None and pos.step:
            dataset.load_state_dict(positions.state_dict(data, pos))
        rows_iter = iter(dataset)
        try:
            if guarded is None and pos.step:
                for _ in itertools.islice(rows_iter, pos.step * per_step):
                    pass  # replay the packing of the epoch's earlier steps
            for step in range(pos.step, spe):
                if global_step >= end:
                    return
                rows = list(itertools.islice(rows_iter, per_step))
                if len(rows) != per_step:
                    raise errors.SidecarFailed(
                        f"StreamingDataset ended at step {step} of epoch {pos.epoch} "
                        f"for splits {list(splits)} ({len(rows)} of {per_step} rows)"
                    )
                if guarded is not None:
                    rows = _settle_failures(table, data, Epoch(pos.epoch, dataset._perm_table),
                                            splits, guarded, rows, step=step, global_step=global_step)
                yield global_step, preprocessing.collate(rows, name or "packSequences")
                global_step += 1
        finally:
            close = getattr(rows_iter, "close", None)
            if close is not None:
                close()


class Epoch(typing.NamedTuple):
    """An epoch and its permutation, as the StreamingDataset reading it built it."""

    epoch: int
    permutation_table: Any


FILLED_ROWS = [0]
"""Rows substituted by onTransformError=fill in this process (reported by the sidecar)."""


def _settle_failures(
    table: Any, data: specs.DataSpec, layout: Epoch, splits: Sequence[int],
    guarded: preprocessing.Guarded, rows: list[Any], *, step: int, global_step: int,
) -> list[Any]:
    """Raise for a failed row (raise), or replace it by its substitute (fill).

    Row j of a step is cycle j // m of split splits[j % m], which sits at
    position step*G/N + j // m of its split (no row is ever dropped).
    """
    m = len(splits)
    cycles = topology.rows_per_split_per_step(data.global_batch_size, data.num_splits)
    for j, row in enumerate(rows):
        if not isinstance(row, preprocessing.Failed):
            continue
        split, position = splits[j % m], step * cycles + j // m
        if data.on_transform_error != "fill":
            raise preprocessing.failure_error(
                guarded.name, row, epoch=layout.epoch, split=split, position=position,
                global_step=global_step,
            ) from row.error
        rows[j] = _substitute(table, data, layout, split, position, guarded)
        FILLED_ROWS[0] += 1
        log.warning(
            "spec.data.transform=%r failed on position %d of split %d in epoch %d (%s: %s); "
            "filled with the next good row of the split",
            guarded.name, position, split, layout.epoch, type(row.error).__name__, row.error,
        )
    return rows


def _substitute(
    table: Any, data: specs.DataSpec, layout: Epoch, split: int, position: int,
    guarded: preprocessing.Guarded,
) -> Any:
    """The fill row for `position` of `split`: the output of the split's next row whose
    transform succeeds, wrapping to the split's start. It depends on the position alone
    (not on read batches, ranks or workers), so every topology and resume sees the same."""
    perm = Permutation.from_tables(table, layout.permutation_table, split=split)
    if data.columns:
        perm = perm.select_columns(list(data.columns))
    perm = perm.with_transform(Transforms.arrow2arrow)
    size = perm.num_rows
    order = [(position + k) % size for k in range(1, size)]
    for start in range(0, len(order), data.read_batch_size):
        batch = perm.__getitems__(order[start:start + data.read_batch_size])
        for row in guarded(batch):
            if not isinstance(row, preprocessing.Failed):
                return row
    raise errors.DataError(
        f"spec.data.transform={guarded.name!r} fails on every row of split {split} in epoch "
        f"{layout.epoch}: onTransformError=fill has no row to substitute"
    )


def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """lancedb's own merge of per-rank states into one topology-free state.

    A plain job's ranks all write the same state at a step (positions.state_dict), which
    lancedb's merge returns as it is (tests/reading/test_checkpoints.py checks that);
    not importing lancedb.streaming for it keeps torch (180 MiB) out of such sidecars.
    """
    if states and all(state == states[0] for state in states[1:]):
        return dict(states[0])
    from lancedb.streaming import StreamingDataset

    return StreamingDataset.merge_state_dicts(states)


# --- onTransformError=skip / warn ------------------------------------------------------

SKIPPED_ROWS = [0]
"""Rows dropped by onTransformError=skip/warn before the rows of the steps this sidecar
published (counted by the sidecar as it publishes, from each step's `Passed.skipped`)."""

POSITIONS_KEY = b"splitfeed.positions"
"""Schema metadata of a skip job's block: JSON {"at": [[split, position], ...], "skipped": n},
each split's permutation position after the block's last row (lancedb's
positions_consumed_per_split) and the failing rows dropped in between. Only between the
reader and the sidecar: `take_positions` strips it before the ring."""


class Passed(typing.NamedTuple):
    """What a skip job's step passed: its splits' positions after it, and the rows dropped."""

    at: dict[int, int]
    skipped: int


def take_positions(block: pa.RecordBatch) -> tuple[pa.RecordBatch, Passed | None]:
    """A block without its positions metadata, and what it passed (None for other jobs)."""
    metadata = block.schema.metadata or {}
    if POSITIONS_KEY not in metadata:
        return block, None
    found = json.loads(metadata[POSITIONS_KEY])
    rest = {k: v for k, v in metadata.items() if k != POSITIONS_KEY}
    passed = Passed({int(s): int(p) for s, p in found["at"]}, int(found["skipped"]))
    return block.replace_schema_metadata(rest or None), passed


def _put_positions(block: pa.RecordBatch, passed: Passed) -> pa.RecordBatch:
    """`block` carrying what its step passed in its POSITIONS_KEY metadata (`take_positions` reads it)."""
    found = {"at": sorted(passed.at.items()), "skipped": passed.skipped}
    metadata = {**(block.schema.metadata or {}), POSITIONS_KEY: json.dumps(found).encode()}
    return block.replace_schema_metadata(metadata)


def split_starts(data: specs.DataSpec, splits: Sequence[int], pos: positions.Position,
                 state: Mapping[str, Any] | None) -> list[int]:
    """Where each split of `splits` resumes in the epoch of `pos` under skip: 0 at an epoch
    start, else the checkpoint's per-split positions (a step no longer fixes them)."""
    if pos.step == 0:
        return [0] * len(splits)
    if state is None:
        raise errors.UserError(
            f"onTransformError={data.on_transform_error}: resuming at step {pos.step} of epoch "
            f"{pos.epoch} needs the checkpoint's per-split positions, and none was given")
    found = positions.position_from_state(data, state)
    if found != pos:
        raise errors.UserError(
            f"the checkpoint holds epoch {found.epoch} step {found.step}, not epoch {pos.epoch} "
            f"step {pos.step}")
    at = list(state["positions_consumed_per_split"])
    return [int(at[s]) for s in splits]


def _iter_skipping(
    table: Any, data: specs.DataSpec, splits: Sequence[int], start_global_step: int,
    stop_global_step: int | None, resume_state: Mapping[str, Any] | None,
) -> Generator[tuple[int, pa.RecordBatch], None, None]:
    """iter_blocks under onTransformError=skip/warn: lancedb's skip order, numbered on a grid.

    lancedb runs `Guarded`, so every row arrives (a failing one as a marker at its
    split and absolute position). Each split's surviving rows queue up in permutation
    order, and a step takes G/N of them from every split: cycle c of split s is its
    c-th survivor, which is what StreamingDataset(on_transform_error="skip") yields.
    These splits' epoch ends at the first step one of them cannot fill; global steps
    keep the grid epoch * stepsPerEpoch + step (stepsPerEpoch as without skips), so a
    step's (epoch, step) never depends on the data, and the steps an epoch lost are
    simply absent. The world stops each epoch at the smallest end of all its ranks
    (agreement.py's watermark), which is a prefix of what this yields.
    """
    m = len(splits)
    cycles = topology.rows_per_split_per_step(data.global_batch_size, data.num_splits)
    name = data.transform or ""
    guarded = preprocessing.Guarded(preprocessing.load_transform(data), name)
    spe = preprocessed_layout(table, data).steps_per_epoch
    end = data.epochs * spe if stop_global_step is None else min(stop_global_step, data.epochs * spe)
    global_step = start_global_step
    state = resume_state
    while global_step < end:
        pos = positions.position_of(global_step, spe)
        starts = split_starts(data, splits, pos, state)
        state = None  # only the first epoch resumes mid-way
        floor = min(starts, default=0)
        rows_iter = _skipping_rows(table, data, splits, pos, floor, guarded)
        try:
            epoch_steps = _skipping_epoch(rows_iter, data, splits, starts, cycles, pos.epoch,
                                          name, floor)
            for step in range(pos.step, spe):
                if global_step >= end:
                    return
                taken = next(epoch_steps, None)
                if taken is None:
                    break  # a split of these ran dry: this epoch ends here
                rows, at, skipped = taken
                yield global_step, _put_positions(preprocessing.collate(rows, name), Passed(at, skipped))
                global_step += 1
            global_step = (pos.epoch + 1) * spe
        finally:
            close = getattr(rows_iter, "close", None)
            if close is not None:
                close()


def _skipping_rows(
    table: Any, data: specs.DataSpec, splits: Sequence[int], pos: positions.Position, floor: int,
    guarded: preprocessing.Guarded,
) -> Iterator[Any]:
    """lancedb's guarded rows of these splits in the epoch of `pos`, every split from `floor`.

    lancedb's round-robin stops at the first split that runs dry, and under Guarded
    that is the first whose rows run out: resumed at unequal positions, a split
    started early would lose its last rows. Every split resumes at the lowest of
    their positions, `floor` (rows before a split's own are read again and passed
    over), so they still run out together.
    """
    m = len(splits)
    dataset = _streaming_dataset(
        table, data, epoch=pos.epoch, rank=splits[0] // m, world_size=data.num_splits // m,
        transform=guarded, blocks=None,
    )
    if pos.step:
        dataset.load_state_dict(_skip_state(data, pos, splits, [floor] * m))
    return iter(dataset)


def _skip_state(data: specs.DataSpec, pos: positions.Position, splits: Sequence[int],
                starts: Sequence[int]) -> dict[str, Any]:
    """What lancedb resumes these splits from: the uniform row count of `pos`, and each
    split's own position (later than the count by its skipped rows)."""
    return positions.state_after(data, pos, dict(zip(splits, starts)))


def _skipping_epoch(
    rows_iter: Iterator[Any], data: specs.DataSpec, splits: Sequence[int], starts: Sequence[int],
    cycles: int, epoch: int, name: str, first: int = 0,
) -> Iterator[tuple[list[Any], dict[int, int], int]]:
    """Each step's rows (reference order), the splits' positions after it and the rows it
    dropped, until a split cannot give `cycles` more surviving rows. `rows_iter` starts
    every split at position `first`; split i's rows before `starts[i]` were consumed already."""
    m = len(splits)
    ready: list[collections.deque[tuple[int, Any]]] = [collections.deque() for _ in splits]
    failed: list[collections.deque[tuple[int, preprocessing.Failed]]] = [
        collections.deque() for _ in splits]
    next_position = [first] * m
    after = list(starts)
    exhausted = False
    while True:
        while not exhausted and any(len(q) < cycles for q in ready):
            cycle = list(itertools.islice(rows_iter, m))
            if len(cycle) < m:
                exhausted = True  # Guarded drops nothing, so the splits end together
                break
            for i, row in enumerate(cycle):
                if next_position[i] >= starts[i]:
                    where = failed[i] if isinstance(row, preprocessing.Failed) else ready[i]
                    where.append((next_position[i], row))
                next_position[i] += 1
        if any(len(q) < cycles for q in ready):
            return
        taken = [[ready[i].popleft() for _ in range(cycles)] for i in range(m)]
        skipped = 0
        for i in range(m):
            after[i] = taken[i][-1][0] + 1
            while failed[i] and failed[i][0][0] < after[i]:
                position, row = failed[i].popleft()
                _skipped(data, name, epoch, splits[i], position, row)
                skipped += 1
        rows = [taken[i][c][1] for c in range(cycles) for i in range(m)]
        yield rows, {splits[i]: after[i] for i in range(m)}, skipped


def _skipped(data: specs.DataSpec, name: str, epoch: int, split: int, position: int,
             row: preprocessing.Failed) -> None:
    if data.on_transform_error == "warn":
        log.warning(
            "spec.data.transform=%r failed on position %d of split %d in epoch %d (%s: %s); "
            "row skipped", name, position, split, epoch, type(row.error).__name__, row.error)
