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
import threading
import time
from typing import Any

import zmq

from splitfeed.trainer_client import errors, messages
from splitfeed.trainer_client.messages import (
    CommitAt, Complete, CommittedWorld, DrainAck, DrainRequest, Error, Freeze, Frozen, Join, Joined,
)

log = logging.getLogger(__name__)

EVERY = b""
"""Send to every joined member."""

IDLE, WAITING_FOR_MEMBERS, FREEZING, COMMITTED = "idle", "waiting-for-members", "freezing", "committed"


@dataclasses.dataclass(frozen=True)
class Out:
    """One message to send: to `peer` (EVERY: each member)."""

    peer: bytes
    message: messages.Message


def cut_step(published: list[int], total_steps: int) -> int:
    """The drain step S: every rank takes batches up to S - 1, then checkpoints.

    Batch S - 1 must be published nowhere yet, so the checkpoint request is
    visible to every rank before that batch is (docs/agreement.md, "Commit").
    """
    return min(max(published) + 2, total_steps)


class Coordinator:
    """Decides the world's drain step; knows the members and the last complete step."""

    def __init__(self, *, replicas: int, total_steps: int, resume_step: int,
                 table_version: int | None = None) -> None:
        self.replicas = replicas
        self.total_steps = total_steps
        self.resume_step = resume_step
        self.table_version = table_version
        self.members: dict[int, bytes] = {}
        self.phase = IDLE
        self.round = 0
        self.reason: str | None = None
        self.tokens: set[str] = set()
        self.answers: dict[int, int] = {}
        self.step: int | None = None
        """The committed drain step, once fixed."""
        self.commits: dict[int, set[int]] = {}
        self.complete_step: int | None = None

    def on_join(self, peer: bytes, replica: int) -> list[Out]:
        if not 0 <= replica < self.replicas:
            raise errors.ProtocolError(f"replica {replica} is not in this world (0..{self.replicas - 1})")
        self.members[replica] = peer
        out = [Out(peer, Joined(resume_step=self.resume_step, table_version=self.table_version))]
        if self.phase == WAITING_FOR_MEMBERS and len(self.members) == self.replicas:
            return out + self._freeze()
        if self.phase == FREEZING and replica not in self.answers:
            out.append(Out(peer, Freeze(round=self.round)))
        elif self.phase == COMMITTED:
            assert self.step is not None
            out.append(Out(peer, self._commit_at()))
        if self.complete_step is not None:
            out.append(Out(peer, Complete(step=self.complete_step)))
        return out

    def on_request(self, peer: bytes, token: str, reason: str) -> list[Out]:
        """A drain request from the operator, a member or a member's trainer."""
        fresh = token not in self.tokens
        self.tokens.add(token)
        out: list[Out] = []
        if fresh and self.phase == IDLE:
            self.reason = reason
            log.info("drain requested (%s, token %s)", reason, token)
            if len(self.members) == self.replicas:
                out = self._freeze()
            else:
                self.phase = WAITING_FOR_MEMBERS
                log.info("waiting for %d of %d members before freezing",
                         self.replicas - len(self.members), self.replicas)
        return out + [Out(peer, DrainAck(token=token, state=self.phase))]

    def on_frozen(self, replica: int, round_: int, published: int) -> list[Out]:
        if self.phase != FREEZING or round_ != self.round:
            return []  # an answer to a round that is over
        self.answers[replica] = published
        if len(self.answers) < self.replicas:
            return []
        self.step = cut_step(list(self.answers.values()), self.total_steps)
        self.phase = COMMITTED
        log.info("the world drains at global step %d (highest published: %s)", self.step,
                 dict(sorted(self.answers.items())))
        return [Out(EVERY, self._commit_at())]

    def _commit_at(self) -> CommitAt:
        assert self.step is not None
        return CommitAt(round=self.round, step=self.step, drain=True, reason=self.reason or "drain")

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

    def _freeze(self) -> list[Out]:
        self.phase = FREEZING
        self.round += 1
        self.answers = {}
        return [Out(EVERY, Freeze(round=self.round))]


class CoordinatorThread:
    """Replica 0's coordinator on a ROUTER socket, in a thread of its own.

    A thread rather than the serving loop: members wait for `joined` while
    replica 0's own sidecar is still preparing, and the coordinator must
    answer them (its own member included) before any loop runs.
    """

    def __init__(self, coordinator: Coordinator, bind: str,
                 context: zmq.Context[Any] | None = None) -> None:
        self.coordinator = coordinator
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(bind)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coordinator", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sock.close(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            try:
                peer, frame = self._sock.recv_multipart(zmq.NOBLOCK)
            except (zmq.Again, ValueError):
                continue  # a frame count we never send
            try:
                self._send(self._handle(peer, messages.decode(frame)))
            except errors.ProtocolError as exc:
                log.warning("coordinator: bad message from %r: %s", peer, exc)
                self._send([Out(peer, Error(code="protocol", message=str(exc), fatal=False))])

    def _handle(self, peer: bytes, message: messages.Message) -> list[Out]:
        c = self.coordinator
        match message:
            case Join():
                return c.on_join(peer, message.replica)
            case DrainRequest():
                return c.on_request(peer, message.token, message.reason)
            case Frozen():
                return c.on_frozen(message.replica, message.round, message.published)
            case CommittedWorld():
                return c.on_committed(message.replica, message.step)
            case _:
                raise errors.ProtocolError(f"the coordinator does not take {message.kind!r}")

    def _send(self, outs: list[Out]) -> None:
        for out in outs:
            targets = list(self.coordinator.members.values()) if out.peer == EVERY else [out.peer]
            frame = out.message.encode()
            for target in targets:
                try:
                    self._sock.send_multipart([target, frame], zmq.NOBLOCK)
                except zmq.ZMQError as exc:  # gone, or not reading: it rejoins if it comes back
                    log.debug("coordinator cannot reach %r: %s", target, exc)


JOIN_RESEND_S = 2.0
"""A member says `join` again this often while it waits, and as a heartbeat while it
serves: a coordinator that restarted learns its members back, and answers are idempotent."""


class Member:
    """One sidecar's side of the agreement: a DEALER to the coordinator.

    `join` blocks (the sidecar cannot serve before the world's resume step is
    known); afterwards the serving loop polls `socket` and calls `receive`.
    """

    def __init__(self, address: str, replica: int, instance: str,
                 context: zmq.Context[Any] | None = None) -> None:
        self.address = address
        self.replica = replica
        self.instance = instance
        self._ctx = context or zmq.Context.instance()
        self.socket = self._ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
        self.socket.connect(address)
        self.published = -1
        self._last_join = 0.0
        self._held: list[messages.Message] = []

    def join(self, *, published: int, timeout_s: float) -> Joined:
        """Say `join` until `joined` arrives; the coordinator's pod may still be starting."""
        self.published = published
        deadline = time.monotonic() + timeout_s
        held: list[messages.Message] = []
        while time.monotonic() < deadline:
            self.send(Join(replica=self.replica, instance=self.instance, published=published))
            self._last_join = time.monotonic()
            while self.socket.poll(int(JOIN_RESEND_S * 1000)):
                message = self._decode(self.socket.recv())
                if message is None:
                    continue
                if isinstance(message, Joined):
                    self._held = held
                    return message
                held.append(message)  # freeze / commit_at for a world already draining
            self._held = held
        raise errors.UserError(
            f"no coordinator answered at SPLITFEED_COORDINATOR={self.address} within {timeout_s:g} s: "
            "replica 0's sidecar is not running (or not reachable through the job's headless Service)")

    def heartbeat(self, now: float) -> None:
        if now - self._last_join >= JOIN_RESEND_S * 5:
            self._last_join = now
            self.send(Join(replica=self.replica, instance=self.instance, published=self.published))

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

    def request_drain(self, token: str, reason: str) -> None:
        self.send(DrainRequest(token=token, reason=reason))

    def close(self) -> None:
        self.socket.close(linger=200)  # let a last `committed_world` go out

    @staticmethod
    def _decode(frame: bytes) -> messages.Message | None:
        try:
            return messages.decode(frame)
        except errors.ProtocolError as exc:
            log.warning("bad message from the coordinator: %s", exc)
            return None
