"""The drain agreement on ZeroMQ (docs/agreement.md): `CoordinatorThread` runs replica 0's
`agreement.Coordinator` on a CURVE ROUTER socket in a thread of its own, admitting only the
job's keypair (its ZAP handler in the same thread) and counting what goes through it
(`Traffic`, `Rejections`); `Member` is each sidecar's DEALER to it. Every decision is the pure
machine's (sidecar/world/agreement.py): this module only moves its messages, and is the one
module of sidecar/world that imports zmq (pyproject.toml's import contract).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.utils.monitor

from splitfeed.trainer_client.contract import errors, messages
from splitfeed.trainer_client.transport import keys as keymod
from splitfeed.trainer_client.transport.keys import Keypair
from splitfeed.trainer_client.contract.messages import (
    Reach,
    CommittedWorld,
    DrainRequest,
    Error,
    Frozen,
    Join,
    Joined,
    Progress,
    StandIn,
    StatusRequest,
)

from . import agreement, standins
from .agreement import (
    COMMITTED,
    HEARTBEATS_PER_S,
    JOIN_RESEND_S,
    Coordinator,
    Out,
    at_rest_period_s,
    flat_reports,
    merge_ends,
)

log = logging.getLogger(agreement.__name__)
"""The agreement's one logger: its socket side's lines keep the name they always had (a
sidecar's log line names its logger)."""

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
