"""The trainer's ZeroMQ socket to its rank's sidecar (`Channel`): the handshake, checkpoints and
errors go over it; batches never do (they come through the ring)."""

from __future__ import annotations

import collections
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import zmq

from ..contract import messages, versions
from ..contract.errors import CheckpointError, NotWelcomed, ProtocolError, SidecarFailed, VersionMismatch, WorldLost

log = logging.getLogger(__name__)

_Answer = TypeVar("_Answer", messages.Checkpointed, messages.Committed)

Context: TypeAlias = "zmq.Context[Any]"
"""The ZeroMQ context a StreamClient may be given for its socket (by default the process's)."""


def sidecar_mismatch(exc: VersionMismatch) -> str:
    """The sidecar's frame is of another protocol version (`exc`, from decode): say both."""
    assert exc.peer_protocol is not None
    return versions.mismatch(trainer=(messages.PROTOCOL_VERSION, versions.package_version()),
                             sidecar=(exc.peer_protocol, exc.peer_package))


class Channel:
    """The DEALER socket to this rank's sidecar, and the messages read ahead of their turn."""

    def __init__(self, context: Context | None, directory: Path, local_rank: int, *,
                 timeout_s: float, heartbeat_s: float, lost: Callable[[], bool]) -> None:
        """`context`: None for the process's shared one (zmq.Context.instance)."""
        self._timeout_s = timeout_s
        self._heartbeat_s = heartbeat_s
        self._lost = lost
        """Whether this process's world was lost (membership.lost): a WORLD_ENDED is then its news."""
        self._sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.IDENTITY, f"t{local_rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode())
        self._sock.setsockopt(zmq.RECONNECT_IVL, messages.RECONNECT_IVL_MS)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, messages.RECONNECT_IVL_MAX_MS)
        self._sock.connect(f"ipc://{directory / messages.SOCKET_NAME}")
        self._inbox: collections.deque[messages.Message] = collections.deque()

    @property
    def closed(self) -> bool:
        return bool(self._sock.closed)

    def send(self, message: messages.Message) -> None:
        self._sock.send(message.encode())

    def pending(self) -> bool:
        """A message is waiting to be received (now, without waiting)."""
        return bool(self._inbox) or bool(self._sock.poll(0))

    def clear(self) -> None:
        """Drop the messages read ahead (a new handshake answers anew)."""
        self._inbox.clear()

    def receive(self, timeout_s: float) -> messages.Message | None:
        """The next message within `timeout_s`, or None; a fatal error raises SidecarFailed, and
        the word that this process's world was lost raises WorldLost."""
        if self._inbox:
            return self._inbox.popleft()
        if not self._sock.poll(int(timeout_s * 1000)):
            return None
        frame = self._sock.recv()
        try:
            message = messages.decode(frame)
        except VersionMismatch as exc:  # nothing this sidecar says can be read: end here, once
            raise VersionMismatch(sidecar_mismatch(exc), peer_protocol=exc.peer_protocol,
                                  peer_package=exc.peer_package) from None
        except ProtocolError as exc:
            log.error("sidecar sent a malformed message (%s); resynchronising", exc)
            return None
        if isinstance(message, messages.Error):
            if message.fatal and message.code == messages.VERSION_MISMATCH:
                raise VersionMismatch(message.message)  # the sidecar refused this trainer's version
            if message.fatal:
                raise SidecarFailed(message.message)
            if message.code == messages.WORLD_ENDED:
                if self._lost():
                    raise WorldLost(message.message)
                return None  # it answers a hello sent before this process rejoined: nothing now
            log.warning("sidecar: %s", message.message)
        return message

    def request(self, request: messages.Checkpoint | messages.Commit, answer: type[_Answer],
                gone: Callable[[], bool] | None = None) -> _Answer:
        """Send `request` and wait for its `answer` (of the same step); an error reply raises
        CheckpointError, as does `gone()` turning true while no answer came (the sidecar died)."""
        self.send(request)
        step = request.step
        deadline = time.monotonic() + self._timeout_s
        held: list[messages.Message] = []
        try:
            while time.monotonic() < deadline:
                message = self.receive(self._heartbeat_s)
                if message is None and gone is not None and gone():
                    raise CheckpointError(f"the sidecar is gone: no answer to {request.kind} of step {step}")
                if message is None:
                    continue
                if isinstance(message, answer) and message.step == step:
                    return message
                if isinstance(message, messages.Error) and message.code == messages.NOT_WELCOMED:
                    raise NotWelcomed(message.message)  # a restarted sidecar: say hello again
                if isinstance(message, messages.Error):
                    raise CheckpointError(message.message)
                held.append(message)
            raise CheckpointError(f"no answer to {request.kind} of step {step} in {self._timeout_s} s")
        finally:
            self._inbox.extendleft(reversed(held))

    def close(self, *, bye: bool = True) -> None:
        """Say bye (if it can go at once) and close; without `bye`, close at once."""
        if not bye:
            self._sock.close(linger=0)
            return
        try:
            self._sock.send(messages.Bye().encode(), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self._sock.close(linger=100)
