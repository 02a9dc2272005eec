"""The coordinator standing in for a dead member sidecar: which ranks' checkpoints it may write.

A member's sidecar killed with `restartPolicy: Never` after the world committed its drain step
S stays dead, while its trainers can still reach S from the batches already in their rings
(docs/agreement.md, "A sidecar that cannot restart"). Such a trainer sends `stand_in` to the
world's coordinator (trainer_client.stranded), which writes the rank's record and commit
marker at S through the job's store (`sidecar.opening` wires the write), and counts the member as
committed once every rank of it is. Pure: `StandIns` decides and remembers; the coordinator's
thread (`wire.CoordinatorThread`) writes and answers.

Accepted only where the coordinator knows the rank's position as well as its own sidecar did:
the committed drain step of its own world, in a job that drops no rows (a plain job's ranks all
hold the same position at a step; under onTransformError skip/warn each rank's is its own), for
a rank of a member that joined it (not replica 0's, whose sidecar is this coordinator).
"""

from __future__ import annotations

from collections.abc import Collection

from splitfeed.trainer_client.contract.messages import StandIn

OWN = 0
"""Replica 0: its sidecar runs the coordinator (agreement.OWN)."""


class StandIns:
    """What one world's coordinator wrote for ranks whose sidecar is gone."""

    def __init__(self, *, world_size: int, replicas: int) -> None:
        self.world_size = world_size
        self.replicas = max(1, replicas)
        self.prepared: set[tuple[int, int]] = set()
        """(rank, step) whose record this coordinator wrote."""
        self.committed: dict[int, set[int]] = {}
        """step -> ranks whose commit marker this coordinator wrote."""

    def replica_of(self, rank: int) -> int:
        return rank // max(1, self.world_size // self.replicas)

    def refusal(self, request: StandIn, *, world_epoch: int, drain_step: int | None, skipping: bool,
                members: Collection[int], lost: bool) -> str | None:
        """Why the coordinator may not write `request` (one line), or None when it may."""
        rank, step, epoch = request.rank, request.step, request.world_epoch
        if epoch != world_epoch:
            return f"the request is for world {epoch}; this coordinator runs world {world_epoch}"
        if lost:
            return f"world {world_epoch} lost member pods and ended without a drain"
        if skipping:
            return ("this job drops rows (onTransformError skip/warn): a rank's position at a step is "
                    "known only to its own sidecar")
        if drain_step is None:
            return f"world {world_epoch} has no committed drain step"
        if step != drain_step:
            return f"step {step} is not world {world_epoch}'s drain step {drain_step}"
        if request.world_size != self.world_size or not 0 <= rank < self.world_size:
            return f"rank {rank} of {request.world_size} is not in this world of {self.world_size} ranks"
        replica = self.replica_of(rank)
        if replica == OWN:
            return f"rank {rank} is replica {OWN}'s, whose sidecar is this coordinator"
        if replica not in members:
            return f"replica {replica} (rank {rank}) has not joined this coordinator"
        if request.commit and (rank, step) not in self.prepared:
            return f"rank {rank} has no record of step {step} written here: checkpoint before commit"
        return None

    def wrote(self, request: StandIn) -> int | None:
        """Note what was written for `request`; the replica whose every rank is now committed at
        its step (the coordinator counts it as that member's `committed_world`), else None."""
        if not request.commit:
            self.prepared.add((request.rank, request.step))
            return None
        ranks = self.committed.setdefault(request.step, set())
        ranks.add(request.rank)
        replica = self.replica_of(request.rank)
        return replica if self._ranks_of(replica) <= ranks else None

    def replicas_at(self, step: int) -> list[int]:
        """The replicas every rank of which this coordinator committed at `step`: the members
        whose sidecar died, which the next world's coordinator names in its `status` answer
        (messages.Status.stood_in) so that the operator can say so."""
        ranks = self.committed.get(step, set())
        found = {self.replica_of(r) for r in ranks}
        return sorted(r for r in found if self._ranks_of(r) <= ranks)

    def _ranks_of(self, replica: int) -> set[int]:
        per_replica = max(1, self.world_size // self.replicas)
        return set(range(replica * per_replica, (replica + 1) * per_replica))
