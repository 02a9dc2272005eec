"""Applies a schedule's events to a live `splitfeed local` job and times how each settles.

The soak plays the cluster: it asks for replicas through the run's control file, kills and
preempts processes by pid, writes to the table, stops the trainers early and forges control
messages. When an event ends the run (a kill, a preemption, an early stop) it starts
`splitfeed local --resume latest` again with the replicas last asked for, as the operator
replaces a failed world. An event settled once a batch was trained after it (in a new world
of the size asked, where the event changes the world) or the job ended; SETTLE_S bounds it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from splitfeed.trainer_client.script import agent
from splitfeed.trainer_client.contract import wellknown
from tests.soak import probe, schedule as sched
from tests.soak.launcher import Launcher, command
from tests.soak.progress import Progress
from tests.support import manifests, processes, tables

SETTLE_S = 60.0
ORPHAN_GRACE_S = 10.0
FORGER = Path(__file__).parents[1] / "streaming" / "forger.py"
FORGE_S = 2.0
SLEEP_S, CHECKPOINT_EVERY = 0.2, 5
ROWS, STEPS_PER_EPOCH = 4800, 100
"""The soak's table: 24 splits of 200 rows, 2 rows per split per step (data_manifest)."""


class Violation(AssertionError):
    """An invariant the job broke (or a hang): the seed fails."""


@dataclasses.dataclass
class Outcome:
    kind: str
    recovery_s: float
    exits: list[int]
    """Exit codes of the runs that ended during the event."""


def settle_bound(event: sched.Event, mode: str) -> float:
    """SETTLE_S; in place, a trainer killed under its agent adds the agent's designed wait for
    word of a lost pod (trainer_client.agent.LOSS_WAIT_S), which no operator gives locally."""
    if mode == sched.IN_PLACE and event.kind == sched.KILL_TRAINER:
        return SETTLE_S + agent.LOSS_WAIT_S
    return SETTLE_S


def epochs_for(events: int) -> int:
    """Epochs enough for `events` events (an in-place scale-up trains on while its new pods
    start: a dozen steps or more), and a tail after the last, trained at full speed."""
    return max(1, -(-(events * 40 + 40) // STEPS_PER_EPOCH))


class Soak:
    def __init__(self, plan: sched.Schedule, root: Path, epochs: int | None = None,
                 sleep_s: float = SLEEP_S) -> None:
        self.plan, self.root = plan, root
        self.uri, self.logs, self.store = str(root / "db"), root / "logs", root / "ckpt"
        self.shm, self.stop_file, self.sleep_file = root / "shm", root / "stop-at", root / "sleep-s"
        for d in (self.logs, self.shm, root / "tmp"):
            d.mkdir(parents=True)
        tables.write_training_table(self.uri, ROWS)
        self.version = int(tables.lancedb.connect(self.uri).open_table(tables.TABLE).version)
        self.overrides = {"epochs": epochs or epochs_for(len(plan.events)), "version": self.version}
        self.job_file = root / "job.yaml"
        job = manifests.data_manifest(self.uri, str(self.store), epochs=self.overrides["epochs"])
        self.job_file.write_text(yaml.safe_dump(job))
        self.env = {**os.environ, "SPLITFEED_SHM_ROOT": str(self.shm), "TMPDIR": str(root / "tmp")}
        self.env.pop(wellknown.KEYS_DIR_ENV, None)  # as a user's shell: the run makes its own keypair
        self.progress = Progress(self.logs)
        self.sleep_s = sleep_s
        self.replicas = plan.start
        self.launcher: Launcher | None = None
        self.outcomes: list[Outcome] = []
        self.ports: set[int] = set()
        self.forged: list[dict[str, object]] = []
        self._exits: list[int] = []
        self._sampled = 0.0
        self._orphans: dict[int, float] = {}

    # -- the job --------------------------------------------------------------------------------
    def launch(self, resume: str) -> None:
        self.stop_file.unlink(missing_ok=True)  # an early stop is one run's
        # What the run before left running is this subreaper's now; it gets ORPHAN_GRACE_S to end.
        self._orphans = {pid: time.monotonic() + ORPHAN_GRACE_S for pid in processes.children()}
        argv = command(self.job_file, self.replicas, self.plan.mode, resume, self.logs, self.stop_file,
                       self.sleep_file, self.sleep_s, CHECKPOINT_EVERY)
        self.launcher = Launcher(argv, self.env)

    def running(self) -> Launcher:
        assert self.launcher is not None
        return self.launcher

    def look(self, kind: str) -> None:
        """Read the logs; when the run ended, judge its exit against the event `kind` and start
        the next run unless the job ended. Every second, note the ports the job listens on."""
        self.progress.read()
        now = time.monotonic()
        self._check_orphans(now)
        if now - self._sampled > 1.0:
            self._sampled = now
            self.ports |= probe.ports_of(probe.descendants(self.running().proc.pid))
        code = self.running().poll()
        if code is None or self.running().judged:
            return
        self.running().judged = True
        self._exits.append(code)
        self.progress.read()
        text = self.running().text()
        if code == 0 and self.progress.ended():
            return
        expected = 1 if kind in sched.KILLS else 0 if kind in (sched.SIGTERM, sched.EARLY_STOP) else None
        if code != expected:
            raise Violation(f"during {kind}: `splitfeed local` exited {code} before the job's end "
                            f"(expected {expected}):\n{text[-3000:]}")
        # Killed by SIGKILL: -9, or 247 from an agent, which exits with its script's status.
        if kind in sched.KILLS and not any(f"exited with code {c}:" in text for c in (-9, 247)):
            raise Violation(f"{kind}: the run failed, but not for the process killed:\n{text[-3000:]}")
        self.launch("latest")

    def _check_orphans(self, now: float) -> None:
        """A Violation for a process of an ended run that outlived ORPHAN_GRACE_S after it."""
        alive = processes.children()
        left = [pid for pid, by in self._orphans.items() if pid in alive and now > by]
        if left:
            raise Violation("left running by a run that ended: " + "; ".join(
                f"{pid} ({processes.command_line(pid)[:120]})" for pid in left))
        self._orphans = {pid: by for pid, by in self._orphans.items() if pid in alive}

    def wait(self, kind: str, done: object, timeout_s: float, what: str) -> float:
        """Poll until `done()` gives a time; that time. A Violation (a hang) after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.look(kind)
            found = done()  # type: ignore[operator]
            if found is not None:
                return float(found)
            if time.monotonic() > deadline:
                raise Violation(f"hang: {what} not within {timeout_s:.0f} s (newest world "
                                f"{self.progress.newest()}, step {self.progress.step()}):\n{self.running().text()[-3000:]}")
            time.sleep(0.1)

    # -- events ---------------------------------------------------------------------------------
    def run(self) -> None:
        self.launch("none")
        began = time.time()
        settled = self.wait("start", lambda: self.progress.settled(began, None, None), 180, "the first batch")
        self.outcomes.append(Outcome("start", settled - began, []))
        for event in self.plan.events:
            if self.progress.ended():
                raise Violation(f"the job ended before event {event}: make it longer (epochs)")
            self.apply_and_settle(event)
        self.sleep_file.write_text("0")  # the tail at full speed
        left = self.overrides["epochs"] * STEPS_PER_EPOCH - self.progress.step()
        self.wait("end", lambda: time.time() if self.progress.ended() and self.running().poll() == 0 else None,
                  SETTLE_S + left * 0.5, "the job's end")

    def apply_and_settle(self, event: sched.Event) -> None:
        world, self._exits = self.progress.newest(), []
        t0 = self.apply(event)
        if event.kind in (sched.SCALE, sched.OVERLAP):
            after, size = world, event.replicas
        elif event.kind in sched.ENDS_RUN:
            after, size = world, None
        else:
            after, size = None, None
        settled = self.wait(event.kind, lambda: self.progress.settled(t0, after, size), settle_bound(event, self.plan.mode),
                            f"{event} to settle")
        self.outcomes.append(Outcome(event.kind, max(0.0, settled - t0), self._exits))
        self.wait(event.kind, lambda: time.time() if self.progress.steps_since(settled) > event.gap_steps
                  or self.progress.ended() else None, SETTLE_S, f"{event.gap_steps} steps after {event}")

    def apply(self, event: sched.Event) -> float:
        """Do `event` to the running job; the time.time() from which its settling counts."""
        kind, t0 = event.kind, time.time()
        if kind == sched.SCALE:
            self.running().ask_replicas(event.replicas)
        elif kind == sched.OVERLAP:
            self.running().ask_replicas(event.first)
            end = time.monotonic() + event.delay_s
            while time.monotonic() < end:
                self.look(kind)
                time.sleep(0.05)
            self.running().ask_replicas(event.replicas)
        elif kind in (sched.KILL_TRAINER, sched.KILL_AGENT, sched.SIGTERM):
            self.signal_rank(event)
        elif kind in (sched.KILL_SIDECAR, sched.KILL_COORDINATOR):
            self.kill_sidecar(event.target if kind == sched.KILL_SIDECAR else 0)
        elif kind == sched.TABLE_WRITE:
            write_more_rows(self.uri)
        elif kind == sched.EARLY_STOP:
            tmp = self.stop_file.with_suffix(".tmp")
            tmp.write_text(str(self.progress.step() + 4))
            os.replace(tmp, self.stop_file)
        elif kind == sched.FORGE:
            t0 = self.forge()
        self.replicas = event.replicas
        return t0

    def signal_rank(self, event: sched.Event) -> None:
        """SIGKILL a trainer (in place: the script under its agent) or its agent; SIGTERM the
        trainer container's process (the trainer, or in place its agent), as the kubelet does."""
        pid = self.progress.worlds[self.progress.newest()].pids[event.target]
        container = event.kind == sched.KILL_AGENT or (event.kind == sched.SIGTERM and self.plan.mode == sched.IN_PLACE)
        if container:
            agent = probe.parent(pid)
            if agent is None or " run --" not in processes.command_line(agent):
                raise AssertionError(f"rank {event.target}'s trainer {pid} has no agent: {agent}")
            pid = agent
        os.kill(pid, signal.SIGTERM if event.kind == sched.SIGTERM else signal.SIGKILL)

    def kill_sidecar(self, replica: int) -> None:
        control = self.running().control
        assert control is not None
        pid = probe.sidecar_pid(control.parent, replica)
        if pid is None:
            raise AssertionError(f"no live sidecar of replica {replica} under {control.parent}")
        os.kill(pid, signal.SIGKILL)

    def forge(self) -> float:
        """tests/streaming/forger.py against the job for FORGE_S; its report is kept."""
        report = self.root / f"forger-{len(self.forged)}.json"
        proc = subprocess.Popen([sys.executable, str(FORGER), str(self.shm / "splitfeed-job-*"), str(report)],
                                env=self.env, preexec_fn=processes.die_with_parent())
        try:
            end = time.monotonic() + FORGE_S
            while time.monotonic() < end:
                self.look(sched.FORGE)
                time.sleep(0.1)
        finally:
            processes.stop(proc)
        self.forged.append(json.loads(report.read_text()) if report.exists() else {"sent": 0, "answered": 0})
        return time.time()

    def stop(self) -> None:
        if self.launcher is not None:
            self.launcher.stop()


def write_more_rows(uri: str, rows: int = 100) -> None:
    """Append rows the job must never see: it reads the version it pinned at its start."""
    db = tables.lancedb.connect(uri)
    table = db.open_table(tables.TABLE)
    more = tables.frames(rows, tables.TRAINING_DIM, seed=7)
    ids = more.column("id").to_numpy() + 100_000 + len(table)
    table.add(more.set_column(0, "id", tables.pa.array(ids)))
