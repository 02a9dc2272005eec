"""A world of many members around one coordinator, over real ZeroMQ, in a few processes.

The coordinator is the production one (agreement.Coordinator in a CoordinatorThread, a CURVE
server with the job's keypair) in a process of its own, so that its CPU is that process's, its
ZeroMQ I/O thread included. The members are production `wire.Member`s, each with its own
DEALER and TCP connection as each sidecar has, spread over a few worker processes; each worker
runs the sidecar's member side (`following.Coordination`) over its members in one loop, with
the serving loop's heartbeat (`Member.heartbeat`, at most every LOOP_S) and a `progress` a member
as often as metrics.ProgressReporter sends one (metrics.progress_fields), as sidecars do at rest. Each member
has one stand-in publisher, which says the step it published when frozen and notes when the
committed drain step reached it: the world's data path is not what this measures.

Drives tests/bench/coordinator.py and tests/streaming/test_agreement_scale.py.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import resource
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

LOOP_S = 0.1
"""A serving loop polls at most this long (sidecar.serving.Server.run), then beats."""
PUBLISHED = 100
"""Members froze having published steps PUBLISHED .. PUBLISHED + SPREAD - 1: the drain step
must be PUBLISHED + SPREAD + 1 (agreement.cut_step: the highest plus two)."""
SPREAD = 7
TOTAL_STEPS = 1_000_000
MEMBERS_PER_WORKER = 256
"""Sockets a worker process holds: each member is a DEALER and a monitor pair."""
START_S = 120.0
COUNTED_S = 0.2
"""The coordinator counts a broadcast once it handed it to every member: the last member may
hold it a moment sooner, so the drain's last sample waits this long."""
SETTLE_S = 1.0
"""After joining, a member's first heartbeat says `join` again at once (its connection's event,
Member._reconnected): not the world at rest, so samples start after it."""


def drain_step() -> int:
    return PUBLISHED + SPREAD + 1


def raise_fd_limit(needed: int) -> int:
    """Raise this process's soft limit on open files to `needed` (at most the hard limit); the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft != resource.RLIM_INFINITY and soft < needed:
        raise RuntimeError(f"{needed} open files are needed and the hard limit is {hard}: raise it (ulimit -Hn)")
    return soft


@dataclasses.dataclass(frozen=True)
class Sample:
    """The coordinator process at one moment: CPU seconds (every thread), its socket's traffic."""

    at: float
    cpu_s: float
    thread_cpu_s: float
    """The coordinator thread's own (Python) share of cpu_s; the rest is mostly ZeroMQ's I/O
    thread (TCP and CURVE)."""
    messages: dict[str, int]
    """'received join', 'sent freeze', ...: counts since the coordinator started."""
    bytes: dict[str, int]

    def since(self, before: Sample) -> Window:
        return Window(seconds=self.at - before.at, cpu_s=self.cpu_s - before.cpu_s,
                      thread_cpu_s=self.thread_cpu_s - before.thread_cpu_s,
                      messages={k: v - before.messages.get(k, 0) for k, v in self.messages.items()
                                if v != before.messages.get(k, 0)},
                      bytes={k: v - before.bytes.get(k, 0) for k, v in self.bytes.items()})


@dataclasses.dataclass(frozen=True)
class Window:
    """What the coordinator did between two samples."""

    seconds: float
    cpu_s: float
    thread_cpu_s: float
    messages: dict[str, int]
    bytes: dict[str, int]

    @property
    def total_messages(self) -> int:
        return sum(self.messages.values())

    def of(self, *kinds: str) -> int:
        """Messages of these wire types, both directions."""
        return sum(v for k, v in self.messages.items() if k.split()[1] in kinds)


@dataclasses.dataclass(frozen=True)
class Drain:
    """One drain: request to the last member knowing the step, and what the coordinator did."""

    seconds: float
    steps: dict[int, int]
    """Agreed step -> how many members learned it."""
    window: Window


AGREEMENT = ("drain_request", "drain_ack", "freeze", "frozen", "commit_at")
"""The messages a drain itself costs; the rest (join, joined, progress) go on at rest too."""


def _coordinator(conn: Connection, keys_dir: str, replicas: int) -> None:
    """Child: the production coordinator on TCP; answers the parent's samples until 'stop'."""
    from splitfeed.sidecar.world import agreement, wire
    from splitfeed.trainer_client.transport import keys

    raise_fd_limit(replicas + 256)
    coordinator = agreement.Coordinator(replicas=replicas, total_steps=TOTAL_STEPS, resume_step=0)
    thread = wire.CoordinatorThread(coordinator, "tcp://127.0.0.1:*", keys=keys.load(keys_dir))
    conn.send(thread.address)
    clock = time.pthread_getcpuclockid(thread._thread.ident or 0)
    while conn.recv() != "stop":
        usage = resource.getrusage(resource.RUSAGE_SELF)
        messages, nbytes = thread.traffic.snapshot()
        conn.send(Sample(at=time.monotonic(), cpu_s=usage.ru_utime + usage.ru_stime,
                         thread_cpu_s=time.clock_gettime(clock),
                         messages={f"{d} {k}": v for (d, k), v in messages.items()}, bytes=nbytes))
    thread.close()
    conn.send("stopped")


class StandInPublisher:
    """What `Coordination.apply` asks of a publisher: the step it published, then the drain step."""

    def __init__(self, published: int) -> None:
        self.published = published
        self.step: int | None = None
        self.at: float | None = None

    def freeze(self) -> int:
        return self.published

    def commit_at(self, step: int, drain: bool) -> None:
        self.step, self.at = step, time.monotonic()


def _progress(replica: int) -> Any:
    from splitfeed.sidecar.serving import metrics
    from splitfeed.trainer_client.contract import messages

    rank = metrics.RankProgress(rank=replica, global_step=PUBLISHED, counts=[0] * 12, wait_s=0.5, wall_s=60.0,
                                rows=PUBLISHED * 256, batches=PUBLISHED, bytes=PUBLISHED << 20, filled=2, slots=4)
    return messages.Progress(**metrics.progress_fields([rank], replica, 1000), first_batch_at=time.time())


def _members(conn: Connection, address: str, keys_dir: str, replicas: list[int], world: int) -> None:
    """Child: `replicas`' members, joined, then served in one loop until 'stop'."""
    import zmq

    from splitfeed.sidecar.world import wire
    from splitfeed.sidecar.serving import following
    from splitfeed.trainer_client.transport import keys

    raise_fd_limit(8 * len(replicas) + 256)
    keypair = keys.load(keys_dir)
    ctx: zmq.Context[Any] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 4 * len(replicas) + 64)
    members = [wire.Member(address, r, f"bench-{r}", keys=keypair, context=ctx) for r in replicas]
    for member in members:
        member.join(published=-1, timeout_s=START_S)
    sides = [following.Coordination(member=m, world_size=world, steps_per_epoch=1000, skipping=False,
                                    on_drain=None) for m in members]
    publishers = [StandInPublisher(PUBLISHED + r % SPREAD) for r in replicas]
    conn.send("joined")
    _serve(conn, members, sides, publishers, world)
    conn.recv()
    for member in members:
        member.close()
    ctx.term()
    conn.send("stopped")


def _serve(conn: Connection, members: list[Any], sides: list[Any], publishers: list[StandInPublisher],
           world: int) -> None:
    """The serving loops of `members`, as one: what the coordinator says, applied; heartbeats
    and progress at their pace; the steps learned, sent to the parent once every member knows."""
    import zmq

    from splitfeed.sidecar.world import agreement
    from splitfeed.sidecar.serving import metrics

    by_socket = {m.socket: i for i, m in enumerate(members)}
    poller = zmq.Poller()
    for member in members:
        poller.register(member.socket, zmq.POLLIN)
    start = time.monotonic()
    every_s = agreement.at_rest_period_s(metrics.PROGRESS_EVERY_S, world, metrics.PROGRESS_PER_S)
    due = [start + every_s * i / len(members) for i in range(len(members))]  # spread, as pods start
    beat, told = start, False
    while not conn.poll(0):
        for sock in dict(poller.poll(int(LOOP_S * 1000))):
            i = by_socket[sock]
            sides[i].apply([publishers[i]])
        now = time.monotonic()
        if now - beat >= LOOP_S:
            beat = now
            for i, member in enumerate(members):
                member.heartbeat(now)
                if now >= due[i]:
                    due[i] = now + every_s
                    member.send(_progress(member.replica))
        if not told and all(p.at is not None for p in publishers):
            conn.send([(p.step, p.at) for p in publishers])
            told = True


def rest_window_s(members: int) -> float:
    """A member's heartbeat period in a world of `members` (wire.Member.heartbeat): a window
    this long holds one heartbeat of each member and a whole number of progress periods."""
    from splitfeed.sidecar.world import agreement

    return agreement.at_rest_period_s(agreement.JOIN_RESEND_S * 5, members, agreement.HEARTBEATS_PER_S)


class World:
    """`members` members in ceil(members / MEMBERS_PER_WORKER) worker processes (at least
    `workers`) around one coordinator process. A context manager: every process ends with it."""

    def __init__(self, members: int, keys_dir: Path, workers: int = 2) -> None:
        self.size = members
        self.keys_dir = keys_dir
        self.workers = max(min(workers, members), math.ceil(members / MEMBERS_PER_WORKER))
        self._mp = multiprocessing.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self.address = ""

    def _start(self, target: Any, *args: Any) -> Connection:
        mine, theirs = self._mp.Pipe()
        proc = self._mp.Process(target=target, args=(theirs, *args), daemon=True)
        proc.start()
        theirs.close()
        self._procs.append(proc)
        self._conns.append(mine)
        return mine

    def __enter__(self) -> World:
        try:
            self._coordinator = self._start(_coordinator, str(self.keys_dir), self.size)
            self.address = _recv(self._coordinator, START_S)
            replicas = list(range(self.size))
            self._workers = [self._start(_members, self.address, str(self.keys_dir), replicas[w::self.workers],
                                         self.size) for w in range(self.workers)]
            for conn in self._workers:
                if _recv(conn, START_S) != "joined":
                    raise RuntimeError("a worker's members did not join")
            time.sleep(SETTLE_S)
        except BaseException:
            self.__exit__()
            raise
        return self

    def sample(self) -> Sample:
        self._coordinator.send("sample")
        sample: Sample = _recv(self._coordinator, 30)
        return sample

    def rest(self, seconds: float) -> Window:
        """The coordinator at rest for `seconds`: heartbeats and progress only."""
        before = self.sample()
        time.sleep(seconds)
        return self.sample().since(before)

    def drain(self, timeout_s: float = 60.0) -> Drain:
        """The operator's drain request, timed until every member knows the agreed step."""
        from splitfeed.trainer_client.transport import keys, worlds

        keypair = keys.load(self.keys_dir)
        before = self.sample()
        asked = time.monotonic()
        state = worlds.request_drain(self.address, "bench-drain", "rescale", timeout_s=timeout_s, keys=keypair)
        if state is None:
            raise RuntimeError("the coordinator did not acknowledge the drain request")
        learned = [pair for conn in self._workers for pair in _recv(conn, timeout_s)]
        time.sleep(COUNTED_S)
        window = self.sample().since(before)
        steps: dict[int, int] = {}
        for step, _ in learned:
            steps[step] = steps.get(step, 0) + 1
        return Drain(seconds=max(at for _, at in learned) - asked, steps=steps, window=window)

    def __exit__(self, *exc: object) -> None:
        for conn in reversed(self._conns):  # the members first: they close before their coordinator
            try:
                conn.send("stop")
                _recv(conn, 30)
            except (OSError, EOFError, TimeoutError):
                pass
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()


def _recv(conn: Connection, timeout_s: float) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no word from a world process within {timeout_s:g} s")
    return conn.recv()
