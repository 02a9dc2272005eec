"""A sidecar process serving synthetic batches: the ring between two real processes.

    python -m tests.streaming.ring_sidecar SOCKET_DIR MODE STEPS PREFETCH

MODE `stress`: batches of every size from 1 byte to 64 KiB (and a few of
1 MiB, which grow slot files), whose bytes are `pattern(step, size)`.
MODE `grow`: three 64 KiB batches, then 3 MiB ones, which a 2 MiB volume cannot hold.
It serves and exits as `splitfeed sidecar` does (`sidecar.main.serve`): 2 after a failure.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

from splitfeed.sidecar import main as sidecar_main, opening
from splitfeed.sidecar.serving import service
from splitfeed.sidecar.world.settings import SidecarSettings


def size_of(mode: str, step: int) -> int:
    if mode == "grow":
        return 64 << 10 if step < 3 else 3 << 20
    return 1 << 20 if step % 500 == 499 else 1 + (step * 7919) % (64 << 10)


def pattern(step: int, size: int) -> np.ndarray:
    """Bytes that differ from step to step and along the batch."""
    index = np.arange(size, dtype=np.uint64)
    return ((index * np.uint64(2654435761) + np.uint64(step * 40503)) >> np.uint64(7)).astype(np.uint8)


def batch(mode: str, step: int) -> pa.RecordBatch:
    return pa.record_batch({"x": pa.array(pattern(step, size_of(mode, step)), pa.uint8())})


def main() -> int:
    service.tune_interpreter()
    directory, mode, steps, prefetch = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

    def factory(rank: int, first: int):  # type: ignore[no-untyped-def]
        for step in range(first, steps):
            yield step, batch(mode, step)

    server = service.Server(directory=directory, ranks=[0], world_size=1, factory=factory,
                            steps_per_epoch=steps, total_steps=steps, start_step=0, resume_step=0,
                            prefetch=prefetch)
    settings = SidecarSettings(config=Path("unused"), socket_dir=directory)
    return sidecar_main.serve(opening.Sidecar(server, settings, steps, failure=None))


if __name__ == "__main__":
    sys.exit(main())
