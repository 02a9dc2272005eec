"""`splitfeed run -- CMD ...`: runs the trainer's command once per world its pod is in.

In a job whose world changes in place (`spec.rescale: inPlace`, docs/agreement.md) a
pod that stays keeps its containers; only the world around it changes. A training
script that follows the README's loop returns once its rank drained; this agent, the
trainer container's command in place of the script, then starts the script again with
the next world's `RANK`, `WORLD_SIZE`, `MASTER_PORT` and `SPLITFEED_WORLD_EPOCH` (what a
new pod would get), in the same container: no scheduling, no image pull, no new pod.
It ends when its sidecar says no world follows (the job's end, a scale-down that left
this pod out, a world that is replaced), with the script's own exit code on a failure.

When another replica's pod fails (docs/agreement.md, "A member lost in place"), the script
has either failed in a collective whose peer vanished or is stuck in one: the sidecar says
the world is lost (`membership.LOST`), and the agent stops the script at once (SIGKILL:
a SIGTERM would ask the next world to drain through the client's handler) or, if it has
already failed in a collective, waits up to LOSS_WAIT_S for that word, and starts it again in
the next world, which resumes from the newest complete checkpoint. A script that failed of
its own (trainer_client/script/failures.py tells which) ends the agent at once with its exit code,
so the container, the pod and the job's restarts are what they would be without the agent.

torchrun's elastic agent restarts workers too, but it re-forms the world by its own
rendezvous and has them resume from a checkpoint; here the sidecars have already agreed
on the step and the world, and the agent only follows what its sidecar says.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..contract import wellknown, errors, membership
from . import failures

log = logging.getLogger("splitfeed.run")

NEXT_WORLD_TIMEOUT_S = 300.0
"""How long a drained trainer waits for its sidecar to start the next world."""
WATCH_S = 0.05
"""How often the agent looks at the world file while the script runs."""
SPARE_AFTER_S = 5.0
"""A script's start this long ago, or its first hello (its own imports are done), whichever
comes first: the next world's interpreter may import beside it. By the hello alone, a change
asked a few steps into a world finds the spare ready (it waited for these 5 s before, and a
2 -> 4 asked 10 steps in took 3.5 s after the drain, the spare's imports)."""
LOSS_WAIT_S = 60.0
"""How long the agent waits, after its script failed in a collective while the sidecar still
serves, for the sidecar to say the world lost a member pod (the collective failed because a
peer vanished) before it ends with the script's exit code. The operator acts once it sees the
pod fail, up to its REPORT_GRACE_S (15 s) later for a pod whose sidecar still runs. A script
that fails of its own (not in a collective: trainer_client/script/failures.py) is not waited for."""


AHEAD = """
import gc, json, os, runpy, sys
try:
    import torch  # the bulk of a trainer's start
except ImportError:
    pass
else:
    try:  # DistributedDataParallel's constructor imports it lazily: 1.1-2.3 s of each restart
        import torch._dynamo
    except Exception:
        pass
gc.freeze()
"""
"""What a trainer imports anyway, imported ahead of the script, and then frozen.

An interpreter that imported torch spends 0.4-0.7 s after its script returned in its own
finalization, most of it collecting torch's objects (measured: `import torch, torch._dynamo`
and exit, 0.68 s; with gc.freeze() after the imports, 0.24 s), and the next world's script
starts only once the one before has exited (it holds the GPU until then). Frozen objects
are left out of every collection; those are the libraries' own, which live until the exit
anyway, while everything the script makes is collected and finalized as python would."""

RUN = """
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""
"""`python SCRIPT ...` as python runs it: sys.argv, sys.path[0], __main__."""

FIRST = AHEAD + RUN
"""A run of `python SCRIPT ...` started now: the pod's first, or one that has no spare."""

WARM = AHEAD + """
line = sys.stdin.readline()
if not line.strip():
    sys.exit(0)
os.environ.clear()
os.environ.update(json.loads(line))
""" + RUN
"""A spare interpreter for `python SCRIPT ...`: it imports ahead while the world before still
trains, waits for its world's environment on stdin, then runs SCRIPT. It touches no GPU
before it runs: the process before it still holds the device."""


def warmable(argv: Sequence[str]) -> bool:
    """`python SCRIPT.py ...`: a command the agent can start ahead (WARM)."""
    return (len(argv) >= 2 and os.path.basename(argv[0]).startswith("python")
            and argv[1].endswith(".py") and os.path.isfile(argv[1]))


def fresh(argv: Sequence[str]) -> list[str]:
    """`python SCRIPT ...` run through FIRST (its exit is quick: the next world waits for it); else as is."""
    return [argv[0], "-c", FIRST, *argv[1:]] if warmable(argv) else list(argv)


class Spare:
    """At most one interpreter started ahead for the next world (WARM), or none."""

    def __init__(self, argv: Sequence[str]) -> None:
        self._argv = list(argv)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def wanted(self) -> bool:
        """No spare yet, and the command is one that can have one."""
        return self.process is None and warmable(self._argv)

    def prepare(self) -> None:
        if self.wanted:
            self.process = subprocess.Popen([self._argv[0], "-c", WARM, *self._argv[1:]],
                                            stdin=subprocess.PIPE, env=dict(os.environ))

    def start(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        """The next run: the spare, told its environment, or a fresh process without one."""
        spare, self.process = self.process, None
        if spare is None or spare.poll() is not None or spare.stdin is None:
            return subprocess.Popen(fresh(self._argv), env=env)
        spare.stdin.write(json.dumps(env).encode() + b"\n")
        spare.stdin.close()
        return spare

    def close(self) -> None:
        spare, self.process = self.process, None
        if spare is not None and spare.stdin is not None:
            with contextlib.suppress(OSError):
                spare.stdin.close()  # an empty line: it exits 0
            spare.wait()


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
    spare = Spare(argv)
    try:
        return _follow(argv, socket_dir, child, stopping, spare)
    finally:
        spare.close()


def _follow(argv: Sequence[str], socket_dir: Path, child: list[subprocess.Popen[bytes]],
            stopping: list[int], spare: Spare) -> int:
    # The first run starts at once, with the pod's environment: it imports while the sidecar
    # prepares (or, in a new pod of a scale-up, while the old world drains), and its client
    # takes the world the sidecar serves when it connects (StreamClient._adopt_world).
    env, epoch = dict(os.environ), int(os.environ.get(wellknown.WORLD_EPOCH_ENV, "0") or 0)
    started = time.time()
    child[:] = [subprocess.Popen(fresh(argv), env=env)]
    local_rank = int(os.environ.get(wellknown.LOCAL_RANK, "0") or 0)
    while True:
        lost = _watch(child[0], socket_dir, local_rank, epoch, stopping, spare, started)
        code = child[0].returncode
        now = membership.read(socket_dir)
        if now is not None and now.state == membership.LEFT:
            return 0  # this pod is not in the world any more: its script had nothing to train
        if code != 0 and not stopping and not lost and _peer_caused(argv[0], code, socket_dir, started):
            lost = membership.wait_lost(socket_dir, _trained_in(socket_dir, local_rank, epoch), LOSS_WAIT_S,
                                        stop=lambda: bool(stopping), poll_s=WATCH_S)
        if (code != 0 and not lost) or stopping:
            return code
        epoch = _trained_in(socket_dir, local_rank, epoch)  # the world the script trained in
        try:
            world = membership.next_world(socket_dir, after=epoch, timeout_s=NEXT_WORLD_TIMEOUT_S)
        except TimeoutError as exc:
            raise errors.UserError(f"{exc}: is the splitfeed sidecar running in this pod?") from None
        if world is None:
            return 0
        log.info("world %d: rank %d of %d; starting %s again%s", world.epoch, world.rank,
                 world.world_size, argv[0], " (its world before lost a pod)" if lost else "")
        env, epoch = membership.world_env(dict(os.environ), world), world.epoch
        started = time.time()
        child[:] = [spare.start(env)]


def _peer_caused(name: str, code: int | None, socket_dir: Path, since: float) -> bool:
    """The script (or a worker of its launcher) failed in a collective since `since`
    (trainer_client/script/failures.py): its world may have lost a pod, which the sidecar will say.
    Any other failure is the script's own, and ends the agent."""
    found = failures.recorded_since(socket_dir, since)
    collective = [f for f in found if f.collective]
    if collective:
        log.warning("%s failed in a collective (%s): waiting up to %.0f s for its sidecar to say whether "
                    "the world lost a pod", name, collective[0].exception, LOSS_WAIT_S)
        return True
    log.error("%s failed on its own (%s): ending with its exit code %s", name,
              found[0].exception if found else "no exception recorded", code)
    return False


def _trained_in(socket_dir: Path, local_rank: int, started_in: int) -> int:
    """The world the script trains in: the one its client last said, else the one it was started in."""
    trained = membership.trained(socket_dir, local_rank)
    return started_in if trained is None else max(started_in, trained)


def _watch(process: subprocess.Popen[bytes], socket_dir: Path, local_rank: int, epoch: int,
           stopping: list[int], spare: Spare, since: float) -> bool:
    """Wait for the script to end; True when it was stopped because its world lost a pod.
    `since`: when this run began (time.time(), as _follow keeps it): a hello after it is its own."""
    started = time.monotonic()
    while process.poll() is None:
        if not stopping and membership.lost(socket_dir, _trained_in(socket_dir, local_rank, epoch)):
            log.warning("the world lost a member pod: stopping %s (pid %d), whose peers are gone",
                        process.args, process.pid)
            process.kill()
            process.wait()
            return True
        # Once the script's own imports are done (its first hello), or it is well past its
        # start, or once a change is announced, the next world's interpreter imports.
        if not stopping and spare.wanted and (time.monotonic() - started > SPARE_AFTER_S
                                              or membership.waited_since(socket_dir, local_rank, since)
                                              or membership.changing(socket_dir)):
            spare.prepare()
        time.sleep(WATCH_S)
    return False


def command(add_parser: Any, name: str) -> None:
    """The `splitfeed run` subcommand (entry point `splitfeed.commands`)."""
    p = add_parser(name, help="run the trainer's command in each world its pod is in (in-place rescale)")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else list(args.argv)
    if not argv:
        raise errors.UserError("nothing to run: splitfeed run -- python train.py ...")
    directory = os.environ.get(wellknown.SOCKET_DIR_ENV)
    if not directory:
        raise errors.UserError("SPLITFEED_SOCKET_DIR is not set: the operator and `splitfeed local` set it")
    return run(argv, Path(directory))


if __name__ == "__main__":
    from .. import cli

    sys.exit(cli.main(["run", *sys.argv[1:]]))
