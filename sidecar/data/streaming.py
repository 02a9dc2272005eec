"""lancedb's StreamingDataset: the reference order, and the wrapper every job that it reads opens.

`reference_dataset` is the dataset whose in-process order is the determinism contract (tests
compare every batch with it); `streaming_dataset` is that dataset with the job's transform or
packing, through which transform, packing and skip jobs read (sidecar/data/reading.py), and
`blocks_per_epoch` asks it for a packing job's epoch size. lancedb.streaming imports torch
(180 MiB), so it is imported only inside the calls that need it; `import_streaming` lets a
fork server import it once for its children, and `merge_states` merges a plain job's ranks'
states without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from splitfeed.trainer_client.contract import errors, specs

if TYPE_CHECKING:
    from lancedb.streaming import StreamingDataset

from ..table import cgroups


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


def import_streaming() -> None:
    """Import lancedb.streaming (and torch) now: a fork server does it once for its children."""
    import lancedb.streaming  # noqa: F401


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
    dataset = streaming_dataset(table, data, epoch=0, rank=0, world_size=1, transform=None,
                                 blocks="auto")
    return int(cast(int, dataset._blocks_per_epoch))  # lancedb's __init__ resolved "auto"


def transform_parallelism(data: specs.DataSpec, cpus: int) -> int:
    """spec.data.transformParallelism, or the `cpus` this sidecar may use shared among its
    numWorkers loader processes (each runs its own StreamingDataset and thread pool)."""
    if data.transform_parallelism is not None:
        return data.transform_parallelism
    return max(1, -(-cpus // data.num_workers))


def streaming_dataset(
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
