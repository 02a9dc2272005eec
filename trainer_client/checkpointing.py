"""The trainer's two-phase checkpoint control: the step it prepared, its commit, and whether the world drained there."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import messages
from .errors import CheckpointError
from .handshake import Session

if TYPE_CHECKING:
    from .client import Channel


class Checkpoints:
    """This rank's checkpoints (docs/agreement.md): `checkpoint` is phase one, `commit` phase two."""

    def __init__(self, session: Session, channel: Channel) -> None:
        self._session = session
        self._channel = channel
        self.prepared: int | None = None  # step of the last checkpoint(), until committed
        self.drained = False

    def requested(self) -> bool:
        """The world agreed to checkpoint after the batch this rank just took."""
        control, step = self._session.control, self._session.next_step
        if control is None or step is None:
            return False
        at = control.checkpoint_at
        return at >= 0 and step == at and self.prepared != at and not self.drained

    def checkpoint(self) -> int:
        """Persist the position after the last batch handed out; the global steps completed."""
        step = self._session.next_step or 0
        reply = self._channel.request(messages.Checkpoint(step), messages.Checkpointed)
        self.prepared = step
        self.drained = reply.drained
        return step

    def commit(self, step: int | None = None) -> None:
        """The model for `step` (default: the last checkpoint) is saved."""
        if step is None:
            step = self.prepared
        if step is None or step != self.prepared:
            raise CheckpointError(f"commit of step {step}, but the last checkpoint() was of step {self.prepared}")
        self._channel.request(messages.Commit(step), messages.Committed)
        self.prepared = None

    def commit_implicitly(self) -> None:
        if self.prepared is not None:
            self.commit(self.prepared)

    def reset(self) -> None:
        """A new world: nothing prepared, nothing drained."""
        self.drained = False
        self.prepared = None
