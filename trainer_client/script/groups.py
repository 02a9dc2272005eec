"""Each world's torch.distributed process group, made the same way in every world.

The training script's side of an in-place rescale (`StreamClient.rejoin`, the README's
in-process path): torch is the trainer's, imported here on first use, never by the
contract that describes the world (trainer_client/contract/membership.py).
"""

from __future__ import annotations

import os
import socket
import time

from ..contract import wellknown
from ..contract.membership import World


def init_process_group(world: World, backend: str = "gloo", timeout_s: float = 1800.0) -> None:
    """Make `world`'s default torch.distributed process group, on a store of its own.

    For a trainer that follows an in-place rescale in its process (`StreamClient.rejoin`),
    after `destroy_process_group()`. Not the env:// rendezvous: its TCPStore is
    multi-tenant, so rank 0 shares the server of any store an earlier world left alive in
    the process (a module wrapped in DistributedDataParallel keeps its old group, and so
    its store, through its parameters' hooks), and that world's keys answer this one's
    ranks with peers that are gone. Each world's keys go under a prefix of their own.
    """
    import datetime

    import torch.distributed as dist  # the trainer's; this package does not depend on torch
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    rank = int(os.environ.get(wellknown.RANK, str(world.rank)))
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank != 0:
        _wait_listening(world.master_addr, world.master_port, timeout_s)
    store = TCPStore(world.master_addr, world.master_port, world.world_size, is_master=rank == 0,
                          multi_tenant=True, timeout=timeout)
    dist.init_process_group(backend, store=PrefixStore(f"splitfeed-world-{world.epoch}", store),
                            rank=rank, world_size=world.world_size, timeout=timeout)


MASTER_POLL_S = 0.01


def _wait_listening(host: str, port: int, timeout_s: float) -> None:
    """Until rank 0's store accepts connections (or the timeout passes: TCPStore then says why).

    A TCPStore client that comes before its server retries with a growing, jittered
    backoff: it connected 0.15-0.68 s after the server was up (measured, torch 2.13), most
    of an in-place world change. Polling the port first, every 10 ms, lets it connect at once.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(MASTER_POLL_S)
