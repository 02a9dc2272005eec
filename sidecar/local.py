"""`splitfeed local`: a StreamingJob's ranks as local processes, as pods would run them.

One sidecar per replica (serving its gpusPerReplica ranks) and one trainer
process per rank, each with the environment the operator gives pods
(docs/pod-contract.md). Any failed process stops the run with its error;
Ctrl-C stops every process. Progress comes from the trainers' stats files.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from splitfeed.trainer_client import errors, specs

STOP_GRACE_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def trainer_command(job: specs.JobSpec) -> list[str]:
    """The `trainer` container's command + args from the pod template."""
    containers = job.trainer.template.get("spec", {}).get("containers", [])
    for container in containers:
        if container.get("name") == "trainer":
            command = list(container.get("command") or []) + list(container.get("args") or [])
            if command:
                return command
    raise errors.UserError(
        "no trainer command: give one after `--`, or set command in the container "
        "named \"trainer\" of spec.trainer.template")


def shm_root() -> str | None:
    """Memory-backed like the pod's emptyDir, where the machine has one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _die_with_parent() -> None:
    """In the child: get SIGINT if the launcher dies, even by SIGKILL (Linux).

    SIGINT, not SIGTERM: SIGTERM asks a world to drain (docs/agreement.md), and
    an orphaned world has nobody to report to.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGINT)


class Process:
    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log: IO[bytes] = open(self.log_path, "wb")
        self.popen = subprocess.Popen(list(argv), env=env, stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=_die_with_parent)

    def tail(self, lines: int = 15) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        """End the process now: SIGINT, because SIGTERM asks a world to drain (docs/agreement.md)."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGINT)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait()
        self._log.close()


def rank_env(job: specs.JobSpec, replica: int, local_rank: int, socket_dir: Path,
             master_port: int) -> dict[str, str]:
    g = job.gpus_per_replica
    env = dict(os.environ)
    env.update({
        "RANK": str(replica * g + local_rank),
        "WORLD_SIZE": str(job.world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(g),
        "NODE_RANK": str(replica),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "SPLITFEED_SOCKET_DIR": str(socket_dir),
        "SPLITFEED_WORLD_EPOCH": "0",
    })
    return env


def run(job: specs.JobSpec, *, command: list[str] | None, resume: str,
        storage_options_dir: Path | None = None, progress: bool = True,
        out: IO[str] = sys.stderr) -> int:
    argv = command or trainer_command(job)
    work = Path(tempfile.mkdtemp(prefix=f"splitfeed-{job.name}-", dir=shm_root()))
    logs = Path(tempfile.mkdtemp(prefix=f"splitfeed-{job.name}-logs-"))
    config = work / "config.json"
    config.write_text(json.dumps(job.data_config()))
    master_port = free_port()
    coordinator = f"tcp://127.0.0.1:{free_port()}"
    sidecars: list[Process] = []
    trainers: list[Process] = []
    stats_files: list[Path] = []
    print(f"splitfeed local: {job.name}: {job.replicas} replicas x {job.gpus_per_replica} "
          f"= {job.world_size} ranks; logs in {logs}", file=out)
    started = time.monotonic()
    interrupted = False
    failure: str | None = None
    try:
        for replica in range(job.replicas):
            socket_dir = work / f"replica-{replica}"
            socket_dir.mkdir()
            env = rank_env(job, replica, 0, socket_dir, master_port)
            env["SPLITFEED_RESUME"] = resume
            env["SPLITFEED_COORDINATOR"] = coordinator
            sidecar_argv = [sys.executable, "-m", "splitfeed.trainer_client.cli", "sidecar",
                            "--config", str(config)]
            if storage_options_dir is not None:
                sidecar_argv += ["--storage-options-dir", str(storage_options_dir)]
            sidecars.append(Process(f"sidecar-{replica}", sidecar_argv, env, logs))
            for local_rank in range(job.gpus_per_replica):
                env = rank_env(job, replica, local_rank, socket_dir, master_port)
                stats = work / f"stats-{env['RANK']}.json"
                env["SPLITFEED_STATS_FILE"] = str(stats)
                stats_files.append(stats)
                trainers.append(Process(f"trainer-{env['RANK']}", argv, env, logs))
        failure = _supervise(sidecars, trainers, stats_files, job, progress, out)
    except KeyboardInterrupt:
        interrupted = True
        print("\nsplitfeed local: interrupted; stopping every process", file=out)
    finally:
        for p in trainers + sidecars:
            p.stop()
        deadline = time.monotonic() + STOP_GRACE_S
        for p in trainers + sidecars:
            try:
                p.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            p.kill()
        elapsed = time.monotonic() - started
        if not interrupted:
            _summary(stats_files, elapsed, out)
        _rmtree(work)
    if interrupted:
        return 130
    if failure:
        print(f"splitfeed local: failed: {failure}", file=out)
        return 1
    return 0


def _rmtree(path: Path) -> None:
    if path.is_dir():
        for child in path.iterdir():
            _rmtree(child)
        path.rmdir()
    else:
        path.unlink(missing_ok=True)


def _supervise(sidecars: list[Process], trainers: list[Process], stats_files: list[Path],
               job: specs.JobSpec, progress: bool, out: IO[str]) -> str | None:
    """Wait for the trainers; the first failure (trainer or sidecar) ends the run."""
    next_report = time.monotonic() + 2.0
    while True:
        for p in trainers:
            code = p.popen.poll()
            if code not in (None, 0):
                return f"{p.name} exited with code {code}:\n{p.tail()}"
        for p in sidecars:
            code = p.popen.poll()
            if code not in (None, 0):
                return f"{p.name} exited with code {code}:\n{p.tail()}"
        if all(p.popen.poll() == 0 for p in trainers):
            return None
        if progress and time.monotonic() >= next_report:
            next_report = time.monotonic() + 2.0
            steps = [_read_stats(f).get("last_step", -1) for f in stats_files]
            streaming = sum(s >= 0 for s in steps)
            if streaming < len(steps):
                print(f"  ... starting: {streaming}/{len(steps)} ranks streaming", file=out, flush=True)
            else:
                print(f"  ... global step {min(steps) + 1}", file=out, flush=True)
        time.sleep(0.1)


def _read_stats(path: Path) -> dict[str, float]:
    try:
        stats = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return stats if isinstance(stats, dict) else {}


def _summary(stats_files: list[Path], elapsed: float, out: IO[str]) -> None:
    stats = [_read_stats(f) for f in stats_files]
    rows = sum(s.get("rows", 0) for s in stats)
    steps = max((s.get("batches", 0) for s in stats), default=0)
    busy = sum(s.get("elapsed_s", 0.0) for s in stats)
    streaming = max((s.get("elapsed_s", 0.0) for s in stats), default=0.0)
    stall = sum(s.get("wait_s", 0.0) for s in stats) / busy if busy else 0.0
    # rows/s over the time data flowed (first batch to last), not process start-up.
    rate = rows / streaming if streaming else 0.0
    print(f"splitfeed local: {steps} steps per rank, {rows} rows in {elapsed:.1f} s; "
          f"{rate:.0f} rows/s while streaming, data stall {stall:.1%}",
          file=out, flush=True)

