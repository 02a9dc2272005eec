"""The serving loop's answers to each local rank's trainer (hello, checkpoint, commit, drain, bye, wake), and the rank's session they keep."""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Callable, Collection

from splitfeed.trainer_client.contract import wellknown, errors, messages, topology, versions
from splitfeed.trainer_client.transport import ring
from splitfeed.trainer_client.contract.messages import Bye, Checkpoint, Commit, Drain, Error, Hello, Wake

from .following import Coordination
from .lookahead import Assembled
from .publishing import Publisher

log = logging.getLogger(__name__)

END_LINGER_S = 30.0
"""After a trainer took its last batch, how long to keep answering it (a final
checkpoint) when it exits without saying bye."""


class Session:
    """One local rank's trainer session, as the loop thread sees it; only the loop thread writes it."""

    def __init__(self, *, rank: int, start_step: int, total_steps: int) -> None:
        self.rank = rank
        self.start_step = start_step
        self.total_steps = total_steps
        self.peer: bytes | None = None
        self.trainer_pid: int | None = None
        self.end_sent = False
        self.drained = False
        self.said_bye = False
        self.all_taken_at: float | None = None
        """When the loop first saw that the trainer took the last batch."""
        self.failure: str | None = None
        self.permanent = False
        """The failure is a DataError (a transform that fails on a row, say): permanent."""
        self.resume_step = start_step
        """Where this rank's current trainer process started (its model's step)."""
        self.prepared: int | None = None
        """The step of the trainer's last `checkpoint` (phase one, docs/agreement.md)."""
        self.committed: int | None = None
        """The step of its last `commit` (phase two: its model for that step is saved)."""

    def all_taken(self, acked: int, end_step: int | None = None) -> bool:
        """The trainer was told `end` and took every batch (up to `end_step`, default the
        job's last step: a skip job's last epoch may end earlier)."""
        end = self.total_steps if end_step is None else end_step
        return self.end_sent and acked + 1 >= end

    def finished(self, now: float, linger_s: float) -> bool:
        """Drained, said bye, or took its last batch `linger_s` ago (a pure check)."""
        if self.drained or self.said_bye:
            return True
        return self.all_taken_at is not None and now - self.all_taken_at >= linger_s


def _versions_note(trainer_package: str) -> str:
    """The trainer's splitfeed version where it is not the sidecar's (the protocol is the same,
    or decode had refused the hello): worth a word in the log, not a refusal."""
    own = versions.package_version()
    if trainer_package == own:
        return ""
    said = f"splitfeed {trainer_package}" if trainer_package else "a splitfeed that does not say its version"
    return f" (it runs {said}, this sidecar splitfeed {own}; the same wire protocol {messages.PROTOCOL_VERSION})"


@dataclasses.dataclass(frozen=True)
class Feed:
    """A local rank: its publisher (the publishing thread's) and its session (the loop's)."""

    publisher: Publisher
    session: Session

    @property
    def rank(self) -> int:
        return self.session.rank

    @property
    def control(self) -> ring.Control:
        return self.publisher.control


class Answers:
    """What the loop thread answers a trainer's message with; it alone writes the sessions."""

    def __init__(self, feeds: list[Feed], send: Callable[[bytes, messages.Message], None],
                 coordination: Coordination, *, instance: str, world_size: int, steps_per_epoch: int,
                 checkpoint: Callable[[int, int], str] | None,
                 commit: Callable[[int, int], None] | None, earlier: Collection[bytes] = (),
                 groups: topology.Groups = topology.Groups()) -> None:
        self._feeds = feeds
        self._groups = groups
        self._send = send
        self._world = coordination
        self._instance = instance
        self._world_size = world_size
        self._steps_per_epoch = steps_per_epoch
        self._checkpoint = checkpoint
        self._commit = commit
        self._earlier = set(earlier)
        """The trainers (socket identities) this process served in the world before, which changed
        in place, and not yet welcomed in this one."""
        self.last_checkpoint: wellknown.LastCheckpoint | None = None
        self.failed_at: float | None = None
        """When a rank's publisher first failed: the sidecar answers a while longer, then stops."""

    def handle(self, peer: bytes, message: messages.Message) -> None:
        """Answer a trainer's message other than its hello (`hello`, which Server._hello calls)."""
        match message:
            case Checkpoint():
                self._checkpoint_rank(self._feed_for(peer), message.step)
            case Commit():
                self._commit_rank(self._feed_for(peer), message.step)
            case Drain():
                feed = self._feed_for(peer)
                self._world.request_drain(f"{message.reason}-{self._instance}-r{feed.rank}", message.reason)
            case Bye():
                self._feed_for(peer).session.said_bye = True
            case Wake():
                self._feed_for(peer).publisher.wake()
            case _:
                raise errors.ProtocolError(f"a trainer does not send {message.kind!r}")

    def _feed_for(self, peer: bytes) -> Feed:
        for feed in self._feeds:
            if feed.session.peer == peer:
                return feed
        raise errors.NotWelcomed("say hello first")

    def hello(self, peer: bytes, message: Hello) -> None:
        local_rank = message.local_rank
        if not 0 <= local_rank < len(self._feeds):
            raise errors.ProtocolError(
                f"local_rank {local_rank} is not served here (0..{len(self._feeds) - 1})")
        if message.next_step is not None and peer in self._earlier:
            # A trainer of the world before, which still thinks it trains there (its world was
            # lost while it checkpointed or waited): it may not go on here at its own step.
            # This world starts where its coordinator chose; the trainer comes through
            # `rejoin`, whose hello names no step. Nothing here changes.
            self._send(peer, Error(code=messages.WORLD_ENDED, fatal=False, message=(
                "the world this trainer trained in ended, and its sidecar went on to the next: "
                "call StreamClient.rejoin() (failed=True after a lost member pod; README, "
                "'Rescaling in place')")))
            return
        self._earlier.discard(peer)
        feed = self._feeds[local_rank]
        session, control = feed.session, feed.control
        if session.failure:
            session.peer = peer
            self._send(peer, Error(code="source", message=session.failure, fatal=True))
            return
        new_trainer = message.pid != session.trainer_pid
        acked = control.acked
        wanted = message.next_step
        if wanted is None:
            # A new trainer process starts from a model it saved: the world's newest
            # complete step (docs/agreement.md), never after its predecessor's last batch.
            wanted = max(session.start_step, self._world.world_complete if self._world.world_complete is not None else -1)
            session.resume_step = wanted
        if not 0 <= wanted <= session.total_steps:
            raise errors.ProtocolError(f"next_step {wanted} is outside 0..{session.total_steps}")
        same_trainer = session.peer == peer and not new_trainer
        if same_trainer and wanted < acked + 1:
            # A hello that waited in the queue while batches flowed: stale, the
            # trainer has moved on. Answer it without rewinding anything.
            wanted = acked + 1
        in_step = same_trainer and acked + 1 == wanted
        session.peer, session.trainer_pid, session.said_bye = peer, message.pid, False
        if not in_step:
            log.info("rank %d: trainer pid %d continues at global step %d%s",
                     session.rank, message.pid, wanted, _versions_note(message.package))
            control.acked = wanted - 1
            control.trained = -1  # this trainer has said nothing yet
            session.end_sent = False
            # A drained rank publishes nothing more (its trainer stops after saving).
            feed.publisher.reset(wanted, trainer_gone=new_trainer, restart=not session.drained)
        self._send(peer, messages.Welcome(
            instance=self._instance, rank=session.rank, world_size=self._world_size, ctl=str(control.path),
            resume_step=session.resume_step, next_step=wanted, total_steps=session.total_steps,
            steps_per_epoch=self._steps_per_epoch,
            package=versions.package_version() if message.package else "", **self._data_parallel(session.rank)))

    def _data_parallel(self, rank: int) -> dict[str, int]:
        """What a welcome says of model-parallel groups: nothing in a plain job (Welcome.data_rank)."""
        if self._groups.ranks_per_batch == 1:
            return {}
        return {"data_rank": self._groups.rank(rank, self._world_size), "data_size": self._groups.size(self._world_size)}

    def _checkpoint_rank(self, feed: Feed, step: int) -> None:
        """Phase one: write the rank's data position for `step` (not yet resumable)."""
        session = feed.session
        received = feed.control.acked + 1
        # Any step the trainer completed in this world: a framework that reads ahead has
        # received more steps than it trained, and checkpoints the ones it trained.
        if not session.resume_step <= step <= received:
            raise errors.ProtocolError(f"checkpoint of step {step}, but the trainer started at step "
                                       f"{session.resume_step} and has received {received} steps")
        if self._checkpoint is None:
            self._send(session.peer or b"", Error(code="checkpoint", fatal=False,
                                                  message="checkpoints are disabled: set spec.checkpoint.uri"))
            return
        try:
            uri = self._checkpoint(session.rank, step)
        except Exception as exc:  # storage errors: the trainer decides what to do
            log.error("checkpoint of step %d failed: %s", step, exc)
            self._send(session.peer or b"", Error(code="checkpoint", fatal=False,
                                                  message=f"checkpoint of step {step} failed: {exc}"))
            return
        session.prepared = step
        self._send(session.peer or b"", messages.Checkpointed(
            step=step, drained=feed.control.drain_at == step, uri=uri))

    def _commit_rank(self, feed: Feed, step: int) -> None:
        """Phase two: the trainer saved its model for `step`; the step may now be resumed."""
        session = feed.session
        if session.prepared != step:
            raise errors.ProtocolError(
                f"commit of step {step}, but this rank's last checkpoint is of step {session.prepared}")
        assert self._commit is not None  # a prepared step implies a store
        try:
            self._commit(session.rank, step)
        except Exception as exc:
            log.error("commit of step %d failed: %s", step, exc)
            self._send(session.peer or b"", Error(code="checkpoint", fatal=False,
                                                  message=f"commit of step {step} failed: {exc}"))
            return
        session.committed = step
        if not session.drained and feed.control.drain_at == step:
            session.drained = True
            feed.publisher.halt()  # the world drained here: nothing more to publish
        epoch = step // max(1, self._steps_per_epoch)
        self.last_checkpoint = {"step": step, "epoch": epoch, "worldSize": self._world_size,
                                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self._send(session.peer or b"", messages.Committed(step))
        if all(f.session.committed == step for f in self._feeds):
            self._world.committed_world(step)

    def deliver(self, feed: Feed) -> None:
        """Say what the rank's publisher has news of."""
        session = feed.session
        while True:
            try:
                news = feed.publisher.outbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(news, Assembled):
                self._world.note(news)
            elif isinstance(news, BaseException):
                self.fail(session, news)
            elif session.peer is not None and not session.failure:
                self._send(session.peer, news)
                if isinstance(news, messages.End):
                    session.end_sent = True

    def fail(self, session: Session, exc: BaseException) -> None:
        user = isinstance(exc, (errors.UserError, errors.SidecarFailed))
        session.failure = str(exc) if user else f"{type(exc).__name__}: {exc}"
        session.permanent = isinstance(exc, errors.DataError)  # the same data fails in any world
        log.error("rank %d cannot continue: %s", session.rank, session.failure, exc_info=not user)
        if session.peer is not None:
            self._send(session.peer, Error(code="source", message=session.failure, fatal=True))
        # Linger a moment rather than stop: a trainer mid-handshake still maps
        # this sidecar's files and must hear why, not find them gone.
        if self.failed_at is None:
            self.failed_at = time.monotonic()
