"""`splitfeed sidecar`: load the job, open the table, resume, serve until done.

The edge where configuration, environment, storage and signals meet: the process (`run`),
its worlds one after another, and how each ends. A world is opened in `opening`; the logic
lives in `serving`, `reading`, `checkpoints`, `positions` and `transitions`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import signal
import time
from pathlib import Path
from typing import Any

from splitfeed.trainer_client.contract import wellknown, layout, membership
from splitfeed.trainer_client.transport import stranded

from .world import commitments, identity, transitions
from .world.settings import SidecarSettings, local_ranks, replica_of
from .data import reading, skipping
from .table import cgroups, planning
from .serving import ending, metrics, service, watching
from .forks import forking, planner
from .opening import Carried, NotInWorld, Sidecar, job_stores, load_job, prepare, write_world
from .table.storage_options import read_storage_options as read_storage_options

log = logging.getLogger(__name__)

FAILURE_GRACE_S = 10.0


def settings_from_env(**overrides: Any) -> SidecarSettings:
    """This pod's settings from its environment (docs/pod-contract.md); `overrides` that are
    not None win (the command line's)."""
    env = os.environ
    who = identity.from_env(env, need_uid=False)
    world = layout.WorldLayout.from_env(env)  # what the operator's WorldLayout.env gave this pod
    values: dict[str, Any] = {
        "job_uid": who.uid, "world_epoch": who.world_epoch, "table_version": who.table_version,
        "socket_dir": Path(env.get(wellknown.SOCKET_DIR_ENV, wellknown.SOCKET_DIR)),
        "rank": int(env.get(wellknown.RANK, "0")),
        "world_size": world.world_size, "local_world_size": world.gpus_per_replica,
        "resume": env.get(wellknown.RESUME_ENV, wellknown.RESUME_LATEST),
        "resume_step": int(env[wellknown.RESUME_STEP_ENV]) if env.get(wellknown.RESUME_STEP_ENV) else None,
        "replica": int(env[wellknown.NODE_RANK]) if env.get(wellknown.NODE_RANK) else None,
        "coordinator": world.coordinator or None,
        "checksum": env.get(wellknown.CONFIG_CHECKSUM_ENV) or None,
        "metrics_port": metrics.metrics_port(env) or None,
        "master_addr": world.master_addr, "master_port": world.master_port,
        "keys_dir": Path(env[wellknown.KEYS_DIR_ENV]) if env.get(wellknown.KEYS_DIR_ENV) else None,
    }
    values.update({k: v for k, v in overrides.items() if v is not None})
    return SidecarSettings(**values)


def serve(sidecar: Sidecar) -> int:
    """Serve until done, drained or stopped; write the exit report. Exit code."""
    code, report = serve_world(sidecar)
    finish(sidecar, report)
    return code


def serve_world(sidecar: Sidecar) -> tuple[int, wellknown.Report]:
    """Serve one world until it is done, drained or stopped, and close its server; (exit
    code, the report of this world). The plans, coordinator and metrics stay up: `finish`
    ends them, or the next world in place takes them over."""
    server, settings, failure = sidecar.server, sidecar.settings, sidecar.failure
    try:
        if failure is not None:
            server.fail_all(failure, grace_s=FAILURE_GRACE_S)
        else:
            log.info("serving ranks %s of %d at %s from global step %d of %d (world %d)",
                     [f.rank for f in server.feeds], settings.world_size, settings.socket_dir,
                     server.resume_step, server.total_steps, settings.world_epoch)
            tell_world(sidecar, membership.SERVING)
            watcher = watching.RequestWatcher(server, settings.podinfo_dir, settings.world_epoch)
            reporter = metrics.ProgressReporter(
                server, sidecar.steps_per_epoch,
                row_counts=lambda: {"filled_rows": reading.FILLED_ROWS[0],
                                    "skipped_rows": skipping.SKIPPED_ROWS[0]})

            def tick() -> None:
                watcher()
                reporter()

            server.run(tick=tick)
            if server.world_lost is not None:  # before the next world: the trainers stop at once
                tell_world(sidecar, membership.LOST)
            failure = next((f.session.failure for f in server.feeds if f.session.failure), None)
    except Exception as exc:  # a bug or a broken environment: still say why, in the report
        log.exception("the sidecar failed")
        failure = f"{type(exc).__name__}: {exc}"
    finally:
        global_step = min((f.control.acked + 1 for f in server.feeds), default=0)
        drained = bool(server.feeds) and all(f.session.drained for f in server.feeds)
        epoch, step = divmod(global_step, max(1, sidecar.steps_per_epoch))
        report: wellknown.Report = {
            "globalStep": global_step, "epoch": epoch, "step": step,
            "stepsPerEpoch": sidecar.steps_per_epoch,
            "lastCheckpoint": server.last_checkpoint,
            "drained": drained,
            "agreedStep": server.drain_step if drained else None,
            "drainReason": server.drain_reason,
            "resumeStep": server.resume_step,
            "tableVersion": sidecar.table_version,
            "error": failure,
            "permanent": bool(failure) and (
                (sidecar.permanent and failure == sidecar.failure)
                or any(f.session.permanent and f.session.failure == failure for f in server.feeds)),
            "filledRows": reading.FILLED_ROWS[0],
            "skippedRows": skipping.SKIPPED_ROWS[0],
        }
        server.close()
    return (2 if failure else 0), report


def finish(sidecar: Sidecar, report: wellknown.Report) -> None:
    """The sidecar ends: its plans, coordinator and world file say so; the report is written."""
    log.info("peak RSS %.0f MiB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if sidecar.builder is not None:
        sidecar.builder.close()
    if sidecar.coordinator is not None:
        sidecar.coordinator.close()
    tell_world(sidecar, membership.ENDED)
    write_report(sidecar.settings.termination_log, report)


def tell_world(sidecar: Sidecar, state: str) -> None:
    """Write the world file the trainer's side reads (trainer_client.membership)."""
    write_world(sidecar.settings, state, sidecar.server.resume_step)


def _next_world(sidecar: Sidecar, report: wellknown.Report, stopping: bool) -> SidecarSettings | None:
    """transitions.next_world, told what this world's server and coordinator know."""
    server, coordinator = sidecar.server, sidecar.coordinator
    return transitions.next_world(
        sidecar.settings, report, stopping, lost=server.world_lost, next_replicas=server.next_replicas,
        total_steps=server.total_steps, coordinator=coordinator.coordinator if coordinator is not None else None,
        table_version=sidecar.table_version)


STAND_IN_WAIT_S = 60.0
"""How long replica 0's sidecar, its own ranks drained, keeps the world's coordinator up until
every member committed the drain step: a member whose sidecar died commits through it
(sidecar.standins). Members that commit as usual take milliseconds."""


STORE_LOOK_S = 0.5
"""How often replica 0, waiting for its members, also looks whether the store holds the step
complete: a coordinator restarted during the drain was not told of commits made before."""


def wait_for_members(sidecar: Sidecar, report: wellknown.Report, signals: Signals) -> None:
    """Replica 0, after a drain that ends it: wait (at most STAND_IN_WAIT_S, or until a SIGTERM
    comes meanwhile: the pod is being deleted) until every member committed the drain step, so
    that a trainer whose own sidecar died can still commit that step through this coordinator
    (docs/agreement.md)."""
    step = report.get("agreedStep")
    if sidecar.coordinator is None or not report.get("drained") or step is None:
        return
    coordinator, termed = sidecar.coordinator.coordinator, len(signals.times)
    deadline, looked = time.monotonic() + STAND_IN_WAIT_S, time.monotonic()
    while (coordinator.complete_step or -1) < step:
        if sidecar.stores and time.monotonic() - looked > STORE_LOOK_S:
            looked = time.monotonic()  # members that committed before this coordinator (re)started
            with contextlib.suppress(Exception):  # a flaky read: the next look, or the deadline
                if sidecar.stores[0].complete(step):
                    return
        if time.monotonic() > deadline or len(signals.times) > termed:
            log.error("not every member committed drain step %d within %.0f s: the next world resumes "
                      "from the newest complete checkpoint", step, STAND_IN_WAIT_S)
            return
        time.sleep(0.01)


def carry(sidecar: Sidecar, report: wellknown.Report) -> Carried:
    """What the next world in place takes over from this one."""
    return Carried(builder=sidecar.builder, plan=sidecar.plan, metrics=sidecar.metrics,
                   coordinator=sidecar.coordinator, data=sidecar.data, rows=sidecar.rows,
                   steps_per_epoch=sidecar.steps_per_epoch, report=report,
                   trainers=frozenset(f.session.peer for f in sidecar.server.feeds if f.session.peer is not None))


def write_report(path: Path | None, report: wellknown.Report) -> None:
    """The termination report the operator reads (docs/pod-contract.md)."""
    if path is None:
        return
    try:
        path.write_text(json.dumps(report))
    except OSError as exc:
        log.warning("cannot write the termination log: %s", exc)


def run(settings: SidecarSettings) -> int:
    """The `splitfeed sidecar` process: one world, or several when its world changes in place.

    SIGTERM (pod deletion, eviction, preemption) asks the world to drain at one
    agreed step and keeps serving until this pod's ranks have checkpointed; a
    second SIGTERM, or SIGINT, stops at once. A sidecar that got SIGTERM ends after
    the drain, even where the world goes on in place without it.
    """
    forking.start()  # first: before any lancedb call or thread (sidecar/forks/forking.py)
    settings = _set_up_process(settings)
    _hold_lock(settings.socket_dir)
    done = _drained_before_restart(settings)
    if done is not None:
        write_report(settings.termination_log, done)
        return 0
    carried: Carried | None = None
    signals = Signals()
    signals.install()
    while True:
        try:
            sidecar = prepare(settings, carried)
        except NotInWorld as exc:
            log.info("%s: this pod ends here", exc)
            _leave(settings, carried)
            return 0
        except Exception as exc:  # not bad input (prepare reports that): a bug or a broken host
            log.exception("the sidecar cannot start")
            write_report(settings.termination_log,
                         _worldless_report(f"the sidecar cannot start: {type(exc).__name__}: {exc}"))
            return 2
        if carried is None and not planner.builds_in_child(sidecar.builder):
            forking.stop()  # this sidecar builds no plan in a child: its helper has nothing to do
        signals.serving(sidecar)
        try:
            code, report = serve_world(sidecar)
            following = _next_world(sidecar, report, stopping=signals.termed()) if code == 0 else None
        except BaseException:
            service.flush(sidecar.server.context)
            raise
        if following is None:
            wait_for_members(sidecar, report, signals)
            if sidecar.coordinator is not None:  # what the operator trusts for a member that left no report
                report["completeStep"] = sidecar.coordinator.coordinator.complete_step
            try:
                finish(sidecar, report)
            finally:
                service.flush(sidecar.server.context)  # the last replies go out: the process exits next
            return code
        carried, settings = carry(sidecar, report), following  # the world file says CHANGING (on_drain)


_LOCKS: list[int] = []
"""The descriptor of the socket directory's lock, open as long as this process lives."""


def _hold_lock(socket_dir: Path) -> None:
    """Lock the socket directory's `sidecar.lock` for this process's life: when it dies, its
    trainers see the lock free (trainer_client.stranded.gone) and checkpoint a drain step
    through the world's coordinator instead."""
    try:
        fd = stranded.hold(socket_dir)
    except OSError as exc:  # a broken directory: prepare says so
        log.warning("cannot lock %s: %s", socket_dir, exc)
        return
    if fd is not None:
        _LOCKS.append(fd)


def _set_up_process(settings: SidecarSettings) -> SidecarSettings:
    """Once per process, before its first world: the interpreter and lancedb's pool tuned,
    and the settings of the world this pod is in now (its world file's, not a predecessor's)."""
    service.tune_interpreter()
    # lancedb's permutation builder, sized once before any thread reads the environment
    # (builds in this process are of at most planner.IN_PROCESS_ROWS rows).
    planning.size_pool(planner.IN_PROCESS_ROWS, cgroups.free_memory()[0])
    # A sidecar the kubelet restarted in a pod kept through in-place changes has the environment
    # of the world the pod was created for; the world file (in the pod's emptyDir) says which
    # world the pod is in now. Otherwise a predecessor's word is not ours.
    settings = transitions.adopt_world(settings, membership.read(settings.socket_dir))
    with contextlib.suppress(OSError):  # (a broken directory: prepare says)
        (settings.socket_dir / membership.FILE).unlink(missing_ok=True)
    return settings


class Signals:
    """What SIGTERM and SIGINT ask of the world this process serves now (`run` installs them).

    The first SIGTERM asks the world to drain (once it serves); a second one, or SIGINT,
    stops at once, as does a SIGTERM that finds nothing to drain.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        """When each SIGTERM came (SIGINT counts twice)."""
        self.current: Sidecar | None = None

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self.on_term)
        signal.signal(signal.SIGINT, self.on_int)

    def termed(self) -> bool:
        """Whether this process was asked to end: it then ends after the world it serves."""
        return bool(self.times)

    def serving(self, sidecar: Sidecar) -> None:
        """`sidecar` serves now: a SIGTERM while it prepared asks its world to drain as soon as it serves."""
        self.current = sidecar
        self.act()

    def act(self) -> None:
        """What the SIGTERMs so far ask of the world now served (none yet: once it serves)."""
        sidecar = self.current
        if not self.times or sidecar is None:
            return
        if (len(self.times) > 1 or sidecar.failure is not None or sidecar.server.member is None
                or ending.trainers_gone(sidecar.server)):  # no trainer is left to drain (issue 21)
            sidecar.server.stopping.set()
        else:
            sidecar.server.preempt_requested = True

    def on_term(self, *_: object) -> None:
        self.times.append(time.monotonic())
        self.act()

    def on_int(self, *_: object) -> None:
        self.times.extend([time.monotonic()] * 2)
        if self.current is not None:
            self.current.server.stopping.set()


def _drained_before_restart(settings: SidecarSettings) -> wellknown.Report | None:
    """A member's sidecar the kubelet restarted after every rank of it committed the drain step
    it was committed to (sidecar.commitments): its trainers saved, committed and ended, and the
    world's coordinator may have ended too. Nothing is left to serve or to agree: the report
    says drained at that step, as the sidecar before it would have said. None otherwise."""
    kept = commitments.load(settings.socket_dir, settings.world_epoch)
    if kept is None or replica_of(settings) == 0:  # replica 0's coordinator may still be needed
        return None
    step, reason, _ = kept
    try:
        stores = job_stores(load_job(settings), settings, read_storage_options(settings.storage_options_dir))
    except Exception as exc:  # noqa: BLE001 - then the sidecar starts as usual and finds out
        log.warning("cannot tell whether this pod's ranks drained before the restart: %s", exc)
        return None
    if not stores:
        return None
    committed = commitments.committed_ranks(stores[0], local_ranks(settings), step, settings.world_size,
                                            settings.world_epoch)
    if len(committed) < settings.local_world_size:
        return None
    log.info("every rank of this pod committed drain step %d before this sidecar restarted: it ends "
             "drained there", step)
    return {**_worldless_report(None), "globalStep": step, "drained": True, "agreedStep": step,
            "drainReason": reason}


def _worldless_report(error: str | None) -> wellknown.Report:
    """The report of a sidecar that served no world here: nothing served, nothing drained."""
    return {"globalStep": 0, "lastCheckpoint": None, "drained": False, "agreedStep": None,
            "error": error, "permanent": False}


def _leave(settings: SidecarSettings, carried: Carried | None) -> None:
    """A pod that is not in its world any more ends cleanly: its last world's report (it
    drained there), its plans closed, and the world file tells its trainer to stop."""
    if carried is not None:
        if carried.builder is not None:
            carried.builder.close()
        if carried.coordinator is not None:
            carried.coordinator.close()
    write_world(settings, membership.LEFT)
    report = carried.report if carried is not None else _worldless_report(None)
    write_report(settings.termination_log, report)


def serve_to_exit(sidecar: Sidecar) -> int:
    """`serve`, then wait for ZeroMQ to send the last replies: the process exits next."""
    try:
        return serve(sidecar)
    finally:
        service.flush(sidecar.server.context)
