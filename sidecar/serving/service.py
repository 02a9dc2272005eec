"""The sidecar's serving loop: fill each local rank's ring, answer its trainer.

One owner per thread. The loop thread owns the ZeroMQ ROUTER socket, answers
the trainers and alone writes each rank's `Session` (who its trainer is, what
it committed, whether it is done). One publishing thread per rank (its
`Publisher`) reads that rank's batches and alone writes its slots (through
`slots`, which holds the format). They share the control block, an outbox and
a wake-up event; the loop stops a publisher (`halt`, `stop`) rather than set a
flag it reads. A malformed message gets an error reply and a log line;
nothing a trainer sends can stop the loop: ZeroMQ drops a frame over
MAX_MESSAGE_BYTES before buffering it, and replies never block (a peer that
does not read loses them).

The loop and its sockets are here; a rank's ring writer is `publishing` (its files
`ringfiles`), skip jobs' look-ahead `lookahead`, the answers to trainers
`answering`, and what the world's coordinator says `following`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import zmq

from splitfeed.trainer_client.contract import wellknown, errors, messages, topology, versions
from splitfeed.trainer_client.transport import ring
from splitfeed.trainer_client.contract.messages import Error, Hello

from ..world import wire
from .answering import END_LINGER_S as END_LINGER_S, Answers, Feed as Feed, Session as Session
from .following import Coordination
from .lookahead import (
    LOOKAHEAD_MIN as LOOKAHEAD_MIN,
    AgreedSteps as AgreedSteps,
    Assembled,
    WorldView as WorldView,
    epoch_ends as epoch_ends,
    no_step_left as no_step_left,
)
from .publishing import Publisher as Publisher, SourceFactory as SourceFactory

log = logging.getLogger(__name__)

FAILURE_LINGER_S = 2.0
"""How long a failed sidecar keeps answering (with the error) before it exits."""

SEND_HWM = 64
"""Replies queued per trainer before more are dropped: a trainer has a few outstanding
at most (a welcome, a checkpoint's answer, an `end`); one that does not read is not waited for."""

CLOSE_LINGER_S = 2.0
"""How long the last replies (a drained rank's `committed`) may take to leave when the sidecar exits."""


class Push:
    """A publishing or reading thread's one-byte signal that wakes the loop: a ZeroMQ PUSH
    socket of that thread's own (lookahead.Signal)."""

    def __init__(self, context: zmq.Context[Any], address: str) -> None:
        self._sock = context.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)

    def send(self) -> None:
        self._sock.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        self._sock.close()


class Sockets:
    """The loop thread's ZeroMQ sockets: the ROUTER its trainers talk to and the PULL its
    publishing threads signal on, polled with the coordinator's (if any)."""

    def __init__(self, context: zmq.Context[Any], directory: Path, instance: str,
                 member: wire.Member | None) -> None:
        self._ctx = context
        self._path = directory / messages.SOCKET_NAME
        self.router = context.socket(zmq.ROUTER)
        # MANDATORY: a full or unknown peer is an error (EAGAIN, EHOSTUNREACH) on a
        # NOBLOCK send, never a silent drop or a wait; MAXMSGSIZE: a larger frame
        # disconnects its sender before it is buffered.
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.router.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"ipc://{self._path}")
        self._signal_address = f"inproc://sources-{instance}"
        self._signals = context.socket(zmq.PULL)
        self._signals.setsockopt(zmq.LINGER, 0)
        self._signals.bind(self._signal_address)
        self._poller = zmq.Poller()
        self._poller.register(self.router, zmq.POLLIN)
        self._poller.register(self._signals, zmq.POLLIN)
        if member is not None:
            self._poller.register(member.socket, zmq.POLLIN)
        self._complained_at = -1.0
        self._complaints = 0

    def signal(self) -> Push:
        """A publishing or reading thread's own signal to the loop (lookahead.OpenSignal)."""
        return Push(self._ctx, self._signal_address)

    def poll(self, timeout_ms: int) -> dict[Any, int]:
        return dict(self._poller.poll(timeout_ms))

    def signalled(self, events: dict[Any, int]) -> bool:
        """A publisher signalled among `events`: its signals are read (the outboxes hold the news)."""
        if self._signals not in events:
            return False
        while True:
            try:
                self._signals.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True

    def complain(self, peer: bytes, what: str) -> None:
        """A warning about a peer, at most one a second: a hostile peer must not flood the log."""
        now = time.monotonic()
        if now - self._complained_at < 1.0 and self._complained_at >= 0:
            self._complaints += 1
            return
        more = f" ({self._complaints} more such warnings in the last second)" if self._complaints else ""
        log.warning("trainer %r %s%s", peer[:32], what, more)
        self._complained_at, self._complaints = now, 0

    def close(self) -> None:
        # A reply sent just before (the `committed` that drained the last rank) may
        # still be queued in ZeroMQ's I/O thread: it goes out when `flush` waits for it.
        self.router.close(linger=int(CLOSE_LINGER_S * 1000))
        self._signals.close(linger=0)
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass


class Server:
    """Serves the local ranks of one pod (or one local process group): the loop thread, its
    sockets, and what it tells the world's agreement (following) and trainers (answering)."""

    def __init__(self, *, directory: Path, ranks: list[int], world_size: int,
                 factory: SourceFactory, steps_per_epoch: int, total_steps: int,
                 start_step: int, resume_step: int, prefetch: int,
                 checkpoint: Callable[[int, int], str] | None = None,
                 commit: Callable[[int, int], None] | None = None,
                 member: wire.Member | None = None,
                 instance: str | None = None,
                 context: zmq.Context[Any] | None = None,
                 skipping: bool = False,
                 on_published: Callable[[int, int], None] | None = None,
                 on_drain: Callable[[int, str, int], None] | None = None,
                 earlier: Collection[bytes] = (), groups: topology.Groups = topology.Groups()) -> None:
        self.directory = Path(directory)
        self.instance = instance or uuid.uuid4().hex[:12]
        self.world_size = world_size
        self.steps_per_epoch = steps_per_epoch
        self.total_steps = total_steps
        self.resume_step = resume_step
        self.member = member
        self._ctx = context or zmq.Context.instance()
        self.context = self._ctx
        """The ZeroMQ context of the sidecar's sockets: `flush` it before the process exits."""
        served = served_out(self.directory)
        sweep(self.directory)
        self._sockets = Sockets(self._ctx, self.directory, self.instance, member)
        self.sock = self._sockets.router
        signal = self._sockets.signal
        self._coordination = Coordination(member=member, world_size=world_size, steps_per_epoch=steps_per_epoch,
                                          skipping=skipping, on_drain=on_drain)
        self.world = self._coordination.world
        self.feeds = [
            Feed(Publisher(directory=self.directory, instance=self.instance, local_rank=i, rank=rank,
                           factory=factory, signal=signal, prefetch=prefetch,
                           start_step=start_step, total_steps=total_steps, local_ranks=len(ranks),
                           world=self.world, on_published=on_published),
                 Session(rank=rank, start_step=start_step, total_steps=total_steps))
            for i, rank in enumerate(ranks)
        ]
        self._answers = Answers(self.feeds, self._send, self._coordination, instance=self.instance,
                                world_size=world_size, steps_per_epoch=steps_per_epoch,
                                checkpoint=checkpoint, commit=commit, earlier=earlier, groups=groups)
        for i, feed in enumerate(self.feeds):
            if i in served:  # nobody will say hello: finish once the linger for a checkpoint ends
                log.info("rank %d: its trainer took every batch from this sidecar's predecessor; "
                         "nothing is left to serve", feed.rank)
                feed.session.all_taken_at = time.monotonic()
        self.stopping = threading.Event()
        self.end_linger_s = END_LINGER_S
        self.preempt_requested = False
        """Set by a SIGTERM handler; the loop asks the world to drain (sockets belong to the loop)."""

    # -- the world's agreement ------------------------------------------------------

    @property
    def drain_step(self) -> int | None:
        """The step the world agreed to drain at (docs/agreement.md), once committed."""
        return self._coordination.drain_step

    @property
    def drain_reason(self) -> str | None:
        return self._coordination.drain_reason

    @property
    def next_replicas(self) -> int:
        """The replicas of the world that follows this one in place (0: none follows)."""
        return self._coordination.next_replicas

    @property
    def world_lost(self) -> messages.WorldLost | None:
        """Members' pods failed and the world ended without a drain (docs/agreement.md)."""
        return self._coordination.lost

    @property
    def last_checkpoint(self) -> wellknown.LastCheckpoint | None:
        """The step, epoch, world size and time of this sidecar's last commit."""
        return self._answers.last_checkpoint

    def request_drain(self, token: str, reason: str, replicas: int = 0) -> None:
        """Ask the world's coordinator for a drain (an annotation, SIGTERM, a trainer's SIGTERM)."""
        self._coordination.request_drain(token, reason, replicas)

    def _coordinate(self) -> None:
        self._coordination.apply([feed.publisher for feed in self.feeds])

    def fail_all(self, message: str, *, grace_s: float) -> None:
        """Tell every trainer that says hello why this sidecar cannot serve, then stop."""
        for feed in self.feeds:
            feed.session.failure = message
            feed.publisher.halt()
        deadline = time.monotonic() + grace_s
        while not self.stopping.is_set() and time.monotonic() < deadline:
            if self.sock.poll(100):
                self._receive()
            if all(feed.session.peer is not None for feed in self.feeds):
                break  # every trainer has been told

    # -- the loop -----------------------------------------------------------------

    def finished(self, now: float | None = None) -> bool:
        """Every rank drained, said bye, or took its last batch END_LINGER_S ago; changes nothing.

        A trainer that took its last batch may still checkpoint (saving at the
        end is common), so the sidecar answers until the trainer says bye
        (StreamClient.close) or the linger runs out. The loop notes when each
        trainer took its last batch (`_note_all_taken`) before it asks.
        """
        now = time.monotonic() if now is None else now
        if self._answers.failed_at is not None:
            return now - self._answers.failed_at > FAILURE_LINGER_S
        return all(f.session.finished(now, self.end_linger_s) for f in self.feeds)

    def _note_all_taken(self, now: float) -> None:
        for f in self.feeds:
            if f.session.all_taken_at is None and f.session.all_taken(f.control.acked, f.control.end_step):
                f.session.all_taken_at = now

    def run(self, tick: Callable[[], None] | None = None) -> None:
        """Serve until every rank is finished or `stopping` is set."""
        if self.member is not None:
            # What came with `joined` (a world already draining: a restarted member is told the
            # committed step at once) reaches the publishers before any of them starts.
            self._coordinate()
        while not self.stopping.is_set():
            now = time.monotonic()
            self._note_all_taken(now)
            if self.finished(now):
                break
            # Publishers and trainers wake the loop with a message; the timeout
            # only paces `tick` and the `finished` linger.
            events = self._sockets.poll(100)
            if self._sockets.signalled(events):
                for feed in self.feeds:
                    self._answers.deliver(feed)
                self._coordination.report_reach()
            if self.sock in events:
                self._receive()
            if self.preempt_requested:
                self.preempt_requested = False
                self.request_drain(f"preempt-{self.instance}", "preempt")
            if self.member is not None:
                if self.member.socket in events:
                    self._coordinate()
                if self.world_lost is not None:
                    break  # no step can be agreed: the world is over (its trainers' peers are gone)
                self.member.heartbeat(time.monotonic())
            if tick is not None:
                tick()

    def close(self) -> None:
        for feed in self.feeds:
            feed.publisher.close()
        if self.member is not None:
            self.member.close()
        self._sockets.close()

    def _send(self, peer: bytes, message: messages.Message) -> None:
        """Never blocks: a peer that does not read (SEND_HWM answers queued) loses the answer."""
        try:
            self.sock.send_multipart([peer, message.encode()], zmq.NOBLOCK)
        except zmq.Again:
            self._sockets.complain(peer, f"does not read its socket; its {message.kind} message is dropped")
            return
        except zmq.ZMQError as exc:  # EHOSTUNREACH: that trainer is gone
            log.debug("cannot reach trainer %r: %s", peer, exc)
            return
        for feed in self.feeds:  # a trainer asleep on its ring reads the message now (slots, rule 4)
            if feed.session.peer == peer:
                with contextlib.suppress(ValueError):  # its control block is closed: nobody sleeps on it
                    feed.control.bump(ring.POSTS)
                    feed.control.wake(ring.POSTS)

    def _hello(self, peer: bytes, message: Hello) -> None:
        """A trainer says who it is and where it continues: welcome it (Answers.hello)."""
        self._answers.hello(peer, message)

    def _receive(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            peer, body = frames[0], frames[1:]
            try:
                if len(body) != 1:
                    raise errors.ProtocolError(f"expected 1 frame, got {len(body)}")
                message = messages.decode(body[0])
                if isinstance(message, Hello):
                    self._hello(peer, message)
                else:
                    self._answers.handle(peer, message)
            except errors.VersionMismatch as exc:
                refuse_version(self.sock, self._sockets.complain, peer, exc)
            except errors.ProtocolError as exc:
                self._sockets.complain(peer, f"sent a bad message: {exc}")
                code = messages.NOT_WELCOMED if isinstance(exc, errors.NotWelcomed) else "protocol"
                self._send(peer, Error(code=code, message=str(exc), fatal=False))


def refuse_version(sock: zmq.Socket[Any], complain: Callable[[bytes, str], None], peer: bytes,
                   exc: errors.VersionMismatch) -> None:
    """A frame of another protocol version: one fatal error in the sender's version, which it
    reads whatever its version (messages, "Versions"), and one line in the log (at most one a
    second, however often it is said). A version no peer has gets a plain protocol error."""
    assert exc.peer_protocol is not None
    text = versions.mismatch(trainer=(exc.peer_protocol, exc.peer_package),
                             sidecar=(messages.PROTOCOL_VERSION, versions.package_version()))
    frame = messages.refusal(exc.peer_protocol, text)
    complain(peer, f"is refused: {text}" if frame is not None else f"sent a bad message: {exc}")
    if frame is None:
        frame = Error(code="protocol", message=str(exc), fatal=False).encode()
    with contextlib.suppress(zmq.ZMQError):  # zmq.Again included: a peer that does not read
        sock.send_multipart([peer, frame], zmq.NOBLOCK)


def flush(context: zmq.Context[Any], timeout_s: float = CLOSE_LINGER_S + 1.0) -> bool:
    """Before the process exits: let the replies closed sockets still queue go out.

    `_send` only hands a reply to ZeroMQ's I/O thread; the process exiting right
    after (a drained sidecar stops once its last rank committed, and a forked
    sidecar ends with os._exit) kills that thread with the reply still queued,
    and the trainer waits in vain for its `committed`. Terminating the context
    waits for each closed socket's queue up to its linger; a socket left open (a
    publishing thread that did not stop) would block it forever, hence the
    deadline. Call it last: the context is unusable afterwards. True once done.
    """
    done = threading.Thread(target=context.term, name="zmq-flush", daemon=True)
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        log.debug("ZeroMQ's last messages were not all sent in %.1f s", timeout_s)
        return False
    return True


def tune_interpreter() -> None:
    """Hand the GIL over faster in a sidecar process.

    The serving loop answers trainers while publishing threads run Python code;
    with CPython's default 5 ms switch interval an answer (a checkpoint's, a
    welcome) can wait that long for the GIL.
    """
    sys.setswitchinterval(0.0002)


def served_out(directory: Path) -> set[int]:
    """Local ranks whose trainer took the last batch from a sidecar that was here before
    (restarted in place: its control blocks are still in the emptyDir). Such a trainer
    may be gone: the restarted sidecar must not wait for its hello for ever."""
    done: set[int] = set()
    for path in directory.glob("ctl-*-r*") if directory.is_dir() else []:
        try:
            local_rank = int(path.name.rsplit("-r", 1)[1])
            control = ring.Control(path, create=False)
        except (ValueError, OSError):
            continue  # torn, foreign or of another layout: nothing to learn from it
        try:
            if control.end_step > 0 and control.acked + 1 >= control.end_step:
                done.add(local_rank)
        finally:
            control.close()
    return done


def sweep(directory: Path) -> None:
    """Remove ring files and sockets a crashed sidecar left behind. A directory it makes is the
    owner's alone (a pod's emptyDir is the kubelet's, and private to the pod)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for path in directory.iterdir():
        if path.name.startswith(("ctl-", "slot-")) or path.name == messages.SOCKET_NAME:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
