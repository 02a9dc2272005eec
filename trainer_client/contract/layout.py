"""A world of a job as one value: which (its epoch), how big (replicas, GPUs per replica), how
the next one follows (in place or recreated) and where it meets (replica 0's address, the
rendezvous and coordinator ports).

"Next epoch, flip the ports" was worked out wherever a world was built (the operator's pods,
Service and NetworkPolicy, `splitfeed local`, a sidecar moving on in place); here it is
worked out once (`WorldLayout.next`), and a pod's environment follows from the value
(`WorldLayout.env`) and reads back into it (`WorldLayout.from_env`).

Not `membership.World`: that is world.json, what one pod's sidecar tells its trainer while
the world runs (its state, the pod's rank, the step it resumes at). A `WorldLayout` is the
same for every pod of the world and says nothing of its progress; a sidecar writes a
`membership.World` for the layout it serves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from . import topology, wellknown
from .errors import UserError

WORLD_PORT_STRIDE = 10
"""Consecutive worlds of an in-place job rendezvous on ports this far apart (MASTER_PORT,
the coordinator's): a rank of world e+1 can never reach a store or coordinator that world
e still holds open, and world e+2 reuses e's ports, long closed by then."""


def world_port(base: int, epoch: int) -> int:
    """The port of world `epoch` for an in-place job whose even worlds use `base`."""
    return base + WORLD_PORT_STRIDE * (epoch % 2)


def base_port(port: int, epoch: int) -> int:
    """The even worlds' port of an in-place job whose world `epoch` uses `port` (world_port's inverse)."""
    return port - WORLD_PORT_STRIDE * (epoch % 2)


def next_port(port: int, epoch: int) -> int:
    """World `epoch + 1`'s port, from world `epoch`'s, in place (the inverse step of world_port)."""
    return port + WORLD_PORT_STRIDE if epoch % 2 == 0 else port - WORLD_PORT_STRIDE


@dataclasses.dataclass(frozen=True)
class WorldLayout:
    """World `epoch` of a job, as every pod of it has it (docs/pod-contract.md, "Environment")."""

    epoch: int
    replicas: int = 1
    gpus_per_replica: int = 1
    in_place: bool = False
    """spec.rescale inPlace: the next world keeps the pods and moves to the other pair of ports."""
    master_addr: str = wellknown.LOOPBACK
    """Replica 0's address (MASTER_ADDR): torch's rendezvous there, and its sidecar's coordinator."""
    master_port: int = wellknown.MASTER_PORT
    coordinator_port: int | None = wellknown.COORDINATOR_PORT
    """Where replica 0's sidecar binds the world's coordinator; None: no address (a lone
    sidecar binds a free port of its own)."""
    coordinator_host: str | None = None
    """The coordinator's host where it is not `master_addr` (read from an environment that says
    so); None in every world the operator and `splitfeed local` make."""

    @classmethod
    def at(cls, epoch: int, *, replicas: int = 1, gpus_per_replica: int = 1, in_place: bool = False,
           master_addr: str = wellknown.LOOPBACK,
           ports: tuple[int, int] = (wellknown.MASTER_PORT, wellknown.COORDINATOR_PORT)) -> WorldLayout:
        """World `epoch` of a job whose worlds use `ports` (rendezvous, coordinator): every world
        when recreated; in place the even ones, the odd ones each + WORLD_PORT_STRIDE."""
        master, coordinator = (world_port(p, epoch) for p in ports) if in_place else ports
        return cls(epoch=epoch, replicas=replicas, gpus_per_replica=gpus_per_replica, in_place=in_place,
                   master_addr=master_addr, master_port=master, coordinator_port=coordinator)

    @property
    def world_size(self) -> int:
        return topology.world_size(self.replicas, self.gpus_per_replica)

    def next(self, replicas: int) -> WorldLayout:
        """The world after this one, of `replicas`. In place it keeps replica 0's pod, so its
        address, and moves to the other pair of ports; a recreated world keeps the ports, and
        its replica 0 is a new pod whose address is the caller's to set (`dataclasses.replace`)."""
        if not self.in_place:
            return dataclasses.replace(self, epoch=self.epoch + 1, replicas=replicas)
        coordinator = None if self.coordinator_port is None else next_port(self.coordinator_port, self.epoch)
        return dataclasses.replace(self, epoch=self.epoch + 1, replicas=replicas,
                                   master_port=next_port(self.master_port, self.epoch), coordinator_port=coordinator)

    def later(self, epoch: int, replicas: int) -> WorldLayout:
        """World `epoch` of the same job, of `replicas`: `next` until there (a sidecar restarted
        into a later world of its pod, which its world file names)."""
        world = self
        while world.epoch < epoch:
            world = world.next(replicas)
        return dataclasses.replace(world, replicas=replicas)

    def alternating(self) -> tuple[WorldLayout, ...]:
        """This world alone, or in place with the next: the ports a job's worlds take turns on."""
        return (self, self.next(self.replicas)) if self.in_place else (self,)

    def coordinator_at(self, host: str) -> str:
        """This world's coordinator by `host`, an address of replica 0 (its pod IP, which the
        operator dials: it may not resolve pod DNS); "" without a coordinator port."""
        if self.coordinator_port is None:
            return ""
        return f"tcp://{f'[{host}]' if ':' in host else host}:{self.coordinator_port}"

    @property
    def coordinator(self) -> str:
        """SPLITFEED_COORDINATOR: replica 0's sidecar by its address; "" for none (as the variable)."""
        return self.coordinator_at(self.coordinator_host or self.master_addr)

    def env(self, replica: int, local_rank: int = 0, socket_dir: str = wellknown.SOCKET_DIR) -> wellknown.Env:
        """What every container of `replica` gets (wellknown.rank_env); a pod's one process per
        replica is local_rank 0 (torchrun sets the others' own)."""
        return wellknown.rank_env(
            world_size=self.world_size, gpus_per_replica=self.gpus_per_replica, replica=replica,
            local_rank=local_rank, master_addr=self.master_addr, master_port=self.master_port,
            socket_dir=socket_dir, world_epoch=self.epoch)

    def torchrun_env(self, replica: int) -> wellknown.Env:
        """torchrun's own variables, for a trainer of several GPUs (it spawns one process per
        GPU); none for one GPU."""
        if self.gpus_per_replica <= 1:
            return {}
        return {"PET_NNODES": str(self.replicas), "PET_NPROC_PER_NODE": str(self.gpus_per_replica),
                "PET_NODE_RANK": str(replica), "PET_MASTER_ADDR": self.master_addr,
                "PET_MASTER_PORT": str(self.master_port)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str], *, in_place: bool = False) -> WorldLayout:
        """The world an environment names (`env`, and SPLITFEED_COORDINATOR in a sidecar's);
        `in_place` is spec.rescale's, which no variable carries. What is unset or empty is a
        world of one process on this machine, as a script run by hand sees it."""

        def number(name: str, default: int) -> int:
            return int(environ.get(name) or default)

        gpus = number(wellknown.LOCAL_WORLD_SIZE, 1)
        master_addr = environ.get(wellknown.MASTER_ADDR) or wellknown.LOOPBACK
        host, port = parse_coordinator(environ.get(wellknown.COORDINATOR_ENV) or "")
        return cls(epoch=number(wellknown.WORLD_EPOCH_ENV, 0), replicas=max(1, number(wellknown.WORLD_SIZE, gpus) // gpus),
                   gpus_per_replica=gpus, in_place=in_place, master_addr=master_addr,
                   master_port=number(wellknown.MASTER_PORT_ENV, wellknown.MASTER_PORT),
                   coordinator_port=port, coordinator_host=None if host in (None, master_addr) else host)


def parse_coordinator(address: str) -> tuple[str | None, int | None]:
    """(host, port) of `tcp://HOST:PORT` (an IPv6 host in brackets); (None, None) for ""."""
    if not address:
        return None, None
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not sep or not host or not port.isdigit():
        raise UserError(f"{wellknown.COORDINATOR_ENV}={address!r} is not tcp://HOST:PORT")
    return host.removeprefix("[").removesuffix("]"), int(port)
