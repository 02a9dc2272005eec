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

This module is the run and its loop (when to change a world, when the run ends); the
processes are local/processes.py's, a change of world local/rescaling.py's, what the run
prints local/console.py's.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from splitfeed.trainer_client.contract import errors, specs

from . import forkserver

from . import rescaling
from .console import PREFIX, Progress, Rescale, summary
from .processes import (World, die_with_parent, first_world_epoch, read_json, run_keys, shm_root, start_world,
                        trainer_command)

EARLY_STOP_GRACE_S = 3.0
"""After every trainer of a world exited 0, how long its sidecars get to end on their own
(the job's last step, a drain) before the run counts as stopped early by the trainers."""


def parse_scale_at(text: str) -> tuple[int, int]:
    """`STEP:REPLICAS` of --scale-at."""
    step, sep, replicas = text.partition(":")
    if not sep or not step.isdigit() or not replicas.isdigit() or int(replicas) < 1:
        raise errors.UserError(f"--scale-at {text!r}: expected STEP:REPLICAS, e.g. 20:4")
    return int(step), int(replicas)


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
    forks = forkserver.Server(str(logs / "forkserver.log"), preexec_fn=die_with_parent,
                              streaming=bool(job.data.transform) or job.data.pack_sequences is not None)
    launch = rescaling.Launch(argv, work, logs, resume, storage_options_dir, forks, in_place)
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
            summary(history, time.monotonic() - started, out)
            for r in rescales:
                print(f"{PREFIX}{r}", file=out, flush=True)
        _rmtree(work)
    return _exit_code(interrupted, failure, stopped, out)


def _follow(history: list[World], rescales: list[Rescale], launch: rescaling.Launch,
            plan: list[tuple[int, int]], control: Path, display: Progress,
            out: IO[str]) -> tuple[str | None, str | None]:
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
            change = rescaling.rescale_in_place if launch.in_place else rescaling.rescale
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
    reports = [read_json(r) for r in world.reports]
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


def _ask_ahead(world: World, plan: list[tuple[int, int]], display: Progress) -> None:
    """Ask `world` now to drain at the next --scale-at STEP at the earliest (see the module's docstring)."""
    if world.drain_to is not None or not plan or world.job.data.drops_rows:
        return
    step, replicas = plan[0]
    if replicas == world.job.replicas:
        return  # nothing to change: _wanted_replicas drops the entry when it is reached
    if rescaling.request_rescale(world, timeout_s=0.25, not_before=step,
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


def _rmtree(path: Path) -> None:
    if path.is_dir():
        for child in path.iterdir():
            _rmtree(child)
        path.rmdir()
    else:
        path.unlink(missing_ok=True)
