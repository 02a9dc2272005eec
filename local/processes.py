"""The processes of one `splitfeed local` world, as a world of pods would run them: one sidecar
per replica (forked from the run's fork server) and one trainer per rank, each with the
environment the operator gives pods (docs/pod-contract.md), on free local ports and with the
run's own keypair; stopped as a pod's containers end (SIGINT, then SIGKILL); and the files they
leave in the run's work dir (stats files, reports) read back. `World` holds one topology's
processes; the run loop (local/running.py) and its world changes (local/rescaling.py) start
and watch them through it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from splitfeed.trainer_client.contract import wellknown, errors, layout, specs
from splitfeed.trainer_client.transport import keys

from splitfeed.sidecar.forks import forking
from splitfeed.sidecar.serving import metrics

from . import forkserver

STOP_GRACE_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((wellknown.LOOPBACK, 0))
        return int(s.getsockname()[1])


def free_port_pair() -> int:
    """A free port P whose partner (the port odd worlds use in place, WorldLayout.at) is free
    too: the even and odd worlds of an in-place run."""
    for _ in range(100):
        port = free_port()
        partner = layout.world_port(port, 1)
        if partner > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind((wellknown.LOOPBACK, partner))
            except OSError:
                continue
        return port
    raise errors.UserError("no free pair of local ports for an in-place run")


def trainer_command(job: specs.JobSpec) -> list[str]:
    """The `trainer` container's command + args from the pod template."""
    containers = job.trainer.template.get("spec", {}).get("containers", [])
    for container in containers:
        if container.get("name") == wellknown.TRAINER_NAME:
            command = list(container.get("command") or []) + list(container.get("args") or [])
            if command:
                return command
    raise errors.UserError(
        "no trainer command: give one after `--`, or set command in the container "
        f"named \"{wellknown.TRAINER_NAME}\" of spec.trainer.template")


SHM_ROOT_ENV = "SPLITFEED_SHM_ROOT"
"""Overrides where a run's sockets and ring files go (the test suite gives each session its own)."""


def shm_root() -> str | None:
    """Memory-backed like the pod's emptyDir, where the machine has one."""
    if os.environ.get(SHM_ROOT_ENV):
        return os.environ[SHM_ROOT_ENV]
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def die_with_parent() -> None:
    """In the child: get SIGINT if the launcher dies, even by SIGKILL (Linux).

    SIGINT, not SIGTERM: SIGTERM asks a world to drain (docs/agreement.md), and
    an orphaned world has nobody to report to. SIGINT's default action too: a launcher
    started in the background by a shell (`splitfeed local ... &`, nohup, CI) has SIGINT
    ignored, which exec passes on, and its trainers would outlive it and its stop.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGINT)


SIDECAR_MODULE = [sys.executable, "-m", "splitfeed.trainer_client.cli"]


class Process:
    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], log_dir: Path,
                 forks: forkserver.Server | None = None) -> None:
        """With `forks`, a sidecar command (SIDECAR_MODULE + args) is forked from the fork server."""
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log: IO[bytes] = open(self.log_path, "wb")
        self.popen: subprocess.Popen[bytes] | forkserver.Forked
        if forks is not None and forks.alive() and list(argv[:3]) == SIDECAR_MODULE:
            self.popen = forks.spawn(argv[3:], env, str(self.log_path))
            return
        with warnings.catch_warnings():
            # The parent may have imported lancedb (plan, checkpoints); exec follows the fork at once.
            warnings.filterwarnings("ignore", message=forking.FORK_WARNING, category=RuntimeWarning)
            self.popen = subprocess.Popen(list(argv), env=env, stdout=self._log,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=die_with_parent)

    def tail(self, lines: int = 15) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        """End the process now: SIGINT, because SIGTERM asks a world to drain (docs/agreement.md)."""
        self._signal_group(signal.SIGINT)

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)
        self.popen.wait()
        self._log.close()

    def _signal_group(self, sig: int) -> None:
        """Signal the process's group (its session, as a pod's container), also once the process
        itself has ended: what it started lives on in the group (a SIGKILLed agent's script), as
        it would not in a container, whose processes all end with it. While any member lives
        the kernel gives the group's id to no other process."""
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the group is empty


def stop_all(processes: Sequence[Process]) -> None:
    """Stop every process (Process.stop), wait STOP_GRACE_S for them, then SIGKILL what is left:
    a sidecar that waits to join a world does not end on SIGINT."""
    for p in processes:
        p.stop()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in processes:
        try:
            p.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        p.kill()


def rank_env(job: specs.JobSpec, replica: int, local_rank: int, socket_dir: Path,
             master_port: int, world_epoch: int = 0) -> dict[str, str]:
    """This process's environment plus a pod's (wellknown.rank_env), on one machine."""
    env = dict(os.environ)
    env.update(wellknown.rank_env(
        world_size=job.world_size, gpus_per_replica=job.gpus_per_replica, replica=replica,
        local_rank=local_rank, master_addr=wellknown.LOOPBACK, master_port=master_port,
        socket_dir=str(socket_dir), world_epoch=world_epoch))
    env[wellknown.JOB_UID_ENV] = LOCAL_JOB_UID
    return env


LOCAL_JOB_UID = wellknown.LOCAL_JOB_UID
"""The job UID of every `splitfeed local` run: a run resumes what earlier runs of the same
manifest (name, namespace, checkpoint.uri) saved, as a re-applied StreamingJob would not."""


def first_world_epoch(job: specs.JobSpec, storage_options_dir: Path | None) -> int:
    """Number this run's worlds after every earlier run's, so checkpoint fencing holds."""
    if not job.checkpoint.uri:
        return 0
    from splitfeed.sidecar.world import checkpoints
    from splitfeed.sidecar.table import storage_options

    options = checkpoints.store_options(job, storage_options.read_storage_options(storage_options_dir))
    store = checkpoints.Store(job.checkpoint.uri, job.namespace, job.name, options, uid=LOCAL_JOB_UID)
    newest = store.newest_world()
    return 0 if newest is None else newest + 1


@dataclasses.dataclass
class World:
    """One topology's processes, as a world of pods (docs/agreement.md)."""

    epoch: int
    job: specs.JobSpec
    coordinator: str
    sidecars: list[Process]
    trainers: list[Process]
    stats: list[Path]
    reports: list[Path]
    started: float
    resume_step: int | None
    master_port: int = 0
    drain_to: tuple[int, int] | None = None
    """(STEP, REPLICAS) of the --scale-at entry this world was asked ahead to drain for."""
    ports: tuple[int, int] | None = None
    """In place: the even worlds' (rendezvous, coordinator) ports; odd worlds use them + stride."""
    socket_dirs: list[Path] = dataclasses.field(default_factory=list)
    keypair: keys.Keypair | None = None
    """The run's CURVE keypair (run_keys), for this launcher's own requests to the coordinator."""

    def stop(self) -> None:
        stop_all(self.trainers + self.sidecars)

    def failure(self) -> str | None:
        for p in self.trainers + self.sidecars:
            code = p.popen.poll()
            if code not in (None, 0):
                return f"{p.name} exited with code {code}:\n{p.tail()}"
        return None

    def finished(self) -> bool:
        return all(p.popen.poll() == 0 for p in self.trainers + self.sidecars)

    def trainers_exited(self) -> tuple[list[str], list[str]]:
        """(trainers that exited 0, trainers still running), by name."""
        codes = [(p.name, p.popen.poll()) for p in self.trainers]
        return [n for n, c in codes if c == 0], [n for n, c in codes if c is None]

    def total_steps(self) -> int:
        """The job's global steps, as the trainers were told (0 before any batch)."""
        return total_steps([read_json(f) for f in self.stats])

    def steps(self) -> list[int]:
        """Each rank's trained global steps where its loop says (StreamClient.trained), else its
        received ones (its last step + 1; 0 before the first)."""
        return [_steps_done(read_json(f)) for f in self.stats]


def _steps_done(record: dict[str, Any]) -> int:
    """A stats record's completed steps: trained if said, else received (a framework that reads
    ahead received more than it trained; the steps after a drain counts are those trained)."""
    trained = record.get("trained")
    return int(trained) if isinstance(trained, int) else int(record.get("last_step", -1)) + 1


def start_world(job: specs.JobSpec, epoch: int, argv: list[str], work: Path, logs: Path, *,
                resume: str, resume_step: int | None, storage_options_dir: Path | None,
                forks: forkserver.Server | None = None, in_place: bool = False) -> World:
    """One sidecar per replica, one trainer per rank, with the environment pods get."""
    ports = (free_port_pair(), free_port_pair()) if in_place else None
    world = start_trainers(job, epoch, argv, work, logs, ports=ports)
    start_sidecars(world, work, logs, resume=resume, resume_step=resume_step,
                   storage_options_dir=storage_options_dir, forks=forks)
    return world


def new_world(job: specs.JobSpec, epoch: int, ports: tuple[int, int] | None) -> World:
    """World `epoch`, no processes yet: in place on the pair of `ports` (WorldLayout.at), else on
    fresh ports of its own."""
    if ports is not None:
        at = layout.WorldLayout.at(epoch, replicas=job.replicas, gpus_per_replica=job.gpus_per_replica,
                                   in_place=True, ports=ports)
        master_port, coordinator = at.master_port, at.coordinator
    else:
        master_port, coordinator = free_port(), f"tcp://{wellknown.LOOPBACK}:{free_port()}"
    return World(epoch, job, coordinator, [], [], [], [], time.monotonic(), None, master_port, ports=ports)


AGENT = [*SIDECAR_MODULE, "run", "--"]
"""`splitfeed run --`: what an in-place job's trainer container runs (trainer_client.agent)."""


def keys_dir(work: Path) -> Path:
    """Where a run keeps its own CURVE keypair (trainer_client.keys), inside its 0700 work dir."""
    return work / "keys"


def run_keys(work: Path) -> keys.Keypair:
    """A fresh keypair for this run, as the operator makes one per StreamingJob: its sidecars,
    trainers and this launcher hold it, and nothing else on the machine can drive the world."""
    return keys.create(keys_dir(work))


def _socket_dir(work: Path, epoch: int, replica: int) -> Path:
    """Replica `replica`'s socket directory in world `epoch` (its pod's emptyDir)."""
    return work / f"w{epoch}-replica-{replica}"


def stats_file(work: Path, epoch: int | str, rank: int | str) -> Path:
    """Where rank `rank`'s client writes its stats in world `epoch` (SPLITFEED_STATS_FILE)."""
    return work / f"w{epoch}-stats-{rank}.json"


def start_trainers(job: specs.JobSpec, epoch: int, argv: list[str], work: Path, logs: Path, *,
                   ports: tuple[int, int] | None = None, replicas: range | None = None,
                   into: World | None = None) -> World:
    """A world's trainers alone. They import and then say hello until their sidecar answers
    (the client waits for a sidecar that is still starting), so a rescale starts them while
    the old world drains, before the step the sidecars resume at is known.

    `ports`: an in-place run, its trainers under the agent; `replicas` (into `into`): only
    those, the new pods of an in-place scale-up."""
    world = into or new_world(job, epoch, ports)
    world.keypair = world.keypair or keys.load(keys_dir(work))
    master_port = world.master_port
    for replica in replicas if replicas is not None else range(job.replicas):
        socket_dir = _socket_dir(work, epoch, replica)
        socket_dir.mkdir(mode=0o700)  # owner-only, like the run's work dir (docs/security.md)
        world.socket_dirs.append(socket_dir)
        for local_rank in range(job.gpus_per_replica):
            env = rank_env(job, replica, local_rank, socket_dir, master_port, epoch)
            env[wellknown.KEYS_DIR_ENV] = str(keys_dir(work))  # a stand-in's ask (trainer_client.stranded)
            stats = stats_file(work, epoch, env[wellknown.RANK])
            # Under the agent the client fills in the world it serves (trainer_client.counters).
            env[wellknown.STATS_FILE_ENV] = str(stats_file(work, "{world}", env[wellknown.RANK])
                                               if ports is not None else stats)
            world.stats.append(stats)
            command = AGENT + argv if ports is not None else argv
            world.trainers.append(Process(f"w{epoch}-trainer-{env[wellknown.RANK]}", command, env, logs))
    return world


def start_sidecars(world: World, work: Path, logs: Path, *, resume: str, resume_step: int | None,
                   storage_options_dir: Path | None, forks: forkserver.Server | None = None,
                   replicas: range | None = None) -> None:
    """One sidecar per replica of `world` (or of `replicas`), resuming at `resume_step`."""
    job, epoch = world.job, world.epoch
    config = work / wellknown.CONFIG_FILE
    if not config.exists():
        config.write_text(json.dumps(job.data_config()))
    world.resume_step = resume_step
    for replica in replicas if replicas is not None else range(job.replicas):
        socket_dir = _socket_dir(work, epoch, replica)
        env = rank_env(job, replica, 0, socket_dir, world.master_port, epoch)
        env.update(wellknown.sidecar_env(coordinator=world.coordinator, job_uid=LOCAL_JOB_UID,
                                        resume_step=resume_step, resume=resume))
        env[metrics.METRICS_PORT_ENV] = metrics.local_port(os.environ, replica)
        env[wellknown.KEYS_DIR_ENV] = str(keys_dir(work))
        report = work / f"w{epoch}-report-{replica}.json"
        sidecar_argv = [*SIDECAR_MODULE, "sidecar", "--config", str(config), "--termination-log", str(report)]
        if storage_options_dir is not None:
            sidecar_argv += ["--storage-options-dir", str(storage_options_dir)]
        world.reports.append(report)
        world.sidecars.append(Process(f"w{epoch}-sidecar-{replica}", sidecar_argv, env, logs, forks))


def read_json(path: Path) -> dict[str, Any]:
    """A stats file or a sidecar's report; {} while it is missing or half written."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def total_steps(stats: Sequence[Mapping[str, Any]]) -> int:
    """The job's global steps, as the trainers' stats files say (0 before any batch)."""
    return max((int(s.get("total_steps", 0)) for s in stats), default=0)
