"""A rank whose sidecar died during a drain: how it knows, and its world's coordinator checkpointing for it.

A member's sidecar that is SIGKILLed with `restartPolicy: Never` stays dead (issue 21). Its
trainer can still reach the world's drain step S when the batches up to S - 1 were published
into its ring before the sidecar died (they are in shared memory), but it cannot checkpoint
through its sidecar. For a plain job (no rows dropped) a rank's data position at S is the
same for every rank, so the world's coordinator (replica 0's sidecar) can write the rank's
record and commit marker instead (`messages.StandIn`; docs/agreement.md, "A sidecar that
cannot restart"), and the world still ends at S with nothing redone.

Two files in the socket directory, written by the sidecar (`sidecar.main`, `sidecar.opening`):
- `sidecar.lock`, which the sidecar process holds locked (a POSIX lock, which the kernel drops
  when the process dies, SIGKILL included, and which its forked workers do not inherit): a
  trainer that can lock it knows no sidecar runs there now (`gone`);
- `coordinator.json`, a member's world epoch and its coordinator's address (`coordinator`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import TypeVar

from ..contract import messages
from . import worlds
from ..contract.errors import CheckpointError

log = logging.getLogger(__name__)

LOCK_FILE = "sidecar.lock"
COORDINATOR_FILE = "coordinator.json"

_Answer = TypeVar("_Answer", messages.Checkpointed, messages.Committed)


def hold(directory: Path, timeout_s: float = 5.0) -> int | None:
    """The sidecar's side: lock `directory`'s LOCK_FILE for as long as this process lives; the
    descriptor, which the caller keeps open (closing it drops the lock). None when another
    process still holds it after `timeout_s` (a predecessor still exiting): trainers then see
    that one's lock, and nothing changes for them."""
    Path(directory).mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(Path(directory) / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a trainer's look holds it for microseconds
            return fd
        except OSError:
            if time.monotonic() > deadline:
                os.close(fd)
                log.warning("%s stays locked by another process", Path(directory) / LOCK_FILE)
                return None
            time.sleep(0.01)


def gone(directory: Path) -> bool:
    """No sidecar process holds `directory`'s lock: the one that made it died. False where no
    sidecar ever made one (a sidecar that predates this, or one run in the trainer's process)."""
    try:
        fd = os.open(Path(directory) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return False  # held: the sidecar runs
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


def write_coordinator(directory: Path, world_epoch: int, address: str) -> None:
    """The sidecar's side: where a trainer of world `world_epoch` finds the world's coordinator."""
    path = Path(directory) / COORDINATOR_FILE
    tmp = path.with_name(f".{COORDINATOR_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps({"worldEpoch": world_epoch, "address": address}))
    os.replace(tmp, path)


def coordinator(directory: Path, world_epoch: int) -> str | None:
    """World `world_epoch`'s coordinator address, if this pod's sidecar wrote it (members only)."""
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        found = json.loads((Path(directory) / COORDINATOR_FILE).read_text())
        if found.get("worldEpoch") == world_epoch and isinstance(found.get("address"), str):
            return str(found["address"])
    return None


def ask(address: str, request: messages.StandIn, answer: type[_Answer], timeout_s: float) -> _Answer:
    """Send `request` to the coordinator at `address` and wait for its `answer`; CheckpointError
    for a refusal (the coordinator's one-line reason) or no answer within `timeout_s`."""
    reply = worlds.stand_in(address, request, timeout_s)
    if reply is None:
        raise CheckpointError(f"the world's coordinator at {address} did not answer {request.kind} "
                              f"of step {request.step} within {timeout_s:g} s")
    if isinstance(reply, answer) and reply.step == request.step:
        return reply
    if isinstance(reply, messages.Error):
        raise CheckpointError(f"the world's coordinator refused to stand in: {reply.message}")
    raise CheckpointError(f"the world's coordinator answered {request.kind} with {reply.kind}")
