"""`splitfeed run -- CMD ...`: runs the trainer's command once per world its pod is in.

In a job whose world changes in place (`spec.rescale: inPlace`, docs/agreement.md) a
pod that stays keeps its containers; only the world around it changes. A training
script that follows the README's loop returns once its rank drained; this agent, the
trainer container's command in place of the script, then starts the script again with
the next world's `RANK`, `WORLD_SIZE`, `MASTER_PORT` and `SPLITFEED_WORLD_EPOCH` (what a
new pod would get), in the same container: no scheduling, no image pull, no new pod.
It ends when its sidecar says no world follows (the job's end, a scale-down that left
this pod out, a world that is replaced), with the script's own exit code on a failure.

torchrun's elastic agent restarts workers too, but it re-forms the world by its own
rendezvous and has them resume from a checkpoint; here the sidecars have already agreed
on the step and the world, and the agent only follows what its sidecar says.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import contract, errors, membership

log = logging.getLogger("splitfeed.run")

NEXT_WORLD_TIMEOUT_S = 300.0
"""How long a drained trainer waits for its sidecar to start the next world."""

def run(argv: Sequence[str], socket_dir: Path) -> int:
    """Start `argv` in each world this pod is in; the exit code of the last run."""
    stopping: list[int] = []
    child: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: Any) -> None:
        stopping.append(signum)  # a drained script is not started again after SIGTERM
        if child and child[0].poll() is None:
            child[0].send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    # The first run starts at once, with the pod's environment: it imports while the sidecar
    # prepares (or, in a new pod of a scale-up, while the old world drains), and its client
    # takes the world the sidecar serves when it connects (StreamClient._adopt_world).
    env, epoch = dict(os.environ), int(os.environ.get(contract.WORLD_EPOCH_ENV, "0") or 0)
    while True:
        child[:] = [subprocess.Popen(list(argv), env=env)]
        code = child[0].wait()
        now = membership.read(socket_dir)
        if now is not None and now.state == membership.LEFT:
            return 0  # this pod is not in the world any more: its script had nothing to train
        if code != 0 or stopping:
            return code
        local_rank = int(os.environ.get(contract.LOCAL_RANK, "0") or 0)
        trained = membership.trained(socket_dir, local_rank)  # the world the script trained in
        epoch = epoch if trained is None else trained
        try:
            world = membership.next_world(socket_dir, after=epoch, timeout_s=NEXT_WORLD_TIMEOUT_S)
        except TimeoutError as exc:
            raise errors.UserError(f"{exc}: is the splitfeed sidecar running in this pod?") from None
        if world is None:
            return 0
        log.info("world %d: rank %d of %d; starting %s again", world.epoch, world.rank,
                 world.world_size, argv[0])
        env, epoch = membership.world_env(dict(os.environ), world), world.epoch


def command(add_parser: Any, name: str) -> None:
    """The `splitfeed run` subcommand (entry point `splitfeed.commands`)."""
    p = add_parser(name, help="run the trainer's command in each world its pod is in (in-place rescale)")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else list(args.argv)
    if not argv:
        raise errors.UserError("nothing to run: splitfeed run -- python train.py ...")
    directory = os.environ.get(contract.SOCKET_DIR_ENV)
    if not directory:
        raise errors.UserError("SPLITFEED_SOCKET_DIR is not set: the operator and `splitfeed local` set it")
    return run(argv, Path(directory))


if __name__ == "__main__":
    from . import cli

    sys.exit(cli.main(["run", *sys.argv[1:]]))
