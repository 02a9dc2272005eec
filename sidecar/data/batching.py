"""Batch layout: put per-split reads into StreamingDataset's exact row order.

Pure pyarrow. StreamingDataset yields one row per split per cycle, over the
rank's splits in order. A rank's batch for one step is G/N cycles, so given
`c` rows from each of `m` splits (or from each of K workers' interleaved
blocks), the reference order is a fixed permutation of their concatenation.
One `take` builds the batch in that order with a single copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa


def interleave_order(num_blocks: int, cycles: int, rows_per_cycle: int) -> np.ndarray:
    """Indices that turn block-major rows into cycle-major rows.

    Input: `num_blocks` blocks, each `cycles` x `rows_per_cycle` rows in
    cycle-major order. Output order: for each cycle, each block's rows of that
    cycle. Blocks are splits (rows_per_cycle=1) or workers' outputs.
    """
    return (
        np.arange(num_blocks * cycles * rows_per_cycle, dtype=np.int64)
        .reshape(num_blocks, cycles, rows_per_cycle)
        .transpose(1, 0, 2)
        .ravel()
    )


def interleave(blocks: Sequence[pa.RecordBatch], cycles: int) -> pa.RecordBatch:
    """Merge equally long blocks, each `cycles` cycles long, into reference order."""
    if not blocks:
        raise ValueError("nothing to interleave")
    rows = blocks[0].num_rows
    if rows % cycles or any(b.num_rows != rows for b in blocks):
        raise ValueError(
            f"blocks must all hold the same whole number of cycles ({cycles}); "
            f"got {[b.num_rows for b in blocks]}"
        )
    if len(blocks) == 1:
        return blocks[0]
    table = pa.Table.from_batches(blocks)
    order = interleave_order(len(blocks), cycles, rows // cycles)
    return table.take(pa.array(order)).combine_chunks().to_batches()[0]
