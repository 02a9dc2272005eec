"""The drain step this sidecar committed to, kept in the pod's socket directory for its successor.

A sidecar that the kubelet restarts during a drain (`restartPolicy: OnFailure`) forgets the step
its world committed to. Members still running tell a restarted coordinator that step when they
join again (docs/agreement.md); but replica 0's sidecar is both, and its member may have been
the last one left: the others drained, committed and ended before it came back. Its restarted
member then joins with the step read here, the restarted coordinator adopts it, and replica 0's
trainer, which took its batches up to that step from the ring, checkpoints it with the new
sidecar: nothing redone. The file lives in the pod's memory-backed emptyDir, as the ring does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .checkpoints import Store

log = logging.getLogger(__name__)

FILE = "commitment.json"


def save(directory: Path, world_epoch: int, step: int, reason: str, next_replicas: int) -> None:
    """Keep world `world_epoch`'s committed drain step (written whole: a rename)."""
    path = Path(directory) / FILE
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"worldEpoch": world_epoch, "step": step, "reason": reason,
                                   "nextReplicas": next_replicas}))
        os.replace(tmp, path)
    except OSError as exc:  # the drain goes on; only a restart during it would forget the step
        log.warning("cannot keep the drain step in %s: %s", path, exc)
        with contextlib.suppress(OSError):
            tmp.unlink()


def load(directory: Path, world_epoch: int) -> tuple[int, str, int] | None:
    """(step, reason, next replicas) committed by this pod's sidecar in world `world_epoch`, if any."""
    try:
        kept = json.loads((Path(directory) / FILE).read_text())
        if kept["worldEpoch"] != world_epoch:
            return None
        return int(kept["step"]), str(kept["reason"]), int(kept["nextReplicas"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring %s: %s", Path(directory) / FILE, exc)
        return None


def committed_ranks(store: Store, ranks: Iterable[int], step: int, world_size: int, world_epoch: int) -> set[int]:
    """The `ranks` whose commit marker of `step` in world `world_epoch` the store holds (those
    of a pod whose sidecar restarted after they committed); a flaky read counts as none (the
    ranks are then served as usual)."""
    try:
        return {r for r in ranks if store.committed(global_step=step, rank=r, world_size=world_size,
                                                   world_epoch=world_epoch)}
    except Exception as exc:  # noqa: BLE001 - the sidecar serves them as usual and finds out
        log.warning("cannot tell whether this pod's ranks committed drain step %d: %s", step, exc)
        return set()
