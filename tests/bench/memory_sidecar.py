"""A sidecar whose batches are already in memory: isolates the transport for `make bench`.

    python -m tests.bench.memory_sidecar SOCKET_DIR BATCH_BYTES NUM_BATCHES PREFETCH
"""

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

from splitfeed.sidecar.serving import service


def main() -> int:
    service.tune_interpreter()
    directory, size, count, prefetch = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    payload = pa.record_batch({"x": pa.array(np.random.default_rng(0).integers(0, 2**62, size // 8), pa.int64())})

    def factory(rank: int, first: int):
        for step in range(first, count):
            yield step, payload

    server = service.Server(directory=directory, ranks=[0], world_size=1, factory=factory,
                            steps_per_epoch=count, total_steps=count, start_step=0, resume_step=0,
                            prefetch=prefetch)
    try:
        server.run()
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
