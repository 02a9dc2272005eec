"""Which world a pod's ranks are in now: the file its sidecar writes for its trainer.

An in-place rescale (docs/agreement.md, "Changing the world in place") keeps a pod
running while its world changes size: its ranks' `WORLD_SIZE`, the rendezvous port and
the world epoch change, and a pod's environment cannot. So the sidecar writes the world
it serves into the socket directory both containers share, and the trainer's side reads
it: `splitfeed run` (the agent, which starts the user's process again with the new
environment) and `StreamClient.rejoin` (the in-process way). A file rather than a
message: between two worlds the sidecar closes and binds its socket again, and a trainer
process that starts in that gap must still learn where to go.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from . import wellknown, messages

FILE = "world.json"

SERVING = "serving"
"""The sidecar serves `epoch`: a trainer of this world may start."""
CHANGING = "changing"
"""The world drains and then changes in place: a trainer that stops now gets a next world."""
LEFT = "left"
"""This pod is not in the next world (an in-place scale-down): its trainer is done."""
ENDED = "ended"
"""The sidecar ended (the job's end, a replaced world, a failure): no next world from it."""
LOST = "lost"
"""World `epoch` lost member pods and ended without a drain: its trainers stop at once (their
peers are gone) and a next world follows in place from the newest complete checkpoint."""


@dataclasses.dataclass(frozen=True)
class World:
    """One world as this pod sees it (docs/pod-contract.md, "world.json"): its state and this
    pod's rank in it, what the sidecar tells its trainer. The world's own shape, the same for
    every pod, is a `layout.WorldLayout`."""

    epoch: int
    state: str
    rank: int
    """The pod's first global rank (NODE_RANK x gpusPerReplica): the same in every world."""
    world_size: int
    replicas: int
    master_addr: str
    master_port: int
    resume_step: int = 0
    """The global step the world starts at (the drain step of the world before it)."""
    after_loss: bool = False
    """The world before this one lost member pods: a trainer still in an earlier world is stopped."""

    def env(self, local_rank: int = 0, local_world_size: int = 1) -> dict[str, str]:
        """What changes in a trainer's environment for this world (what a new pod would get);
        torchrun's PET_NNODES and PET_MASTER_PORT too, for a pod of several GPUs."""
        env = wellknown.rank_env(
            world_size=self.world_size, gpus_per_replica=local_world_size,
            replica=self.rank // max(1, local_world_size), local_rank=local_rank,
            master_addr=self.master_addr, master_port=self.master_port, socket_dir="",
            world_epoch=self.epoch)
        del env[wellknown.SOCKET_DIR_ENV]
        env["PET_NNODES"], env["PET_MASTER_PORT"] = str(self.replicas), str(self.master_port)
        return env


_TORCHRUN = ("PET_NNODES", "PET_MASTER_PORT")


def world_env(base: dict[str, str], world: World) -> dict[str, str]:
    """`base` (a trainer's environment) with what `world` changes in it."""
    local_world_size = int(base.get(wellknown.LOCAL_WORLD_SIZE, "1") or 1)
    local_rank = int(base.get(wellknown.LOCAL_RANK, "0") or 0)
    changes = world.env(local_rank=local_rank, local_world_size=local_world_size)
    for name in _TORCHRUN:
        if name not in base:  # torchrun's variables only where the pod uses torchrun (gpusPerReplica > 1)
            del changes[name]
    return {**base, **changes}


def write(directory: Path, world: World) -> None:
    """Replace the file in one step: a reader sees the old world or the new, never half."""
    path = Path(directory) / FILE
    tmp = path.with_name(f".{FILE}.{os.getpid()}")
    tmp.write_text(json.dumps(dataclasses.asdict(world)))
    os.replace(tmp, path)


def read(directory: Path) -> World | None:
    """The world the sidecar last wrote; None before it wrote one (or if it is unreadable)."""
    try:
        found = json.loads((Path(directory) / FILE).read_text())
        return World(**{f.name: found[f.name] for f in dataclasses.fields(World) if f.name in found})
    except (OSError, ValueError, KeyError, TypeError):
        return None


WAITING = "trainer-{local_rank}.waiting"
"""A trainer process says hello from here on: its imports are done. A new pod of an in-place
scale-up is ready to join once each of its trainers made this file (`splitfeed local` waits
for it before it asks the world to drain)."""


def mark_waiting(directory: Path, local_rank: int) -> None:
    try:
        (Path(directory) / WAITING.format(local_rank=local_rank)).touch()
    except OSError:
        pass  # only a launcher's hint


def waited_since(directory: Path, local_rank: int, since: float) -> bool:
    """The trainer of `local_rank` said hello at or after `since` (time.time()): its imports are done."""
    try:
        return (Path(directory) / WAITING.format(local_rank=local_rank)).stat().st_mtime >= since
    except OSError:
        return False


def waiting(directory: Path, local_ranks: int) -> bool:
    """Every trainer of this pod has reached its first hello."""
    return all((Path(directory) / WAITING.format(local_rank=r)).exists() for r in range(local_ranks))


TRAINED = "trainer-{local_rank}.world"
"""The world epoch a trainer process last trained in, written by its client: the agent starts
the world after it, whatever the sidecar has moved on to while the process ended."""


def mark_trained(directory: Path, local_rank: int, epoch: int) -> None:
    try:
        (Path(directory) / TRAINED.format(local_rank=local_rank)).write_text(str(epoch))
    except OSError:
        pass


def trained(directory: Path, local_rank: int) -> int | None:
    try:
        return int((Path(directory) / TRAINED.format(local_rank=local_rank)).read_text())
    except (OSError, ValueError):
        return None


def lost(directory: Path, epoch: int) -> bool:
    """World `epoch` (or a later one) lost member pods: a trainer of it must stop now. Its
    peers are gone, so its collectives fail or never complete, and a world after it follows
    in place from the newest complete checkpoint (docs/agreement.md, "A member lost in place")."""
    world = read(directory)
    return world is not None and ((world.state == LOST and world.epoch >= epoch)
                                  or (world.epoch > epoch and world.after_loss))


def wait_lost(directory: Path, epoch: int, timeout_s: float, stop: Callable[[], bool] = lambda: False,
              poll_s: float = 0.05) -> bool:
    """After a trainer of world `epoch` failed: whether its sidecar says, within `timeout_s` and
    while it still serves, that the world lost a member pod (`lost`), which is then why it failed.
    The operator replaces such a pod once it sees it fail, up to 15 s later for a pod whose
    sidecar still runs (operator/lifecycle/restarting.py: REPORT_GRACE_S)."""
    deadline = time.monotonic() + timeout_s
    while not stop():
        if lost(directory, epoch):
            return True
        if not serving(directory) or time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return False


def serving(directory: Path) -> bool:
    """A sidecar is bound in `directory` now (its socket exists): it can still say what comes next."""
    return (Path(directory) / messages.SOCKET_NAME).exists()


def changing(directory: Path) -> bool:
    """The sidecar said a next world follows the one it serves."""
    world = read(directory)
    return world is not None and world.state == CHANGING


def next_world(directory: Path, after: int, timeout_s: float, poll_s: float = 0.01) -> World | None:
    """After a trainer of world `after` stopped: the world to start next, or None.

    None when the sidecar says none comes (LEFT, ENDED, or still SERVING `after`: the
    trainer stopped on its own, the job's end or an early stop). While it says CHANGING
    `after` (or has not written yet) it waits, up to `timeout_s`, for a newer epoch.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        world = read(directory)
        if world is not None:
            if world.state in (LEFT, ENDED):
                return None
            if world.epoch > after and world.state in (SERVING, CHANGING):
                return world  # CHANGING: the newer world already drains for the one after it
            if world.state == SERVING and world.epoch <= after:
                return None
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the sidecar at {directory} did not start the next world within {timeout_s:g} s")
        time.sleep(poll_s)
