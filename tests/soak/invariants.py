"""What must hold after a soak's job, whatever was done to it.

- the committed steps tile lancedb's reference at the version the job pinned (none lost, none
  committed twice; steps trained after the last complete checkpoint of a failed world may be
  trained again: tests/support/exactness.py counts them as replayed);
- no forged message was ever answered;
- nothing is left behind: no process, no TCP port the job listened on, nothing in the run's
  memory-backed directory (ring files, ipc sockets, sidecar locks).
"""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

from tests.soak import probe
from tests.support import exactness, processes, tables

GRACE_S = 10.0


def exact(logs: Path, store: Path, uri: str, overrides: dict[str, object]) -> exactness.Summary:
    """tests/support/exactness.py's rule over every world of every run (its reference cached:
    a soak has dozens of worlds of a few sizes)."""
    @functools.cache
    def rank(world: int, r: int) -> list[list[int]]:
        return tables.reference_batches(uri, overrides, world, r)

    reference = [set(b) for b in rank(1, 0)]
    return exactness.check(logs, exactness.complete_checkpoints(store / "test" / "job"), reference, rank)


def leftovers(shm: Path, ports: set[int]) -> list[str]:
    """What the job's runs left: processes (orphans come to this subreaper), listening ports,
    entries under the runs' SPLITFEED_SHM_ROOT. Waits GRACE_S for what is still exiting."""
    deadline = time.monotonic() + GRACE_S
    while True:
        kids = processes.children()
        listening = ports & set(probe.listening_ports())
        entries = sorted(os.listdir(shm)) if shm.is_dir() else []
        if not (kids or listening or entries) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    found = [f"process {pid} ({processes.command_line(pid)})" for pid in sorted(kids)]
    for pid in kids:  # named, then ended: the next seed starts clean
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return (found + [f"port {port} still listening" for port in sorted(listening)]
            + [f"{shm / name} left in shared memory" for name in entries])


def unanswered(reports: list[dict[str, object]]) -> list[str]:
    """Forger passes that got an answer (tests/streaming/forger.py: `answered` must stay 0)."""
    return [f"forge {k}: {r}" for k, r in enumerate(reports) if r.get("answered") != 0]
