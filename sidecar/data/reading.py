"""Reading a rank's splits from LanceDB, columnar, in StreamingDataset's order.

`lancedb.streaming.StreamingDataset` defines the order: its permutation table,
its rank/worker split assignment, one row per split per cycle. Iterating it
yields one Python dict per row, and it builds the whole permutation and opens
each split at O(table rows) in every process: fine for thousands of rows, minutes
and gigabytes for 10^7-10^9. So a plain job reads each epoch's permutation from a
plan file (sidecar/table/plans.py: built once, by lancedb's own builder with
StreamingDataset's arguments, sidecar/table/planning.py), loads only its splits' row ids, and
takes rows by id in the reference order, several takes in flight (sidecar/table/takes.py). Jobs
with a transform, packing or onTransformError=skip/warn still read through StreamingDataset
itself (sidecar/data/streaming.py; a skip job's positions: sidecar/data/skipping.py), up to
MAX_PREPROCESSED_ROWS. Tests compare every batch with StreamingDataset's own in-process
iteration, which catches any drift of the pinned lancedb. Here: opening and pinning the
table, sizing its epochs (`layout`, which builds the job's `geometry.Geometry`), and the
rank reader `iter_blocks`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import typing
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any

import lancedb
import numpy as np
import pyarrow as pa
from lancedb.permutation import Permutation, Transforms

from splitfeed.trainer_client.contract import errors, geometry, specs, topology

from . import positions, preprocessing, skipping, streaming
from ..table import cgroups, planning, plans, storage_errors, takes

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


@dataclasses.dataclass(frozen=True)
class Layout:
    """The size of every epoch, from a row count: each epoch permutes the same rows."""

    rows: int
    split_size: int
    geometry: geometry.Geometry
    """The job's geometry, sized: its steps_per_epoch is set."""

    @property
    def steps_per_epoch(self) -> int:
        """Whole global steps in every epoch."""
        steps = self.geometry.steps_per_epoch
        assert steps is not None  # built from a row count (`_layout`)
        return steps


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
    sized = geometry.Geometry.of(data, rows=num_rows)
    if data.pack_sequences is not None:
        sized = _packed_geometry(table, data)
    if sized.steps_per_epoch is None or sized.steps_per_epoch < 1:
        raise errors.DataError(
            f"table {data.table!r} has {num_rows} rows{where}: {data.num_splits} splits of "
            f"{split_size} rows cannot fill one global step of "
            f"spec.data.globalBatchSize={data.global_batch_size} rows"
        )
    return Layout(num_rows, split_size, sized)


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
    plan: planning.Source | None = None,
) -> Generator[tuple[int, pa.RecordBatch], None, None]:
    """Yield (global_step, block) for `splits`: G/N cycles over them, reference order.

    `splits` is a rank's block (one sidecar, numWorkers=1) or a worker's
    sub-block; blocks of a rank's workers are merged with batching.interleave.
    Runs through every epoch of the job unless `stop_global_step` comes first.
    Plain jobs read the row ids of `splits` from each epoch's `plan` (without one, this
    reader builds the plans it needs itself); transform, packing and skip jobs read
    through StreamingDataset. Under onTransformError=skip/warn an epoch may end early
    (see `_iter_skipping`), each block carries its splits' positions (`skipping.take_positions`),
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
            source = plan or planning.Source(plans.location_for(data, None), builds=True)
            yield from _iter_planned(table, data, splits, start_global_step, stop_global_step, source)


def step_order(ids: np.ndarray, first: int, steps: int, per_step: int) -> np.ndarray:
    """Row ids of `steps` steps from step `first`, in StreamingDataset's order: per step,
    per cycle, one row of each split. `ids` is (splits, split size), a plan's rows."""
    block = ids[:, first * per_step:(first + steps) * per_step]
    return block.reshape(len(ids), steps, per_step).transpose(1, 2, 0).ravel()


def _epochs_ids(table: Any, data: specs.DataSpec, plan: planning.Source, splits: Sequence[int], rows: int,
                epochs: range) -> Generator[tuple[int, np.ndarray] | takes.Barrier, None, None]:
    """(epoch, row ids of `splits`) of each of `epochs`: the first loaded here, each next one
    in a thread while the one before is read (planning.Ahead), with a Barrier before one whose
    plan is not there yet (the planner builds it once a step of the epoch before is published)."""
    ahead: planning.Ahead | None = None
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
    stop_global_step: int | None, plan: planning.Source,
) -> Generator[tuple[int, pa.RecordBatch], None, None]:
    """iter_blocks for a plain job: takes by row id from the epoch's plan, several in flight.

    One take serves `steps_per_take` whole steps of every split of `splits` (at least
    readBatchSize rows of each split), asked in the reference order, so its rows are the
    steps' blocks as they are (fewer steps once rows are known to be large: a take
    stays under takes.TAKE_BYTES). Takes run ahead across steps and epochs up to
    spec.data.readAheadBytes (takes.Takes); the next epoch's row ids are loaded in the
    background once an epoch's are (planning.Ahead), so two epochs' ids are held. The
    planner builds the next epochs' plans once a step of epoch e is published, so reads
    run ahead into an epoch whose plan is not there yet only once it arrives
    (takes.Barrier).
    """
    sized = layout(table, data)
    per_step = sized.geometry.rows_per_split_per_step
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


def _packed_geometry(table: Any, data: specs.DataSpec) -> geometry.Geometry:
    """A packing job's geometry: its epochs are of packed blocks (`streaming.blocks_per_epoch`)."""
    blocks = streaming.blocks_per_epoch(table, data)
    sized = geometry.Geometry.of(data, rows=blocks)
    if sized.steps_per_epoch is None or sized.steps_per_epoch < 1:
        raise errors.DataError(
            f"spec.data.packSequences.blocksPerEpoch={blocks}: {blocks // data.num_splits} "
            f"blocks per split cannot fill one global step of spec.data.globalBatchSize="
            f"{data.global_batch_size} blocks"
        )
    return sized


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
    name = data.transform or ""
    guarded = (
        preprocessing.Guarded(preprocessing.load_transform(data), name) if data.transform else None
    )
    blocks = streaming.blocks_per_epoch(table, data) if data.pack_sequences is not None else None
    sized = preprocessed_layout(table, data)
    spe, per_step = sized.steps_per_epoch, sized.geometry.rows_per_split_per_step * m
    end = data.epochs * spe if stop_global_step is None else min(stop_global_step, data.epochs * spe)
    global_step = start_global_step
    while global_step < end:
        pos = positions.position_of(global_step, spe)
        dataset = streaming.streaming_dataset(
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
                                            splits, guarded, rows, step=step, global_step=global_step,
                                            cycles=sized.geometry.rows_per_split_per_step)
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
    guarded: preprocessing.Guarded, rows: list[Any], *, step: int, global_step: int, cycles: int,
) -> list[Any]:
    """Raise for a failed row (raise), or replace it by its substitute (fill).

    Row j of a step is cycle j // m of split splits[j % m], which sits at
    position step*G/N + j // m of its split (no row is ever dropped); `cycles` is G/N.
    """
    m = len(splits)
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


# --- onTransformError=skip / warn ------------------------------------------------------


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
    name = data.transform or ""
    guarded = preprocessing.Guarded(preprocessing.load_transform(data), name)
    sized = preprocessed_layout(table, data)
    spe, cycles = sized.steps_per_epoch, sized.geometry.rows_per_split_per_step
    end = data.epochs * spe if stop_global_step is None else min(stop_global_step, data.epochs * spe)
    global_step = start_global_step
    state = resume_state
    while global_step < end:
        pos = positions.position_of(global_step, spe)
        starts = skipping.split_starts(data, splits, pos, state)
        state = None  # only the first epoch resumes mid-way
        floor = min(starts, default=0)
        rows_iter = skipping.guarded_rows(table, data, splits, pos, floor, guarded)
        try:
            epoch_steps = skipping.epoch_steps(rows_iter, data, splits, starts, cycles, pos.epoch,
                                               name, floor)
            for step in range(pos.step, spe):
                if global_step >= end:
                    return
                taken = next(epoch_steps, None)
                if taken is None:
                    break  # a split of these ran dry: this epoch ends here
                rows, at, skipped = taken
                yield global_step, skipping.put_positions(preprocessing.collate(rows, name),
                                                          skipping.Passed(at, skipped))
                global_step += 1
            global_step = (pos.epoch + 1) * spe
        finally:
            close = getattr(rows_iter, "close", None)
            if close is not None:
                close()
