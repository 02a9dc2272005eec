"""The trainer's two-phase checkpoint control: the step it prepared, its commit, and whether the world drained there."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..contract import membership, messages
from ..transport.channel import Channel
from ..transport import stranded
from ..contract.errors import CheckpointError, NotWelcomed
from .handshake import Session

log = logging.getLogger(__name__)

_Answer = TypeVar("_Answer", messages.Checkpointed, messages.Committed)


class Checkpoints:
    """This rank's checkpoints (docs/agreement.md): `checkpoint` is phase one, `commit` phase two.

    Both go to this rank's sidecar; when that sidecar is gone (killed, and not restarted) at
    the world's drain step, to the world's coordinator instead (`trainer_client.stranded`).
    """

    def __init__(self, session: Session, channel: Channel, directory: Path | None = None,
                 local_rank: int = 0, timeout_s: float = 300.0,
                 rehello: Callable[[], None] | None = None) -> None:
        self._session = session
        self._channel = channel
        self._rehello = rehello
        """Say hello again and take the welcome (StreamClient's): the sidecar restarted."""
        self._dir = directory
        self._local_rank = local_rank
        self._timeout_s = timeout_s
        self.prepared: int | None = None  # step of the last checkpoint(), until committed
        self.last: int | None = None
        """The step of the last checkpoint() in this world, committed or not."""
        self.drained = False
        self.trained: int | None = None
        """Global steps the model has trained, as the loop said (`trained`); None: as many as
        were handed out. A framework that reads ahead hands out more than it trained."""
        self._stand_in: tuple[str, messages.StandIn] | None = None
        """(address, request) when the last checkpoint went to the world's coordinator."""

    def position(self) -> int:
        """The global steps this rank completed: trained where the loop says so, else handed out."""
        return self.trained if self.trained is not None else self._session.next_step or 0

    def mark_trained(self, steps: int) -> None:
        """The model trained the first `steps` global steps (the batch of step `steps - 1` last)."""
        taken = self._session.next_step or 0
        if not 0 <= steps <= taken:
            raise CheckpointError(f"trained({steps}): this rank was handed {taken} global steps, "
                                  "so it cannot have trained more")
        self.trained = steps

    def agreed(self) -> int | None:
        """The step the world agreed to checkpoint after, while it is still ahead or due."""
        control = self._session.control
        at = -1 if control is None else control.checkpoint_at
        return None if at < 0 or self.prepared == at or self.drained else at

    def requested(self) -> bool:
        """The world agreed to checkpoint after the step this rank just completed."""
        return self.agreed() == self.position()

    def checkpoint(self, after_step: int | None = None) -> int:
        """Persist the position after `after_step` global steps (default: `position()`); the
        global steps completed. Any step this process completed in this world may be named:
        the sidecar knows each one's position."""
        step = self.position() if after_step is None else after_step
        first, taken = self._session.resume_step, self._session.next_step or 0
        if not first <= step <= taken:
            raise CheckpointError(
                f"checkpoint(after_step={step}): this rank started this world at global step {first} "
                f"and was handed {taken} steps; name a step in {first}..{taken} (the steps the model "
                "trained: batch.global_step + 1 of the last batch it trained on)")
        stand_in = self._stranded(step)
        if stand_in is None:
            try:
                reply = self._request(messages.Checkpoint(step), messages.Checkpointed)
            except CheckpointError:
                stand_in = self._stranded(step)  # it died while asked
                if stand_in is None:
                    raise
        if stand_in is not None:
            reply = stranded.ask(stand_in[0], stand_in[1], messages.Checkpointed, self._timeout_s)
        self.prepared, self._stand_in, self.last = step, stand_in, step
        self.drained = reply.drained
        return step

    def commit(self, step: int | None = None) -> None:
        """The model for `step` (default: the last checkpoint) is saved."""
        if step is None:
            step = self.prepared
        if step is None or step != self.prepared:
            raise CheckpointError(f"commit of step {step}, but the last checkpoint() was of step {self.prepared}")
        stand_in = self._stand_in
        if stand_in is None:
            try:
                self._request(messages.Commit(step), messages.Committed)
            except CheckpointError:
                stand_in = self._stranded(step)  # it died after the record, before the marker
                if stand_in is None:
                    raise
                stranded.ask(stand_in[0], stand_in[1], messages.Checkpointed, self._timeout_s)
        if stand_in is not None:
            address, prepared = stand_in
            stranded.ask(address, dataclasses.replace(prepared, commit=True), messages.Committed, self._timeout_s)
        self.prepared, self._stand_in = None, None

    def commit_implicitly(self) -> None:
        if self.prepared is not None:
            self.commit(self.prepared)

    def reset(self) -> None:
        """A new world: nothing prepared, nothing drained."""
        self.drained = False
        self.prepared, self._stand_in, self.trained, self.last = None, None, None, None

    def _request(self, request: messages.Checkpoint | messages.Commit, answer: type[_Answer]) -> _Answer:
        """`request` to this rank's sidecar; once more after a hello if a restarted sidecar did
        not know this trainer (the kubelet restarted it during a drain: its restarted member
        rejoined committed to the drain step, sidecar.commitments, and serves it again)."""
        try:
            return self._channel.request(request, answer, self._gone)
        except NotWelcomed:
            if self._rehello is None:
                raise CheckpointError("the sidecar restarted and does not know this trainer") from None
            log.warning("the sidecar restarted: saying hello again before %s of step %d", request.kind,
                        request.step)
            self._rehello()
            return self._channel.request(request, answer, self._gone)

    def _gone(self) -> bool:
        return self._dir is not None and stranded.gone(self._dir)

    def _stranded(self, step: int) -> tuple[str, messages.StandIn] | None:
        """(the coordinator's address, the request) when this rank's sidecar is gone and `step` is
        the world's drain step; None otherwise (the normal path: nothing looked at for any other
        step, one look at a lock file, ~10 us, for the drain step)."""
        control = self._session.control
        if self._dir is None or control is None or control.drain_at != step or not stranded.gone(self._dir):
            return None
        epoch = self._session.world_epoch
        address, world = stranded.coordinator(self._dir, epoch), membership.read(self._dir)
        if address is None or world is None or world.epoch != epoch:
            return None  # replica 0's (its sidecar is the coordinator), or a sidecar that says nothing
        log.warning("this rank's sidecar is gone: asking the world's coordinator at %s to checkpoint "
                    "drain step %d in its stead", address, step)
        return address, messages.StandIn(rank=world.rank + self._local_rank, world_size=world.world_size,
                                         world_epoch=epoch, step=step)
