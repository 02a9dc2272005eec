"""The world's agreement on one drain step (docs/agreement.md), as a pure state machine.

`Coordinator` runs in replica 0's sidecar and decides; every sidecar (replica 0's
too) is a member that joins it, freezes its publishers when asked and applies
the committed step. The machine below keeps no sockets and no clock: each
`on_*` call returns the messages to send, so every interleaving the tests care
about (a request before every member joined, a member restarted mid-round, a
late answer to an old round) is a plain function call. `CoordinatorThread` is
the thin edge that runs it on a ZeroMQ ROUTER socket.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.utils.monitor

from splitfeed.trainer_client.contract import errors, messages, progress
from splitfeed.trainer_client.transport import keys as keymod
from splitfeed.trainer_client.transport.keys import Keypair
from splitfeed.trainer_client.contract.messages import (
    Agreed,
    Reach,
    CommitAt,
    Complete,
    CommittedWorld,
    DrainAck,
    DrainRequest,
    Error,
    Freeze,
    Frozen,
    Join,
    Joined,
    Progress,
    StandIn,
    StatusRequest,
    WorldLost,
)

from . import standins

log = logging.getLogger(__name__)

EVERY = b""
"""Send to every joined member (`Coordinator.recipients`: its own member last)."""

OWN = 0
"""The replica whose sidecar runs the coordinator (docs/agreement.md), and dies with it."""

IDLE, WAITING_FOR_MEMBERS, FREEZING, COMMITTED = "idle", "waiting-for-members", "freezing", "committed"
LOST = "lost"
"""Members' pods failed (a `drain_request` with `lost`): the world ended without a drain."""


@dataclasses.dataclass(frozen=True)
class Out:
    """One message to send: to `peer` (EVERY: each member)."""

    peer: bytes
    message: messages.Message


def cut_step(published: list[int], total_steps: int, not_before: int = 0) -> int:
    """The drain step S: every rank takes batches up to S - 1, then checkpoints.

    Batch S - 1 must be published nowhere yet, so the checkpoint request is
    visible to every rank before that batch is (docs/agreement.md, "Commit").
    A request's `not_before` moves S later, never earlier.
    """
    return min(max(max(published) + 2, not_before), total_steps)


IN, OUT = "in", "out"


class Watermark:
    """Which global steps exist, under onTransformError=skip/warn (docs/preprocessing.md).

    A rank's epoch ends where one of its splits runs dry; the world's epoch ends at
    the smallest such end. Each rank reports the highest step it holds ready
    (`reach`) and the ends it found; a step is IN once every rank holds it and no
    end excludes it, OUT once some rank's end excludes it (both final), else not
    yet known. Ranks read ahead, so reports normally run steps ahead of the
    trainers. Pure: the coordinator keeps one for the world, a member-less
    sidecar one for its own ranks, and publishers read `verdict` from its
    published values (`through`, `ends`).
    """

    def __init__(self, *, ranks: int, steps_per_epoch: int) -> None:
        self.ranks = ranks
        self.steps_per_epoch = steps_per_epoch
        self.reach: dict[int, int] = {}
        self.ends: dict[int, int] = {}

    def report(self, rank: int, assembled: int, ends: dict[int, int]) -> bool:
        """One rank's report; True when `through` or `ends` changed."""
        if not 0 <= rank < self.ranks:
            raise errors.ProtocolError(f"rank {rank} is not in this world (0..{self.ranks - 1})")
        before = (self.through, dict(self.ends))
        self.reach[rank] = max(self.reach.get(rank, -1), assembled)
        merge_ends(self.ends, ends)
        return (self.through, self.ends) != before

    @property
    def through(self) -> int:
        return min(self.reach.values()) if len(self.reach) == self.ranks else -1

    def verdict(self, step: int) -> str | None:
        return verdict(step, self.through, self.ends, self.steps_per_epoch)


def verdict(step: int, through: int, ends: dict[int, int], steps_per_epoch: int) -> str | None:
    """IN, OUT or None (not known yet) for `step` (see Watermark)."""
    epoch, within = divmod(step, steps_per_epoch)
    if within >= ends.get(epoch, steps_per_epoch):
        return OUT
    return IN if step <= through else None


def flat_reports(reports: dict[int, tuple[int, dict[int, int]]]) -> list[int]:
    """Reach.reports from {rank: (assembled, ends)}."""
    out: list[int] = []
    for rank, (assembled, ends) in sorted(reports.items()):
        out += [rank, assembled, len(ends)]
        for epoch, end in sorted(ends.items()):
            out += [epoch, end]
    return out


def parse_reports(flat: list[int]) -> dict[int, tuple[int, dict[int, int]]]:
    """The inverse of flat_reports; ProtocolError for a malformed list."""
    out: dict[int, tuple[int, dict[int, int]]] = {}
    i = 0
    try:
        while i < len(flat):
            rank, assembled, count = (int(v) for v in flat[i:i + 3])
            pairs = flat[i + 3:i + 3 + 2 * count]
            if len(pairs) != 2 * count or count < 0:
                raise ValueError("short")
            out[rank] = (assembled, {int(pairs[j]): int(pairs[j + 1]) for j in range(0, len(pairs), 2)})
            i += 3 + 2 * count
    except (TypeError, ValueError) as exc:
        raise errors.ProtocolError(f"malformed reach reports: {exc}") from None
    return out


def merge_ends(into: dict[int, int], ends: dict[int, int]) -> None:
    """Fold `ends` into `into`, the smallest end of each epoch (as Watermark.report does)."""
    for epoch, end in ends.items():
        into[epoch] = min(into.get(epoch, end), end)


def parse_ends(flat: list[int]) -> dict[int, int]:
    if len(flat) % 2 or not all(isinstance(v, int) for v in flat):
        raise errors.ProtocolError("malformed agreed ends")
    return {flat[j]: flat[j + 1] for j in range(0, len(flat), 2)}


def flat_ends(ends: dict[int, int]) -> list[int]:
    return [v for epoch, end in sorted(ends.items()) for v in (epoch, end)]


def settle_cut(step: int, watermark: Watermark, total_steps: int) -> tuple[int, bool]:
    """A drain step S for a skip job, and whether it is final: batch S - 1 must exist (be
    IN), since a trainer never stops on a step that is absent; S - 1 OUT moves S past the
    gap to one step after the next epoch's first. Not final while S - 1 is not known yet."""
    spe = watermark.steps_per_epoch
    while step < total_steps:
        seen = watermark.verdict(step - 1)
        if seen == IN:
            return step, True
        if seen is None:
            return step, False
        step = ((step - 1) // spe + 1) * spe + 1
    return total_steps, True


def world_lost(lost: list[int], replicas: int, size: int) -> WorldLost:
    """What ends a world of `size` replicas whose member replicas `lost` failed (the operator saw
    their pods fail; docs/agreement.md, "A member lost in place"). No step can be agreed any more,
    and the other trainers are failing in, or stuck on, their collectives: the world ends without
    a drain, and the members not lost go on in place to a world of `replicas` replicas (`size`
    for 0) from the newest complete checkpoint. Replica 0 cannot be lost: its sidecar is this
    coordinator. ProtocolError for anything else."""
    if not lost or any(not isinstance(r, int) or isinstance(r, bool) or not OWN < r < size for r in lost):
        raise errors.ProtocolError(f"lost replicas {lost!r} are not members of this world other than "
                                   f"replica {OWN} (1..{size - 1})")
    found = WorldLost(replicas=replicas or size, lost=sorted(set(lost)))
    log.warning("replicas %s are lost: the world ends now without a drain; the others go on in place with %d "
                "replicas from the newest complete checkpoint", found.lost, found.replicas)
    return found


def recipients(members: dict[int, bytes], peer: bytes) -> list[bytes]:
    """Whom an Out goes to, in order: EVERY is each joined member, the coordinator's own
    (replica 0's, in the same process) last.

    What replica 0's member is told, its ranks act on: a step `agreed` to exist is published
    and taken, and that trainer then waits in the step's all-reduce for its peers. A SIGKILL
    of replica 0's sidecar ends the coordinator with it, and the restarted one learns that
    rank's reach only from its new reader, which starts at that trainer's next hello, after
    the all-reduce: a step only replica 0's member was told exists (or is absent) deadlocks
    the world. Handed to the other members first, it left before replica 0's member could
    hear of it: ZeroMQ's I/O thread writes each frame in the order it was handed over, and
    the coordinator thread may lose the GIL to replica 0's publishers between two sends.
    """
    if peer != EVERY:
        return [peer]
    own = members.get(OWN)
    return [p for r, p in members.items() if r != OWN] + ([] if own is None else [own])


class Coordinator:
    """Decides the world's drain step; knows the members and the last complete step."""

    def __init__(self, *, replicas: int, total_steps: int, resume_step: int,
                 table_version: int | None = None, watermark: Watermark | None = None,
                 world_epoch: int = -1, stood_in: Sequence[int] = ()) -> None:
        self.world_epoch = world_epoch
        """The world it coordinates (SPLITFEED_WORLD_EPOCH), told in `status` answers."""
        self.stood_in = list(stood_in)
        """Replicas of the world before whose dead sidecar its coordinator committed the drain
        step this world resumes at (sidecar.standins), told in `status` answers."""
        self.watermark = watermark
        """Skip jobs only: which steps exist (see Watermark)."""
        self.candidate: int | None = None
        """A drain step waiting for the watermark to know whether its previous step exists."""
        self.replicas = replicas
        self.total_steps = total_steps
        self.resume_step = resume_step
        self.table_version = table_version
        self.members: dict[int, bytes] = {}
        self.phase = IDLE
        self.round = 0
        self.reason: str | None = None
        self.tokens: set[str] = set()
        self.not_before = 0
        """The drain request's earliest step (ordinary jobs only: see on_request)."""
        self.answers: dict[int, int] = {}
        self.step: int | None = None
        """The committed drain step, once fixed."""
        self.commits: dict[int, set[int]] = {}
        self.complete_step: int | None = None
        self.progress: dict[int, Progress] = {}
        """Each member's last `progress` (live status; docs/observability.md)."""
        self.next_replicas = 0
        """Replicas of the world that follows this one in place (0: it is replaced, or none)."""
        self.lost: WorldLost | None = None  # members' pods failed: the world ended (on_lost)

    def recipients(self, peer: bytes) -> list[bytes]:
        """Whom an Out goes to, in order (module `recipients`: its own member last)."""
        return recipients(self.members, peer)

    def on_join(self, peer: bytes, replica: int, drain_step: int = -1, drain_reason: str = "",
                next_replicas: int = 0) -> list[Out]:
        """A member (re)joins; a heartbeat on the connection it joined on is told only the round
        to act on, as it holds the rest (docs/agreement.md, "At scale"). One that acts on a drain
        step this coordinator does not know (it restarted between `commit_at` and the drain's
        end) makes it the world's step again: no member has published that step's batch (the
        cut guarantees it), and members that already hold it must not be cut anywhere else."""
        if replica < 0:
            raise errors.ProtocolError(f"replica {replica} is not in this world (0..{self.replicas - 1})")
        joined = Joined(resume_step=self.resume_step, table_version=self.table_version, replicas=self.replicas)
        if self.lost is not None:  # the world is over: a member that (re)joins learns it at once
            return [Out(peer, joined), Out(peer, self.lost)]
        if replica >= self.replicas:
            # A pod of the world before an in-place scale-down: told the size, it ends; not a member.
            return [Out(peer, joined)]
        steady = self.members.get(replica) == peer  # its heartbeat (above)
        self.members[replica] = peer
        out = [] if steady else [Out(peer, joined)]
        if drain_step >= 0 and self.step is None:
            log.warning("replica %d acts on drain step %d, which this coordinator (restarted) did not "
                        "know: the world drains there", replica, drain_step)
            self.reason, self.next_replicas = drain_reason or "drain", max(self.next_replicas, next_replicas)
            self.round += 1
            self.candidate = None
            return out + self._commit(drain_step)
        if drain_step >= 0 and drain_step != self.step:
            log.warning("replica %d acts on drain step %d, the world on %s", replica, drain_step, self.step)
        if self.phase == WAITING_FOR_MEMBERS and len(self.members) == self.replicas:
            return out + self._freeze()
        if self.phase == FREEZING and replica not in self.answers:
            out.append(Out(peer, Freeze(round=self.round)))
        elif self.phase == COMMITTED:
            assert self.step is not None
            out.append(Out(peer, self._commit_at()))
        if steady:
            return out
        if self.complete_step is not None:
            out.append(Out(peer, Complete(step=self.complete_step)))
        if self.watermark is not None:
            out.append(Out(peer, self._agreed(need=-1 if self.candidate is None else self.candidate - 1)))
        return out

    def on_request(self, peer: bytes, token: str, reason: str, not_before: int = 0,
                   replicas: int = 0) -> list[Out]:
        """A drain request from the operator, a member or a member's trainer.

        `not_before` is kept for ordinary jobs only: a skip job's drain step must be
        known to exist, which the look-ahead learns only as far as it has read, and
        reading far ahead while frozen would stall the world and hold its batches.
        `replicas` > 0 asks for an in-place rescale; the newest count wins, repeated
        tokens included (a second `kubectl scale` during the drain), until the next
        world's coordinator starts with it (`next_replicas`).
        """
        fresh = token not in self.tokens
        self.tokens.add(token)
        if replicas > 0 and replicas != self.next_replicas:
            self.next_replicas = replicas
            log.info("the next world changes in place to %d replicas", replicas)
        out: list[Out] = []
        if fresh and self.phase == IDLE:
            self.reason = reason
            self.not_before = not_before if self.watermark is None else 0
            log.info("drain requested (%s, token %s%s)", reason, token,
                     f", at global step {self.not_before} at the earliest" if self.not_before else "")
            if len(self.members) == self.replicas:
                out = self._freeze()
            else:
                self.phase = WAITING_FOR_MEMBERS
                log.info("waiting for %d of %d members before freezing",
                         self.replicas - len(self.members), self.replicas)
        return out + [Out(peer, DrainAck(token=token, state=self.phase))]

    def on_lost(self, peer: bytes, token: str, lost: list[int], replicas: int) -> list[Out]:
        """Member pods failed: the world ends now (`world_lost`), every member told once."""
        fresh, self.lost = self.lost is None, self.lost or world_lost(lost, replicas, self.replicas)
        self.phase, self.next_replicas, self.candidate = LOST, self.lost.replicas, None
        return [Out(EVERY, self.lost)] * fresh + [Out(peer, DrainAck(token=token, state=LOST))]

    def on_frozen(self, replica: int, round_: int, published: int) -> list[Out]:
        if self.phase != FREEZING or round_ != self.round:
            return []  # an answer to a round that is over
        self.answers[replica] = published
        if len(self.answers) < self.replicas:
            return []
        step = cut_step(list(self.answers.values()), self.total_steps, self.not_before)
        if self.watermark is not None:
            self.candidate = step
            return self._settle()
        return self._commit(step)

    def _settle(self) -> list[Out]:
        """A skip job's drain step, once the watermark knows where it may be."""
        assert self.watermark is not None and self.candidate is not None
        step, final = settle_cut(self.candidate, self.watermark, self.total_steps)
        if not final:
            self.candidate = step
            return [Out(EVERY, self._agreed(need=step - 1))]
        self.candidate = None
        return [Out(EVERY, self._agreed())] + self._commit(step)

    def _agreed(self, need: int = -1) -> Agreed:
        assert self.watermark is not None
        return Agreed(through=self.watermark.through, ends=flat_ends(self.watermark.ends), need=need)

    def on_reach(self, reports: list[int]) -> list[Out]:
        """Ranks' look-ahead (skip jobs): tell every member when what exists changed."""
        if self.watermark is None:
            raise errors.ProtocolError("this job does not skip rows: no reach reports")
        changed = False
        for rank, (assembled, ends) in parse_reports(reports).items():
            changed |= self.watermark.report(rank, assembled, ends)
        if self.candidate is not None:
            return self._settle()
        return [Out(EVERY, self._agreed())] if changed else []

    def _commit(self, step: int) -> list[Out]:
        self.step = step
        self.phase = COMMITTED
        log.info("the world drains at global step %d (highest published: %s)", self.step,
                 dict(sorted(self.answers.items())))
        return [Out(EVERY, self._commit_at())]

    def _commit_at(self) -> CommitAt:
        assert self.step is not None
        return CommitAt(round=self.round, step=self.step, drain=True, reason=self.reason or "drain",
                        next_replicas=self.next_replicas)

    def on_committed(self, replica: int, step: int) -> list[Out]:
        """Every local rank of `replica` committed `step`; a step every member committed is complete."""
        replicas = self.commits.setdefault(step, set())
        replicas.add(replica)
        if len(replicas) < self.replicas or (self.complete_step or -1) >= step:
            return []
        self.complete_step = step
        for old in [s for s in self.commits if s <= step]:
            del self.commits[old]
        return [Out(EVERY, Complete(step=step))]

    def on_progress(self, message: Progress) -> list[Out]:
        """A member's counts; kept for `status_request`, answered with nothing."""
        replica = message.replica
        if not 0 <= replica < self.replicas:
            raise errors.ProtocolError(f"replica {replica} is not in this world (0..{self.replicas - 1})")
        self.progress[replica] = progress.checked(message)
        return []

    def on_status_request(self, peer: bytes) -> list[Out]:
        return [Out(peer, progress.world_status(
            list(self.progress.values()), replicas=self.replicas, total_steps=self.total_steps,
            resume_step=self.resume_step, drain_step=self.step, world_epoch=self.world_epoch,
            stood_in=self.stood_in))]

    def _freeze(self) -> list[Out]:
        self.phase = FREEZING
        self.round += 1
        self.answers = {}
        return [Out(EVERY, Freeze(round=self.round))]


ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq asks a context's authenticator (RFC 27) about each CURVE handshake."""
REJECTED_LOG_EVERY_S = 60.0
"""A rejected peer is logged at most this often (a peer that retries would flood the log)."""


@dataclasses.dataclass
class Rejections:
    """Rejected peers since the last log line: at most one line every REJECTED_LOG_EVERY_S."""

    logged_at: float | None = None
    since: int = 0

    def note(self, peer: str, why: str, now: float) -> str | None:
        """Count one rejection; the line to log now, or None within the quiet minute."""
        self.since += 1
        if self.logged_at is not None and now - self.logged_at < REJECTED_LOG_EVERY_S:
            return None
        line = (f"rejected a peer at {peer}: {why}; its messages are dropped"
                + (f" ({self.since} rejections since the last such line)" if self.since > 1 else ""))
        self.logged_at, self.since = now, 0
        return line


RECEIVED, SENT = "received", "sent"
INVALID = "invalid"
"""The type counted for a frame that is not a message (Traffic)."""


@dataclasses.dataclass
class Traffic:
    """Messages and payload bytes through the coordinator's socket, by direction and type: what
    the control plane costs a world as it grows (splitfeed_coordinator_messages_total,
    splitfeed_coordinator_message_bytes_total). Written by the coordinator thread only; read
    with `snapshot`, whose dict copies the GIL makes whole."""

    messages: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    bytes: dict[str, int] = dataclasses.field(default_factory=lambda: {RECEIVED: 0, SENT: 0})

    def note(self, direction: str, kind: str, size: int, count: int = 1) -> None:
        key = (direction, kind)
        self.messages[key] = self.messages.get(key, 0) + count
        self.bytes[direction] += size * count

    def snapshot(self) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
        return self.messages.copy(), self.bytes.copy()


UNKNOWN_PEER = "an address ZeroMQ closed before it could be read"


def peer_of(fd: int) -> str:
    """The remote address of the connection on `fd` (a monitor's ACCEPTED event), for the log
    line only. A peer without CURVE is usually gone already by then (the mechanism mismatch
    ends its connection at once): UNKNOWN_PEER. A CURVE peer with a wrong key is named by ZAP."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            name = conn.getpeername()
    except (OSError, ValueError):
        return UNKNOWN_PEER
    return f"{name[0]}:{name[1]}" if isinstance(name, tuple) else str(name or "a local socket")


class CoordinatorThread:
    """Replica 0's coordinator on a ROUTER socket, in a thread of its own.

    A thread rather than the serving loop: members wait for `joined` while
    replica 0's own sidecar is still preparing, and the coordinator must
    answer them (its own member included) before any loop runs.

    A CURVE server with the job's keypair (trainer_client.keys), its ZAP handler in this same
    thread: a peer without the job's secret never gets a message through, is counted in
    `rejected` and logged at most once a minute, and the world goes on untouched.
    """

    def __init__(self, coordinator: Coordinator, bind: str, *, keys: Keypair,
                 stand_in: Callable[[StandIn], str] | None = None, world_size: int = 0) -> None:
        self.coordinator = coordinator
        self.stand_ins = standins.StandIns(world_size=world_size or coordinator.replicas,
                                           replicas=coordinator.replicas)
        """Ranks whose dead sidecar this coordinator stands in for (sidecar.standins)."""
        self._write = stand_in
        """Writes a rank's record (or marker) through the job's store; its uri. None: no store."""
        self._keys = keys
        self.rejected = 0
        """Peers whose handshake failed (no CURVE, another key): splitfeed_coordinator_rejected_total."""
        self._rejections = Rejections()
        self.traffic = Traffic()
        self._ctx: zmq.Context[Any] = zmq.Context()
        """Its own context: the ZAP handler is one per context, and a sidecar whose world changes in
        place runs the next world's coordinator beside the old one for a moment."""
        self._zap = self._ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)  # before any CURVE socket of this context binds
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        keymod.serve(self._sock, keys)
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        try:
            self._sock.bind(bind)
        except zmq.ZMQError:
            self._close_sockets()  # the address is taken: leave no socket behind
            raise
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._accepted: dict[int, str] = {}
        """A connection's file descriptor -> its peer's address, until it is gone."""
        self._failing = 0
        """Handshakes failed whose connection's end (which names the peer) is still to come."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coordinator", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._sock.disable_monitor()
        for sock in (self._monitor, self._sock, self._zap):
            sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in (self._sock, self._zap, self._monitor):
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            if self._zap in ready:
                self._authenticate()
            if self._monitor in ready:
                self._watch()
            if not ready.keys() - {self._zap, self._monitor}:
                continue  # nothing on the ROUTER (a test may wrap `_sock`: not compared itself)
            try:
                peer, frame = self._sock.recv_multipart(zmq.NOBLOCK)
            except (zmq.Again, ValueError):
                continue  # a frame count we never send
            kind = INVALID
            try:
                message = messages.decode(frame)
                kind = message.kind
                self.traffic.note(RECEIVED, kind, len(frame))
                self._send(self._handle(peer, message))
            except errors.ProtocolError as exc:
                if kind == INVALID:
                    self.traffic.note(RECEIVED, kind, len(frame))
                log.warning("coordinator: bad message from %r: %s", peer, exc)
                self._send([Out(peer, Error(code="protocol", message=str(exc), fatal=False))])

    def _authenticate(self) -> None:
        """Answer a ZAP request: only the job's own key is admitted (trainer_client.keys)."""
        try:
            request = self._zap.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        reply, admitted, peer = keymod.zap_answer(request, self._keys)
        self._zap.send_multipart(reply)
        if not admitted:
            self._reject(peer, "its CURVE key is not the job's")

    def _watch(self) -> None:
        """Handshakes that failed before ZAP (no CURVE at all, or the wrong server key)."""
        while True:
            try:
                event = zmq.utils.monitor.recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind, value = event["event"], int(event["value"])
            if kind == zmq.EVENT_ACCEPTED:
                self._accepted[value] = peer_of(value)
            elif kind == zmq.EVENT_DISCONNECTED:
                peer = self._accepted.pop(value, UNKNOWN_PEER)
                if self._failing:  # a failed handshake is followed by its connection's end
                    self._failing -= 1
                    self._reject(peer, "it did not complete a CURVE handshake with the job's key")
            else:
                self._failing += 1

    def _reject(self, peer: str, why: str) -> None:
        self.rejected += 1
        line = self._rejections.note(peer, why, time.monotonic())
        if line:
            log.warning("coordinator: %s", line)

    def _handle(self, peer: bytes, message: messages.Message) -> list[Out]:
        c = self.coordinator
        match message:
            case Join():
                return c.on_join(peer, message.replica, message.drain_step, message.drain_reason,
                                 message.next_replicas)
            case DrainRequest() if message.lost is not None:
                return c.on_lost(peer, message.token, message.lost, message.replicas)
            case DrainRequest():
                return c.on_request(peer, message.token, message.reason, message.not_before, message.replicas)
            case Frozen():
                return c.on_frozen(message.replica, message.round, message.published)
            case Reach():
                return c.on_reach(message.reports)
            case CommittedWorld():
                return c.on_committed(message.replica, message.step)
            case Progress():
                return c.on_progress(message)
            case StatusRequest():
                return c.on_status_request(peer)
            case StandIn():
                return self._stand_in(peer, message)
            case _:
                raise errors.ProtocolError(f"the coordinator does not take {message.kind!r}")

    def _stand_in(self, peer: bytes, request: StandIn) -> list[Out]:
        """A trainer whose sidecar died asks for its checkpoint at the drain step: written here and
        answered, or refused with a one-line reason (sidecar.standins)."""
        c = self.coordinator
        why = self.stand_ins.refusal(request, world_epoch=c.world_epoch, skipping=c.watermark is not None,
                                     drain_step=c.step if c.phase == COMMITTED else None,
                                     members=c.members, lost=c.lost is not None)
        if why is None and self._write is None:
            why = "checkpoints are disabled: set spec.checkpoint.uri"
        uri = ""
        if why is None and self._write is not None:
            try:
                uri = self._write(request)
            except Exception as exc:  # the store's error, said to the trainer, which fails as before
                why = f"writing rank {request.rank}'s {'marker' if request.commit else 'record'} failed: {exc}"
        if why is not None:
            log.warning("coordinator: no stand-in for rank %d at step %d: %s", request.rank, request.step, why)
            return [Out(peer, Error(code="stand_in", message=why, fatal=False))]
        log.warning("coordinator: wrote rank %d's %s at drain step %d in the stead of its dead sidecar",
                    request.rank, "commit marker" if request.commit else "record", request.step)
        replica = self.stand_ins.wrote(request)
        if not request.commit:
            return [Out(peer, messages.Checkpointed(step=request.step, drained=True, uri=uri))]
        counted = [] if replica is None else c.on_committed(replica, request.step)
        return [Out(peer, messages.Committed(step=request.step))] + counted

    def _send(self, outs: list[Out]) -> None:
        for out in outs:
            frame = out.message.encode()
            sent = 0
            for target in self.coordinator.recipients(out.peer):
                try:
                    self._sock.send_multipart([target, frame], zmq.NOBLOCK)
                    sent += 1
                except zmq.ZMQError as exc:  # gone, or not reading: it rejoins if it comes back
                    log.debug("coordinator cannot reach %r: %s", target, exc)
            self.traffic.note(SENT, out.message.kind, len(frame), sent)


JOIN_RESEND_S = 2.0
"""A member says `join` again this often while it waits, and every five times as long as a
heartbeat while it serves (less often in a world of over 160 members: HEARTBEATS_PER_S; at
once when its connection to the coordinator is made again): a coordinator that restarted
learns its members back, and answers are idempotent."""
HEARTBEATS_PER_S = 16.0
"""At most this many heartbeat `join`s a second reach the coordinator from all its members
together: in a large world each member beats less often (`at_rest_period_s`), so that the
coordinator's load at rest stops growing with the world (docs/agreement.md, "At scale"). A
heartbeat is the fallback: a member rejoins at once when its connection is made again."""


def at_rest_period_s(base_s: float, replicas: int, per_s: float) -> float:
    """How often each member of a world of `replicas` says what it says every `base_s` in a
    small world: never so often that the whole world says it over `per_s` times a second."""
    return max(base_s, replicas / per_s)


class Member:
    """One sidecar's side of the agreement: a DEALER to the coordinator.

    `join` blocks (the sidecar cannot serve before the world's resume step is
    known); afterwards the serving loop polls `socket` and calls `receive`.
    """

    def __init__(self, address: str, replica: int, instance: str, *, keys: Keypair,
                 context: zmq.Context[Any] | None = None) -> None:
        self.address = address
        self.replica = replica
        self.instance = instance
        self._ctx = context or zmq.Context.instance()
        self.socket = self._ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
        self.socket.setsockopt(zmq.RECONNECT_IVL, messages.RECONNECT_IVL_MS)
        self.socket.setsockopt(zmq.RECONNECT_IVL_MAX, messages.RECONNECT_IVL_MAX_MS)
        keymod.connect_as(self.socket, keys)
        self.socket.connect(address)
        self.published = -1
        self.commitment: tuple[int, str, int] = (-1, "", 0)
        """(drain step, reason, next replicas) of the drain this member acts on, said in every
        `join` (Coordinator.on_join: a restarted coordinator adopts it)."""
        self._last_join = 0.0
        self.replicas = 1
        """The world's size, as `joined` said it: it paces the heartbeat (`at_rest_period_s`)."""
        self._held: list[messages.Message] = []
        self._reach: dict[int, int] = {}
        self._ends: dict[int, int] = {}
        """Everything this member's ranks reported (skip jobs), to say again to a coordinator
        that restarted: its watermark starts empty, and a rank whose look-ahead is full has
        no news to report until the world lets a step through."""
        self._monitor = self.socket.get_monitor_socket(zmq.EVENT_CONNECTED)
        """Tells the loop thread the connection was made again (a restarted coordinator)."""

    def join(self, *, published: int, timeout_s: float) -> Joined:
        """Say `join` until `joined` arrives; the coordinator's pod may still be starting."""
        self.published = published
        deadline = time.monotonic() + timeout_s
        held: list[messages.Message] = []
        while time.monotonic() < deadline:
            self.send(self._join())
            self._last_join = time.monotonic()
            while self.socket.poll(int(JOIN_RESEND_S * 1000)):
                message = self._decode(self.socket.recv())
                if message is None:
                    continue
                if isinstance(message, Joined):
                    self._held, self.replicas = held, message.replicas
                    return message
                held.append(message)  # freeze / commit_at for a world already draining
            self._held = held
        raise errors.UserError(
            f"no coordinator answered at SPLITFEED_COORDINATOR={self.address} within {timeout_s:g} s: "
            "replica 0's sidecar is not running (or not reachable through the job's headless Service)")

    def heartbeat(self, now: float) -> None:
        period = at_rest_period_s(JOIN_RESEND_S * 5, self.replicas, HEARTBEATS_PER_S)
        if self._reconnected() or now - self._last_join >= period:
            self._last_join = now
            self.send(self._join())

    def _join(self) -> Join:
        step, reason, replicas = self.commitment
        return Join(replica=self.replica, instance=self.instance, published=self.published,
                    drain_step=step, drain_reason=reason, next_replicas=replicas)

    def _reconnected(self) -> bool:
        """The socket connected (again) since the last look: a coordinator (re)started."""
        seen = False
        while True:
            try:
                zmq.utils.monitor.recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return seen
            seen = True

    def report_reach(self, reports: dict[int, tuple[int, dict[int, int]]]) -> None:
        """Say what this member's ranks hold ready (skip jobs), and keep it for `joined`."""
        for rank, (assembled, ends) in reports.items():
            self._reach[rank] = max(self._reach.get(rank, -1), assembled)
            merge_ends(self._ends, ends)
        self.send(Reach(replica=self.replica, reports=flat_reports(reports)))

    def joined(self) -> None:
        """A coordinator answered `join`, perhaps one restarted with an empty watermark: say
        every rank's reach and every end found again. The coordinator merges by max and min,
        so saying it twice changes nothing; the world's ends go with one rank, as they count
        for the world whichever rank found them."""
        if not self._reach:
            return
        first = min(self._reach)
        self.send(Reach(replica=self.replica, reports=flat_reports(
            {rank: (reach, self._ends if rank == first else {}) for rank, reach in self._reach.items()})))

    def receive(self) -> list[messages.Message]:
        """Every message waiting (and any held back while joining)."""
        out, self._held = self._held, []
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            message = self._decode(frame)
            if message is not None:
                out.append(message)

    def send(self, message: messages.Message) -> None:
        try:
            self.socket.send(message.encode(), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("the coordinator at %s is not reading; %s not sent", self.address, message.kind)

    def request_drain(self, token: str, reason: str, replicas: int = 0) -> None:
        self.send(DrainRequest(token=token, reason=reason, replicas=replicas))

    def close(self) -> None:
        self.socket.disable_monitor()
        self._monitor.close(linger=0)
        self.socket.close(linger=200)  # let a last `committed_world` go out

    @staticmethod
    def _decode(frame: bytes) -> messages.Message | None:
        try:
            return messages.decode(frame)
        except errors.ProtocolError as exc:
            log.warning("bad message from the coordinator: %s", exc)
            return None
