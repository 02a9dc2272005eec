"""A live rescale of a `splitfeed local` run, the operator's drain protocol done locally: a
drain request to the world's coordinator (under one token per world), every rank checkpoints
at the one agreed step, and the next world starts exactly there. `rescale` starts new
processes for every replica (spec.rescale: Recreate); `rescale_in_place` keeps the processes
of the replicas that stay, starts the new ones while the world still trains and ends the
leaving ones after the drain, as `spec.rescale: inPlace` does. When to change is the run
loop's business (local/running.py).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from splitfeed.trainer_client.contract import errors, membership, specs
from splitfeed.trainer_client.transport import worlds

from . import forkserver

from .console import Progress, Rescale
from .processes import World, new_world, read_json, start_sidecars, start_trainers, stats_file, stop_all


def _redone_and_lost(steps: list[int], cut: int) -> tuple[int, int]:
    """Steps trained past the world's cut (the next world trains them again) and steps before it
    that a rank never trained (a loop that read ahead and checkpointed what it was handed)."""
    return max(0, max(steps, default=cut) - cut), max(0, cut - min(steps, default=cut))


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


def _rescale_token(world: World) -> str:
    """The one token for `world`'s rescale: asked ahead or when due, the coordinator counts it once."""
    return f"rescale-w{world.epoch}"


def request_rescale(world: World, *, timeout_s: float, not_before: int = 0, replicas: int = 0) -> str | None:
    """Ask `world`'s coordinator to drain for its rescale (worlds.request_drain, under the one
    token); its answer, or None while it does not answer yet."""
    return worlds.request_drain(world.coordinator, _rescale_token(world), "rescale", timeout_s=timeout_s,
                                not_before=not_before, replicas=replicas, keys=world.keypair)


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
    agreed = {read_json(r).get("agreedStep") for r in world.reports}
    if len(agreed) != 1 or None in agreed:
        raise errors.UserError(f"world {world.epoch} ended without one agreed step (reports: {agreed})")
    return int(agreed.pop())  # type: ignore[arg-type]


def rescale(world: World, replicas: int, launch: Launch, display: Progress) -> tuple[World, Rescale | None]:
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
            if world.drain_to is None and request_rescale(world, timeout_s=1.0) is None:
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


def rescale_in_place(world: World, replicas: int, launch: Launch,
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
    nxt.stats = [stats_file(work, nxt.epoch, r) for r in range(kept * per)]
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
            acked = request_rescale(world, timeout_s=1.0, replicas=nxt.job.replicas) is not None
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
