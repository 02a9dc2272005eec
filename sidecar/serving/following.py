"""This sidecar's side of the world's agreement: what the coordinator says, applied to its local ranks' publishers, and what those ranks hold, reported."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from splitfeed.trainer_client.contract import messages
from splitfeed.trainer_client.contract.messages import CommitAt, Complete, Error, Freeze, WorldLost

from ..world import agreement, wire
from .lookahead import Assembled, WorldView
from .publishing import Publisher

log = logging.getLogger(__name__)


class Coordination:
    """The world's word as this sidecar knows it (docs/agreement.md); only the loop thread uses it."""

    def __init__(self, *, member: wire.Member | None, world_size: int, steps_per_epoch: int,
                 skipping: bool, on_drain: Callable[[int, str, int], None] | None) -> None:
        self.member = member
        self._on_drain = on_drain
        self.world = WorldView(steps_per_epoch) if skipping else None
        """Skip jobs: which steps the world agreed exist (from the coordinator, or without
        one from `_watermark` over this sidecar's own ranks, then the whole world)."""
        self._watermark = (agreement.Watermark(ranks=world_size, steps_per_epoch=steps_per_epoch)
                           if skipping and member is None else None)
        self._reports: dict[int, tuple[int, dict[int, int]]] = {}
        self.drain_step: int | None = None
        """The step the world agreed to drain at (docs/agreement.md), once committed."""
        self.drain_reason: str | None = None
        self.next_replicas = 0
        """The replicas of the world that follows this one in place (0: none follows)."""
        self.world_complete: int | None = None
        """The newest step every rank of the world has committed."""
        self.lost: WorldLost | None = None
        """Members' pods failed: the world ended without a drain (the serving loop stops)."""

    def request_drain(self, token: str, reason: str, replicas: int = 0) -> None:
        """Ask the world's coordinator for a drain (an annotation, SIGTERM, a trainer's SIGTERM);
        `replicas` > 0: then change the world in place to that many (a newer count wins)."""
        if self.member is None:
            log.warning("drain requested (%s) but this sidecar has no coordinator", reason)
            return
        log.info("asking the world to drain (%s, token %s)%s", reason, token,
                 f" and change in place to {replicas} replicas" if replicas else "")
        self.member.request_drain(token, reason, replicas=replicas)

    def apply(self, publishers: Sequence[Publisher]) -> None:
        """What the coordinator said since the last call, applied to `publishers`."""
        assert self.member is not None
        for message in self.member.receive():
            match message:
                case Freeze():
                    published = max(publisher.freeze() for publisher in publishers)
                    self.member.published = published
                    self.member.send(messages.Frozen(round=message.round, replica=self.member.replica,
                                                     published=published))
                case CommitAt():
                    self._commit_at(message, publishers)
                case WorldLost():
                    if self.lost is None:
                        log.warning("replicas %s are lost: this world ends now", message.lost)
                    self.lost = message
                case Complete():
                    self.world_complete = max(self.world_complete or -1, message.step)
                case messages.Agreed():
                    if self.world is not None:
                        self.world.update(message.through, agreement.parse_ends(message.ends), message.need)
                case messages.Joined():
                    self.member.joined()  # perhaps a restarted coordinator: tell it what it forgot
                case Error():
                    log.warning("coordinator: %s", message.message)
                case _:
                    pass

    def _commit_at(self, message: CommitAt, publishers: Sequence[Publisher]) -> None:
        assert self.member is not None
        step = message.step
        if self.drain_step != step:
            log.info("the world drains at global step %d (%s)", step, message.reason)
        self.drain_step, self.drain_reason = step, message.reason
        if message.drain:
            self.next_replicas = message.next_replicas
            self.member.commitment = (step, message.reason, message.next_replicas)
            if self._on_drain is not None:  # before any rank can see the request
                self._on_drain(step, message.reason, message.next_replicas)
        for publisher in publishers:
            publisher.commit_at(step, drain=message.drain)

    def note(self, news: Assembled) -> None:
        """A rank's publisher holds steps up to `news.reach` ready (skip jobs)."""
        reach, ends = self._reports.get(news.rank, (-1, {}))
        self._reports[news.rank] = (max(reach, news.reach), {**ends, **news.ends})

    def report_reach(self) -> None:
        """What this sidecar's ranks hold ready, in one message per loop turn (skip jobs)."""
        if not self._reports:
            return
        reports, self._reports = self._reports, {}
        if self.member is not None:
            self.member.report_reach(reports)
        elif self._watermark is not None and self.world is not None:
            for rank, (reach, ends) in reports.items():
                self._watermark.report(rank, reach, ends)
            self.world.update(self._watermark.through, self._watermark.ends, -1)

    def committed_world(self, step: int) -> None:
        """Every local rank committed `step`: tell the coordinator."""
        if self.member is not None:
            self.member.send(messages.CommittedWorld(replica=self.member.replica, step=step))
