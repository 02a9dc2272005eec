"""`splitfeed local`: a StreamingJob's ranks as local processes, as pods would run them.

One sidecar per replica (serving its gpusPerReplica ranks) and one trainer
process per rank, each with the environment the operator gives pods
(docs/pod-contract.md). Any failed process stops the run with its error;
Ctrl-C stops every process. Progress comes from the trainers' stats files.

A live rescale (`--scale-at STEP:REPLICAS`, or a count written to the run's
`replicas` file) walks the cluster's path: a drain request to the world's
coordinator, every rank checkpoints at the one agreed step, and the next
world starts exactly there (SPLITFEED_RESUME_STEP), as the operator does.
`--scale-at` asks the world as soon as its coordinator answers to drain at STEP at
the earliest, so the world drains exactly at STEP unless it had already published
past it; a job that drops rows (onTransformError skip/warn) is asked once its
trainers reach STEP (its coordinator cannot fix a step it has not read yet).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from splitfeed.trainer_client.contract import wellknown, errors, membership, specs, stalls
from splitfeed.trainer_client.transport import keys, worlds

from splitfeed.sidecar.forks import forkserver
from splitfeed.sidecar.serving import metrics

PREFIX = "splitfeed local: "
"""What every line `splitfeed local` prints starts with."""
STOP_GRACE_S = 10.0
EARLY_STOP_GRACE_S = 3.0
"""After every trainer of a world exited 0, how long its sidecars get to end on their own
(the job's last step, a drain) before the run counts as stopped early by the trainers."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((wellknown.LOOPBACK, 0))
        return int(s.getsockname()[1])


def free_port_pair() -> int:
    """A free port P whose partner P + WORLD_PORT_STRIDE is free too: the even and odd worlds
    of an in-place run (trainer_client.membership.world_port)."""
    for _ in range(100):
        port = free_port()
        if port + membership.WORLD_PORT_STRIDE > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind((wellknown.LOOPBACK, port + membership.WORLD_PORT_STRIDE))
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


def _die_with_parent() -> None:
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
            warnings.filterwarnings("ignore", message=forkserver.FORK_WARNING, category=RuntimeWarning)
            self.popen = subprocess.Popen(list(argv), env=env, stdout=self._log,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=_die_with_parent)

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
    from splitfeed.sidecar.data import storage_options

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
        return _total_steps([_read_json(f) for f in self.stats])

    def steps(self) -> list[int]:
        """Each rank's trained global steps where its loop says (StreamClient.trained), else its
        received ones (its last step + 1; 0 before the first)."""
        return [_steps_done(_read_json(f)) for f in self.stats]


def _redone_and_lost(steps: list[int], cut: int) -> tuple[int, int]:
    """Steps trained past the world's cut (the next world trains them again) and steps before it
    that a rank never trained (a loop that read ahead and checkpointed what it was handed)."""
    return max(0, max(steps, default=cut) - cut), max(0, cut - min(steps, default=cut))


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
    """World `epoch`, no processes yet: in place on the pair of `ports` (membership.world_port),
    else on fresh ports of its own."""
    if ports is not None:
        master_port = membership.world_port(ports[0], epoch)
        coordinator = f"tcp://{wellknown.LOOPBACK}:{membership.world_port(ports[1], epoch)}"
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


def _stats_file(work: Path, epoch: int | str, rank: int | str) -> Path:
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
            stats = _stats_file(work, epoch, env[wellknown.RANK])
            # Under the agent the client fills in the world it serves (trainer_client.counters).
            env[wellknown.STATS_FILE_ENV] = str(_stats_file(work, "{world}", env[wellknown.RANK])
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


@dataclasses.dataclass
class Rescale:
    """What one live rescale cost: where the world cut, and how long each part took."""

    old: int
    new: int
    step: int
    requested_at: float
    """time.monotonic() of the drain request."""
    agreed_s: float
    first_batch_s: float | None = None
    redone: int = 0
    lost: int = 0
    """Steps before the cut that some rank said it never trained (StreamClient.trained)."""
    in_place: bool = False

    def __str__(self) -> str:
        first = "-"
        if self.first_batch_s is not None:
            # From the drain on: what the change itself cost (a --scale-at request is made ahead).
            first = f"{self.first_batch_s:.1f} s ({self.first_batch_s - self.agreed_s:.1f} s after the drain)"
        how = " in place" if self.in_place else ""
        return (f"rescale {self.old} -> {self.new} replicas{how} at global step {self.step}: old world "
                f"checkpointed {self.agreed_s:.1f} s after the request, new world's first batch after "
                f"{first}; {self.redone} steps redone"
                + (f"; {self.lost} steps before the cut never trained by some rank" if self.lost else ""))


def parse_scale_at(text: str) -> tuple[int, int]:
    """`STEP:REPLICAS` of --scale-at."""
    step, sep, replicas = text.partition(":")
    if not sep or not step.isdigit() or not replicas.isdigit() or int(replicas) < 1:
        raise errors.UserError(f"--scale-at {text!r}: expected STEP:REPLICAS, e.g. 20:4")
    return int(step), int(replicas)


@dataclasses.dataclass(frozen=True)
class Launch:
    """What every world of one run starts from: the trainers' command, the run's directories,
    how its sidecars resume and reach storage, the fork server, and how a rescale goes."""

    argv: list[str]
    work: Path
    logs: Path
    resume: str
    storage_options_dir: Path | None
    forks: forkserver.Server | None
    in_place: bool


def run(job: specs.JobSpec, *, command: list[str] | None, resume: str,
        storage_options_dir: Path | None = None, progress: bool = True,
        out: IO[str] = sys.stderr, scale_at: Sequence[tuple[int, int]] = (),
        in_place: bool = False) -> int:
    """Run the job's worlds until it ends; rescale live at `scale_at` steps or on request."""
    argv = command or trainer_command(job)
    work = Path(tempfile.mkdtemp(prefix=f"splitfeed-{job.name}-", dir=shm_root()))
    logs = Path(tempfile.mkdtemp(prefix=f"splitfeed-{job.name}-logs-"))
    control = work / "replicas"
    print(f"{PREFIX}{job.name}: {job.replicas} replicas x {job.gpus_per_replica} "
          f"= {job.world_size} ranks; logs in {logs}\n"
          f"  rescale while it runs: echo N > {control}", file=out, flush=True)
    started = time.monotonic()
    display = Progress(out, enabled=progress)
    history: list[World] = []
    rescales: list[Rescale] = []
    interrupted = False
    failure: str | None = None
    stopped: str | None = None
    # Sidecars fork from one process that imported lancedb and torch once (forkserver's doc).
    forks = forkserver.Server(str(logs / "forkserver.log"), preexec_fn=_die_with_parent,
                              streaming=bool(job.data.transform) or job.data.pack_sequences is not None)
    launch = Launch(argv, work, logs, resume, storage_options_dir, forks, in_place)
    try:
        run_keys(work)
        history.append(start_world(job, first_world_epoch(job, storage_options_dir), argv, work, logs,
                                   resume=resume, resume_step=None, storage_options_dir=storage_options_dir,
                                   forks=forks, in_place=in_place))
        stopped, failure = _follow(history, rescales, launch, sorted(scale_at), control, display, out)
    except KeyboardInterrupt:
        interrupted = True
        print(f"\n{PREFIX}interrupted; stopping every process", file=out)
    except errors.UserError as exc:
        failure = str(exc)
    finally:
        display.close()
        if history:
            history[-1].stop()
            if not failure and not interrupted:
                stopped = stopped_early(history[-1])  # from the reports, before `work` goes
        forks.close()
        if not interrupted:
            _summary(history, time.monotonic() - started, out)
            for r in rescales:
                print(f"{PREFIX}{r}", file=out, flush=True)
        _rmtree(work)
    return _exit_code(interrupted, failure, stopped, out)


def _follow(history: list[World], rescales: list[Rescale], launch: Launch, plan: list[tuple[int, int]],
            control: Path, display: Progress, out: IO[str]) -> tuple[str | None, str | None]:
    """Watch the world running now, the last of `history`, until the job ends; change it when
    --scale-at (`plan`) or the control file asks, appending each next world and its Rescale.
    (Why the trainers ended the run, why it failed): both None when it reached its end."""
    world = history[-1]
    ended = EndWatch()
    while True:
        failure = world.failure()
        finished = world.finished()
        # Before the end check: a world that served and ended between two looks (the job's
        # last steps after a late change) still times its change's first batch.
        steps = world.steps()
        _time_first_batch(rescales, world, steps)
        if failure or (finished and (world.drain_to is None or world.drain_to[0] >= world.total_steps())):
            return None, failure  # done; a --scale-at step past the job's end drained nothing
        if world.drain_to is None:
            stopped, failure = ended.check(world, time.monotonic())
            if stopped or failure:
                return stopped, failure
        _ask_ahead(world, plan, display)
        # In place, a change asked ahead starts at once (a scale-up's new replicas start while
        # the world trains), once the change before it reached its first batch (timed).
        changed = not rescales or rescales[-1].first_batch_s is not None
        target = _due_replicas(world, plan, control, steps, (launch.in_place and changed) or finished, out)
        if target is not None:
            change = _rescale_in_place if launch.in_place else _rescale
            world, rescale = change(world, target, launch, display)
            if rescale is None:
                return None, None  # the job ended before the change could start
            history.append(world)
            rescales.append(rescale)
            continue
        display.update(world, rescales)
        time.sleep(0.1)


def _time_first_batch(rescales: list[Rescale], world: World, steps: list[int]) -> None:
    """Time the last rescale to its world's first batch, once a rank got past the resume step."""
    if rescales and rescales[-1].first_batch_s is None and max(steps) > (world.resume_step or 0):
        rescales[-1].first_batch_s = time.monotonic() - rescales[-1].requested_at


def _due_replicas(world: World, plan: list[tuple[int, int]], control: Path, steps: list[int],
                  drain_now: bool, out: IO[str]) -> int | None:
    """The replica count to change `world` to now, if any: that of the drain it was asked ahead
    for, once due (`drain_now`, or every rank reached its step); else what --scale-at or the
    control file asks (_wanted_replicas)."""
    if world.drain_to is not None and (drain_now or min(steps) >= world.drain_to[0]):
        return world.drain_to[1]
    return _wanted_replicas(plan, control, min(steps), world.job.replicas, out)


def _exit_code(interrupted: bool, failure: str | None, stopped: str | None, out: IO[str]) -> int:
    """The run's exit code (130 interrupted, 1 failed, 0 otherwise), saying why it ended."""
    if interrupted:
        return 130
    if failure:
        print(f"{PREFIX}failed: {failure}", file=out)
        return 1
    if stopped:
        print(f"{PREFIX}{stopped}", file=out, flush=True)
    return 0


def stopped_early(world: World) -> str | None:
    """What a run whose trainers returned before its last step says, from the sidecars'
    reports (the trainers' stats files are written now and then, the reports as the
    sidecars stop); None for a run that reached its end."""
    reports = [_read_json(r) for r in world.reports]
    if not reports or not all(reports) or any(r.get("drained") for r in reports):
        return None
    step = min(int(r.get("globalStep", 0)) for r in reports)
    total = max(int(r.get("stepsPerEpoch", 0)) for r in reports) * world.job.data.epochs
    if step >= total:
        return None
    return (f"trainers stopped at global step {step} of {total}: the run ends there; its newest "
            "complete checkpoint resumes it (--resume latest)")


class EndWatch:
    """Trainers that return before the job's last step (a max_steps loop, an early stop)
    end the run cleanly; some ranks returned while the others still wait (a DDP peer gone)
    fail it after spec.checkpoint.timeoutSeconds, naming them, instead of hanging."""

    def __init__(self) -> None:
        self._all_since: float | None = None
        self._some_since: float | None = None

    def check(self, world: World, now: float) -> tuple[str | None, str | None]:
        """(why the trainers ended the run, why it failed); both None while it goes on."""
        exited, running = world.trainers_exited()
        if exited and not running:
            self._all_since = self._all_since or now
            if now - self._all_since < EARLY_STOP_GRACE_S:
                return None, None  # the sidecars may be ending on their own
            return "trainers stopped", None
        self._all_since = None
        if exited and running:
            self._some_since = self._some_since or now
            timeout = world.job.checkpoint.timeout_seconds
            if now - self._some_since > timeout:
                return None, (f"{', '.join(exited)} returned but {', '.join(running)} still ran "
                              f"{timeout} s later (spec.checkpoint.timeoutSeconds): a rank that "
                              "stops early stops its DDP peers' collectives; stop every rank at "
                              "the same step")
        else:
            self._some_since = None
        return None, None


def _rescale_token(world: World) -> str:
    """The one token for `world`'s rescale: asked ahead or when due, the coordinator counts it once."""
    return f"rescale-w{world.epoch}"


def _request_rescale(world: World, *, timeout_s: float, not_before: int = 0, replicas: int = 0) -> str | None:
    """Ask `world`'s coordinator to drain for its rescale (worlds.request_drain, under the one
    token); its answer, or None while it does not answer yet."""
    return worlds.request_drain(world.coordinator, _rescale_token(world), "rescale", timeout_s=timeout_s,
                                not_before=not_before, replicas=replicas, keys=world.keypair)


def _ask_ahead(world: World, plan: list[tuple[int, int]], display: Progress) -> None:
    """Ask `world` now to drain at the next --scale-at STEP at the earliest (see the module's docstring)."""
    if world.drain_to is not None or not plan or world.job.data.drops_rows:
        return
    step, replicas = plan[0]
    if replicas == world.job.replicas:
        return  # nothing to change: _wanted_replicas drops the entry when it is reached
    if _request_rescale(world, timeout_s=0.25, not_before=step,
                        replicas=replicas if world.ports else 0) is None:
        return  # the coordinator is still starting: ask again on the next turn
    world.drain_to = plan.pop(0)
    display.note(f"world {world.epoch} asked to drain at global step {step} for {replicas} replicas")


def _wanted_replicas(plan: list[tuple[int, int]], control: Path, step: int, current: int,
                     out: IO[str]) -> int | None:
    """A replica count other than `current` that --scale-at or the control file asks for now."""
    wanted: int | None = None
    if plan and plan[0][0] <= step:  # one at a time: each rescale gets a world of its own
        wanted = plan.pop(0)[1]
    try:
        text = control.read_text().strip()
        control.unlink()
    except OSError:
        text = ""
    if text:
        if text.isdigit() and int(text) > 0:
            wanted = int(text)
        else:
            print(f"{PREFIX}{control}: {text!r} is not a replica count; ignored", file=out)
    return wanted if wanted is not None and wanted != current else None


def _rescaled_job(world: World, replicas: int) -> specs.JobSpec:
    """`world`'s job with `replicas` replicas; a UserError when that topology is not valid."""
    job = dataclasses.replace(world.job, replicas=replicas)
    try:
        job.check_topology()
    except ValueError as exc:
        raise errors.UserError(f"cannot rescale to {replicas} replicas: {exc}") from exc
    return job


def _drain_note(world: World, replicas: int, *, in_place: bool) -> str:
    """What the run says as `world`'s rescale starts."""
    how = " in place" if in_place else ""
    return (f"rescaling {world.job.replicas} -> {replicas} replicas{how}: "
            + (f"world {world.epoch} drains at global step {world.drain_to[0]}" if world.drain_to
               else f"asking world {world.epoch} to drain"))


def _agreed_step(world: World) -> int:
    """The one step at which the sidecars of the drained `world` report it agreed to stop."""
    agreed = {_read_json(r).get("agreedStep") for r in world.reports}
    if len(agreed) != 1 or None in agreed:
        raise errors.UserError(f"world {world.epoch} ended without one agreed step (reports: {agreed})")
    return int(agreed.pop())  # type: ignore[arg-type]


def _rescale(world: World, replicas: int, launch: Launch, display: Progress) -> tuple[World, Rescale | None]:
    """Drain `world` at one agreed step, as the operator does, and start the next one there."""
    job = _rescaled_job(world, replicas)
    display.note(_drain_note(world, replicas, in_place=False))
    asked = time.monotonic()
    # The next world's trainers start now and import while this one drains; its sidecars
    # (forked, so quick to start) only once the step they resume at is agreed.
    nxt = start_trainers(job, world.epoch + 1, launch.argv, launch.work, launch.logs)
    try:
        while not world.finished():
            failure = world.failure()
            if failure:
                raise errors.UserError(f"world {world.epoch} failed while draining: {failure}")
            if world.drain_to is None and _request_rescale(world, timeout_s=1.0) is None:
                time.sleep(0.2)  # the coordinator is still starting: ask again
                continue
            time.sleep(0.1)
            display.update(world, [])
        step = _agreed_step(world)
        redone, lost = _redone_and_lost(world.steps(), step)
        rescale = Rescale(world.job.replicas, replicas, step, asked, time.monotonic() - asked,
                          redone=redone, lost=lost)
        display.note(f"world {world.epoch} drained at global step {step}; world {world.epoch + 1} "
                     f"starts there with {replicas} replicas")
        start_sidecars(nxt, launch.work, launch.logs, resume=launch.resume, resume_step=step,
                       storage_options_dir=launch.storage_options_dir, forks=launch.forks)
    except BaseException:
        nxt.stop()
        raise
    return nxt, rescale


IN_PLACE_TIMEOUT_S = 300.0
"""How long an in-place rescale may take from the request to the next world serving."""
READY_WAIT_S = 120.0
"""How long a scale-up lets the old world train on while its new pods start (their trainers
import and reach their first hello) before it asks for the drain regardless."""


class _EndedFirst(errors.SplitfeedError):
    """The world ended (the job's last step, or its trainers returned) before its in-place
    change was asked of it: a scale-up's new pods were still starting."""


def _rescale_in_place(world: World, replicas: int, launch: Launch,
                      display: Progress) -> tuple[World, Rescale | None]:
    """Change `world` in place, as the operator's `spec.rescale: inPlace` does: the processes
    of replicas 0..min(N, M) - 1 stay; new replicas start now, while the world still trains,
    and wait for the agreed step; replicas >= M end after the drain."""
    job = _rescaled_job(world, replicas)
    assert world.ports is not None
    old = world.job.replicas
    display.note(_drain_note(world, replicas, in_place=True))
    asked = time.monotonic()
    kept = min(old, replicas)
    nxt = _kept_world(world, job, kept, launch.work)
    added = range(kept, replicas)
    if added:  # the new pods start now and wait for the world they join
        start_trainers(job, nxt.epoch, launch.argv, launch.work, launch.logs, ports=world.ports,
                       replicas=added, into=nxt)
        start_sidecars(nxt, launch.work, launch.logs, resume=launch.resume, resume_step=None,
                       storage_options_dir=launch.storage_options_dir, forks=launch.forks, replicas=added)
    try:
        now = _await_in_place(world, nxt, kept, asked, display)
    except BaseException as exc:
        per = job.gpus_per_replica
        stop_all(nxt.sidecars[kept:] + nxt.trainers[kept * per:])
        if isinstance(exc, _EndedFirst):
            display.note(f"world {world.epoch} ended before its new replicas started; no rescale")
            return world, None
        raise
    step = now.resume_step
    nxt.resume_step = step
    redone, lost = _redone_and_lost(world.steps(), step)
    rescale = Rescale(old, replicas, step, asked, time.monotonic() - asked, redone=redone, lost=lost,
                      in_place=True)
    display.note(f"world {world.epoch} drained at global step {step}; world {nxt.epoch} goes on there "
                 f"in place with {replicas} replicas")
    return nxt, rescale


def _kept_world(world: World, job: specs.JobSpec, kept: int, work: Path) -> World:
    """The next world in place, before its new replicas start: the processes of `world`'s
    first `kept` replicas, as they run, with the stats files they write in it."""
    nxt = new_world(job, world.epoch + 1, world.ports)
    nxt.keypair = world.keypair  # the next change asks with it (start_trainers sets it for new pods only)
    per = job.gpus_per_replica
    nxt.sidecars, nxt.trainers = world.sidecars[:kept], world.trainers[:kept * per]
    nxt.socket_dirs, nxt.reports = world.socket_dirs[:kept], world.reports[:kept]
    nxt.stats = [_stats_file(work, nxt.epoch, r) for r in range(kept * per)]
    return nxt


def _await_in_place(world: World, nxt: World, kept: int, asked: float,
                    display: Progress) -> membership.World:
    """Ask `world` to change into `nxt` once `nxt`'s new pods wait for it (or READY_WAIT_S
    passed), then wait until `nxt` serves and `world`'s leaving replicas ended; the world
    file that says so. UserError when a process fails or the change does not happen."""
    per = nxt.job.gpus_per_replica
    leaving = world.sidecars[kept:] + world.trainers[kept * per:]
    deadline = asked + IN_PLACE_TIMEOUT_S
    acked = world.drain_to is not None
    ready_by = asked + READY_WAIT_S
    while True:
        failure = world.failure() or nxt.failure()
        if failure:
            raise errors.UserError(f"world {world.epoch} failed while changing in place: {failure}")
        if not acked and world.finished():
            raise _EndedFirst  # not asked yet: its last step came while the new pods started
        if not acked and time.monotonic() < ready_by and not all(
                membership.waiting(d, per) for d in nxt.socket_dirs[kept:]):
            time.sleep(0.05)  # the old world trains on while the new pods start
            display.update(world, [])
            continue
        if not acked:
            acked = _request_rescale(world, timeout_s=1.0, replicas=nxt.job.replicas) is not None
            if not acked:
                time.sleep(0.2)  # the coordinator is still starting: ask again
                continue
        now = membership.read(world.socket_dirs[0])
        if (now is not None and now.epoch == nxt.epoch and all(p.popen.poll() == 0 for p in leaving)):
            return now  # the new world serves (or, a short one, already served and ended)
        if now is not None and now.state == membership.ENDED and now.epoch == world.epoch:
            raise errors.UserError(f"world {world.epoch} ended instead of changing in place: "
                                   f"{world.sidecars[0].tail()}")
        if time.monotonic() > deadline:
            raise errors.UserError(f"world {world.epoch} did not change in place within "
                                   f"{IN_PLACE_TIMEOUT_S:g} s")
        time.sleep(0.02)
        display.update(world, [])


def _rmtree(path: Path) -> None:
    if path.is_dir():
        for child in path.iterdir():
            _rmtree(child)
        path.rmdir()
    else:
        path.unlink(missing_ok=True)


class Progress:
    """A tqdm bar on a terminal; a plain line every PLAIN_EVERY_S otherwise (CI logs)."""

    PLAIN_EVERY_S = 5.0

    def __init__(self, out: IO[str], *, enabled: bool) -> None:
        self.out = out
        self.enabled = enabled
        self.tty = enabled and out.isatty()
        self._bar: Any = None
        self._next_line = time.monotonic() + self.PLAIN_EVERY_S
        self._last: tuple[int, float] | None = None

    def note(self, text: str) -> None:
        """A line above the bar (a rescale event)."""
        if self._bar is not None:
            self._bar.write(f"{PREFIX}{text}", file=self.out)
        else:
            print(f"{PREFIX}{text}", file=self.out, flush=True)

    def update(self, world: World, rescales: Sequence[Rescale]) -> None:
        if not self.enabled:
            return
        stats = [_read_json(f) for f in world.stats]
        total = _total_steps(stats)
        rows, streaming, stall = _flow(stats)
        rate = rows / streaming if streaming >= 1.0 else 0.0  # a rate over a blink says nothing
        # Steps every rank has taken; before a rank's first batch, where the world resumed.
        start = world.resume_step or 0
        done = min((int(s.get("last_step", start - 1)) + 1 for s in stats), default=start)
        label = f"world {world.epoch} ({world.job.world_size} ranks)"
        if self.tty:
            from tqdm import tqdm

            if self._bar is None and total:
                self._bar = tqdm(total=total, file=self.out, unit="step", dynamic_ncols=True)
            if self._bar is not None:
                self._bar.n = done
                self._bar.set_description(label, refresh=False)
                self._bar.set_postfix_str(f"{rate:,.0f} rows/s, stall {stall:.0%}", refresh=False)
                self._bar.refresh()
            return
        now = time.monotonic()
        # A line when the step moved (or, while it waits, every few plain periods): no repeats.
        if now >= self._next_line and (self._last is None or done != self._last[0]
                                       or now - self._last[1] >= 6 * self.PLAIN_EVERY_S):
            self._next_line = now + self.PLAIN_EVERY_S
            of = f"/{total}" if total else ""
            spe = max((int(s.get("steps_per_epoch", 0)) for s in stats), default=0)
            epoch = f" (epoch {done // spe}, step {done % spe}/{spe})" if spe else ""
            print(f"{PREFIX}{label}: global step {done}{of}{epoch}, {rate:,.0f} rows/s, "
                  f"data stall {stall:.0%}{self._eta(done, total, now)}", file=self.out, flush=True)

    def _eta(self, done: int, total: int, now: float) -> str:
        """Time left at the pace since the last line (steps, not rows: rescales change the rows per rank)."""
        last, self._last = self._last, (done, now)
        if last is None or not total or done <= last[0]:
            return ""
        left = (total - done) * (now - last[1]) / (done - last[0])
        return f", ETA {int(left) // 60}:{int(left) % 60:02d}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _read_json(path: Path) -> dict[str, Any]:
    """A stats file or a sidecar's report; {} while it is missing or half written."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _total_steps(stats: Sequence[Mapping[str, Any]]) -> int:
    """The job's global steps, as the trainers' stats files say (0 before any batch)."""
    return max((int(s.get("total_steps", 0)) for s in stats), default=0)


def _flow(stats: Sequence[Mapping[str, Any]]) -> tuple[int, float, float]:
    """(Rows received, seconds the longest rank streamed, data stall: the share of the ranks'
    streaming time spent waiting for data), from the trainers' stats files."""
    rows = sum(s.get("rows", 0) for s in stats)
    busy = sum(s.get("elapsed_s", 0.0) for s in stats)
    streaming = max((s.get("elapsed_s", 0.0) for s in stats), default=0.0)
    stall = sum(s.get("wait_s", 0.0) for s in stats) / busy if busy else 0.0
    return rows, streaming, stall


def _summary(history: Sequence[World], elapsed: float, out: IO[str]) -> None:
    """The run's last lines: the steps, rows, rate and data stall of every world together."""
    by_world = [[_read_json(f) for f in w.stats] for w in history]
    stats = [s for world in by_world for s in world]
    rows, streaming, stall = _flow(stats)
    # Every rank of a world takes one batch per global step it serves.
    steps = sum(max((int(s.get("batches", 0)) for s in world), default=0) for world in by_world)
    # rows/s over the time data flowed (first batch to last), not process start-up.
    rate = rows / streaming if streaming else 0.0
    ready = stalls.summarize(stalls.merge([s.get("data_ready_buckets") or [] for s in stats]), 0.0, 0.0)
    percentiles = ", ".join(f"{name} {value * 1000:.2f} ms" for name, value in
                            (("p50", ready.p50_s), ("p95", ready.p95_s), ("p99", ready.p99_s)) if value is not None)
    print(f"{PREFIX}{steps} global steps, {rows} rows in {elapsed:.1f} s; "
          f"{rate:.0f} rows/s while streaming, data stall {stall:.1%}"
          + (f"; data-ready latency {percentiles}" if percentiles else ""),
          file=out, flush=True)
    grid = _total_steps(stats)
    last = max((int(s.get("last_step", -1)) + 1 for s in stats), default=0)
    if history and history[-1].job.data.drops_rows and 0 < last < grid:
        # The progress line counted toward the grid; say why the run stopped short of it.
        print(f"{PREFIX}ended at global step {last}/{grid}: onTransformError="
              f"{history[-1].job.data.on_transform_error} dropped rows, and an epoch ends early at the "
              f"last step every rank can fill", file=out, flush=True)
