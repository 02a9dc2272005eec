"""A rank's batches, read in-process or by loader worker processes.

Called by the sidecar's serving loop (and by the data-plane tests). With
`numWorkers: 1` the caller's thread reads (the sidecar runs it in a background
thread); with K > 1,
K spawned processes each read a contiguous sub-block of the rank's splits and
the parent merges their blocks with `batching.interleave`, which yields the
same rows in the same order as one reader would (the determinism contract in
docs/architecture.md does not depend on K).

Worker processes exist because decoding and copying Arrow data holds the GIL
for part of each read. They are not forked from the sidecar, whose lancedb Rust
runtime (its thread pool and object-store clients) is running and not fork-safe,
but from multiprocessing's 'forkserver': a server process started once per
sidecar that imports this module (lancedb, and torch through lancedb.streaming for the jobs
it reads)
and runs nothing, then forks each worker. A spawned worker spent seconds of CPU
on those imports, per worker and per world; a forked one starts at once. Forking
after imports alone is safe for the reason local/forkserver.py gives. Blocks
travel as Arrow IPC bytes over a one-way Pipe: self-describing, no pickle of
user data, and the pipe's small buffer keeps each worker about one step ahead.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import struct
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import pyarrow as pa

from splitfeed.trainer_client.contract import errors, geometry, specs, topology

from ..data import batching, reading, skipping
from ..table import planning, plans
from .forking import FORK_WARNING

log = logging.getLogger(__name__)

warnings.filterwarnings("ignore", message=FORK_WARNING, category=RuntimeWarning)
"""lancedb warns at every fork of a process that imported it; the fork server, which imports
this module and forks before any lancedb call, is that process (module doc)."""

JOIN_TIMEOUT_S = 5.0
"""How long a worker gets to exit after SIGTERM before it is killed."""


def iter_rank_batches(
    data: specs.DataSpec,
    storage_options: Mapping[str, str] | None,
    *,
    rank: int,
    world_size: int,
    start_global_step: int,
    stop_global_step: int | None = None,
    resume_state: Mapping[str, Any] | None = None,
    ledger: MutableMapping[int, skipping.Passed] | None = None,
    plan: planning.Source | None = None,
) -> Iterator[tuple[int, pa.RecordBatch]]:
    """Yield (global_step, batch) for `rank`: G/W rows per step, in reference order.

    A plain job's readers load their splits' row ids from `plan` (the sidecar's
    planner builds it); without one they build the plans they need themselves.

    Under onTransformError=skip/warn: a step exists only when every worker's portion
    does (an epoch ends at the first step one of them cannot fill), `ledger` receives
    each yielded step's split positions (what a checkpoint of the next step records) and
    the failing rows it dropped,
    and a resume mid-epoch needs the checkpoint's merged `resume_state`.

    Steps run from `start_global_step` through the job's last epoch, or up to
    (excluding) `stop_global_step`. Raises errors.UserError for a topology the
    job cannot serve or a table/filter/column problem, errors.SidecarFailed
    when a loader worker fails otherwise or dies. Closing the generator stops
    the worker processes.
    """
    try:
        topology.check(
            replicas=world_size,
            gpus_per_replica=1,
            num_splits=data.num_splits,
            num_workers=data.num_workers,
            global_batch_size=data.global_batch_size,
        )
    except topology.TopologyError as exc:
        raise errors.UserError(f"world size {world_size}: {exc}") from exc
    if not 0 <= rank < world_size:
        raise errors.UserError(f"rank {rank} is outside a world of size {world_size}")
    if start_global_step < 0:
        raise ValueError(f"start_global_step must be >= 0, got {start_global_step}")
    options = dict(storage_options or {})
    state = dict(resume_state) if resume_state is not None else None
    if plan is None and reading.reads_plans(data) and isinstance(data.version, int):
        # Nobody builds for these readers: they build into this process's own directory
        # (workers too, so that it goes when this process exits).
        plan = planning.Source(plans.location_for(data, None), builds=True)
    if data.num_workers == 1:
        return _iter_in_process(data, options, rank, world_size, start_global_step, stop_global_step,
                                state, ledger, plan)
    return _iter_in_processes(data, options, rank, world_size, start_global_step, stop_global_step,
                              state, ledger, plan)


# --- numWorkers = 1: in the caller's thread -----------------------------------------


def _iter_in_process(
    data: specs.DataSpec,
    storage_options: dict[str, str],
    rank: int,
    world_size: int,
    start: int,
    stop: int | None,
    state: dict[str, Any] | None = None,
    ledger: MutableMapping[int, skipping.Passed] | None = None,
    plan: planning.Source | None = None,
) -> Iterator[tuple[int, pa.RecordBatch]]:
    """Read in the caller's thread.

    No read-ahead thread of its own: the sidecar already runs this iterator in
    its publishing thread (serving.Publisher), and a second hand-off only
    added GIL switches.
    """
    table = reading.open_table(data, storage_options)
    splits = geometry.Geometry.of(data).rank_splits(rank, world_size)
    blocks = reading.iter_blocks(table, data, splits, start_global_step=start, stop_global_step=stop,
                                 resume_state=state, plan=plan)
    with contextlib.closing(blocks):
        for step, block in blocks:
            block, passed = skipping.take_positions(block)
            if ledger is not None and passed is not None:
                ledger[step] = passed
            yield step, block


# --- numWorkers = K > 1: worker processes ------------------------------------------

# A frame is a header (kind, global step, rows the worker filled so far) and a payload:
# Arrow IPC for a block, UTF-8 text for an error.
_HEADER = struct.Struct("<Bqq7x")  # 24 bytes: the IPC stream after it stays 8-byte aligned
_BLOCK, _END, _USER_ERROR, _FAILURE, _DATA_ERROR = 1, 2, 3, 4, 5


def _frame(kind: int, step: int = -1, payload: bytes = b"") -> bytes:
    return _HEADER.pack(kind, step, reading.FILLED_ROWS[0]) + payload


def _block_frame(step: int, batch: pa.RecordBatch) -> pa.Buffer:
    """A block's frame written once: the header, then the batch's Arrow IPC stream.

    Not `_frame(..., bytes(ipc))`: that copied each block twice more (bytes(), then
    the concatenation), decoded images being most of a worker's bytes.
    """
    sink = pa.BufferOutputStream()
    sink.write(_HEADER.pack(_BLOCK, step, reading.FILLED_ROWS[0]))
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def _from_ipc(payload: memoryview) -> pa.RecordBatch:
    with pa.ipc.open_stream(pa.py_buffer(payload)) as reader:
        return reader.read_next_batch()


def exit_with_parent() -> None:
    """Die when the parent does, even if it was SIGKILLed and cleaned nothing up."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="splitfeed-parent-watch", daemon=True).start()


def fork_context(data: specs.DataSpec) -> Any:
    """The 'forkserver' context whose server has imported what a worker imports (module doc):
    lancedb.streaming (and torch) too for the jobs StreamingDataset reads."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__] + ([] if reading.reads_plans(data) else ["lancedb.streaming"]))
    return context


def _worker_main(
    conn: multiprocessing.connection.Connection,
    data: specs.DataSpec,
    storage_options: dict[str, str],
    rank: int,
    world_size: int,
    worker: int,
    start: int,
    stop: int | None,
    state: dict[str, Any] | None = None,
    plan: planning.Source | None = None,
) -> None:
    """Entry point of loader worker `worker`: stream its sub-block's steps to the parent."""
    exit_with_parent()
    try:
        table = reading.open_table(data, storage_options)
        splits = geometry.Geometry.of(data).worker_splits(rank, world_size, worker)
        for step, block in reading.iter_blocks(
            table, data, splits, start_global_step=start, stop_global_step=stop, resume_state=state,
            plan=plan,
        ):
            conn.send_bytes(_block_frame(step, block))
        conn.send_bytes(_frame(_END))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the parent stopped listening; nothing left to tell it
    except BaseException as exc:
        if isinstance(exc, errors.DataError):
            kind, text = _DATA_ERROR, str(exc)
        elif isinstance(exc, errors.UserError):
            kind, text = _USER_ERROR, str(exc)
        else:
            kind, text = _FAILURE, "".join(traceback.format_exception(exc)).rstrip()
        with contextlib.suppress(OSError):
            conn.send_bytes(_frame(kind, payload=text.encode()))
    finally:
        conn.close()


def _receive(
    conn: multiprocessing.connection.Connection,
    process: multiprocessing.process.BaseProcess,
    worker: int,
    rank: int,
    filled_seen: dict[int, int] | None = None,
) -> tuple[int, int, memoryview]:
    try:
        raw = conn.recv_bytes()
    except EOFError:
        process.join(JOIN_TIMEOUT_S)
        raise errors.SidecarFailed(
            f"loader worker {worker} of rank {rank} exited (code {process.exitcode}) "
            "without a result"
        ) from None
    kind, step, filled = _HEADER.unpack_from(raw)
    if filled_seen is not None:  # onTransformError=fill: counted into this process's report
        reading.FILLED_ROWS[0] += filled - filled_seen.get(worker, 0)
        filled_seen[worker] = filled
    payload = memoryview(raw)[_HEADER.size :]
    if kind == _DATA_ERROR:
        raise errors.DataError(bytes(payload).decode())
    if kind == _USER_ERROR:
        raise errors.UserError(bytes(payload).decode())
    if kind == _FAILURE:
        raise errors.SidecarFailed(
            f"loader worker {worker} of rank {rank} failed:\n{bytes(payload).decode()}"
        )
    return kind, step, payload


def _aligned(frames: list[tuple[int, int, memoryview]],
             receive: Callable[[int], tuple[int, int, memoryview]]) -> list[tuple[int, int, memoryview]]:
    """Each worker's frame of the same step: a worker behind the highest step skips ahead
    (the others' epoch already ended there); one at its end ends them all."""
    frames = list(frames)
    while True:
        if any(kind == _END for kind, _, _ in frames):
            return [(_END, -1, memoryview(b""))] * len(frames)
        if any(kind != _BLOCK for kind, _, _ in frames):
            return frames
        top = max(step for _, step, _ in frames)
        behind = [w for w, (_, step, _) in enumerate(frames) if step < top]
        if not behind:
            return frames
        for worker in behind:
            frames[worker] = receive(worker)


def _stop(processes: list[multiprocessing.process.BaseProcess]) -> None:
    """Terminate, join with a timeout, kill: no worker outlives the generator."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(JOIN_TIMEOUT_S)
        if process.is_alive():
            log.warning("loader worker pid %s ignored SIGTERM; killing it", process.pid)
            process.kill()
            process.join()
        process.close()


def _iter_in_processes(
    data: specs.DataSpec,
    storage_options: dict[str, str],
    rank: int,
    world_size: int,
    start: int,
    stop: int | None,
    state: dict[str, Any] | None = None,
    ledger: MutableMapping[int, skipping.Passed] | None = None,
    plan: planning.Source | None = None,
) -> Iterator[tuple[int, pa.RecordBatch]]:
    """Start K workers, then merge their step-k blocks into the rank's batch k.

    Under skip a worker's epoch may end before another's: steps that not every
    worker has are dropped (each worker's steps rise, and an epoch's lost steps
    only end where the next epoch starts, so aligning on the highest step is exact).
    """
    context = fork_context(data)
    cycles = geometry.Geometry.of(data).rows_per_split_per_step
    conns: list[multiprocessing.connection.Connection] = []
    processes: list[multiprocessing.process.BaseProcess] = []
    filled_seen: dict[int, int] = {}
    skipping = data.drops_rows
    try:
        for worker in range(data.num_workers):
            _start_worker(context, conns, processes, f"splitfeed-loader-{rank}-{worker}",
                          (data, storage_options, rank, world_size, worker, start, stop, state, plan))
        expected = start

        def receive(worker: int) -> tuple[int, int, memoryview]:
            return _receive(conns[worker], processes[worker], worker, rank, filled_seen)

        while True:
            frames = [receive(worker) for worker in range(len(conns))]
            if skipping:
                frames = _aligned(frames, receive)
            step = _frames_step(frames, expected, skipping, rank)
            if step is None:
                return
            batch, passed = _merge(frames, cycles)
            if ledger is not None and passed is not None:
                ledger[step] = passed
            yield step, batch
            expected = step + 1
    finally:
        for conn in conns:
            conn.close()
        _stop(processes)


def _start_worker(
    context: Any,
    conns: list[multiprocessing.connection.Connection],
    processes: list[multiprocessing.process.BaseProcess],
    name: str,
    args: tuple[Any, ...],
) -> None:
    """Start one loader worker, `_worker_main(sender, *args)`; its pipe's read end goes
    into `conns` before it starts and the process into `processes` once it runs, so the
    caller's cleanup closes and stops whatever exists when a start fails."""
    receiver, sender = context.Pipe(duplex=False)
    conns.append(receiver)
    process = context.Process(
        target=_worker_main,
        args=(sender, *args),
        name=name,
        daemon=True,
    )
    try:
        process.start()
    finally:
        sender.close()  # the worker holds the only writer now: its death reads as EOF
    processes.append(process)


def _frames_step(frames: list[tuple[int, int, memoryview]], expected: int, skipping: bool,
                 rank: int) -> int | None:
    """The step every worker's frame holds (under skip it may be past `expected`: steps
    not every worker has are gone); None when all of them ended. Raises SidecarFailed
    when they disagree."""
    kinds = {kind for kind, _, _ in frames}
    if kinds == {_END}:
        return None
    steps = [step for _, step, _ in frames]
    if kinds != {_BLOCK} or (steps != [expected] * len(frames) and not (
            skipping and len(set(steps)) == 1 and steps[0] > expected)):
        raise errors.SidecarFailed(
            f"loader workers of rank {rank} disagree at step {expected}: "
            f"frames {[kind for kind, _, _ in frames]}, steps {steps}"
        )
    return steps[0]


def _merge(frames: list[tuple[int, int, memoryview]],
           cycles: int) -> tuple[pa.RecordBatch, skipping.Passed | None]:
    """One step's worker blocks as the rank's batch (batching.interleave), and what their
    splits passed together (None but under skip)."""
    blocks, at, skipped = [], {}, 0
    for _, _, payload in frames:
        block, passed = skipping.take_positions(_from_ipc(payload))
        blocks.append(block)
        if passed is not None:
            at.update(passed.at)
            skipped += passed.skipped
    return batching.interleave(blocks, cycles), (skipping.Passed(at, skipped) if at else None)
