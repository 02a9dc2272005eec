"""The world's agreement on one drain step (docs/agreement.md), as a pure state machine.

`Coordinator` runs in replica 0's sidecar and decides; every sidecar (replica 0's
too) is a member that joins it, freezes its publishers when asked and applies
the committed step. The machine below keeps no sockets and no clock: each
`on_*` call returns the messages to send, so every interleaving the tests care
about (a request before every member joined, a member restarted mid-round, a
late answer to an old round) is a plain function call. sidecar/world/wire.py is
the thin edge that runs it on ZeroMQ: `wire.CoordinatorThread` on a ROUTER socket,
`wire.Member` each sidecar's DEALER to it, paced by the rule at the end of this module.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from splitfeed.trainer_client.contract import errors, messages, progress
from splitfeed.trainer_client.contract.messages import (
    Agreed,
    CommitAt,
    Complete,
    DrainAck,
    Freeze,
    Joined,
    Progress,
    WorldLost,
)

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
