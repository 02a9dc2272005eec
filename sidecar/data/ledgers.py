"""Each local rank's split positions after each step it read, for a job that drops rows
(onTransformError skip/warn): under skip a step no longer fixes the positions
(docs/preprocessing.md), so the sidecar's checkpoints, and a reader that restarts mid-epoch,
take them from here.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

from splitfeed.trainer_client.contract import errors, specs

from . import positions, skipping


class Ledger(dict[int, skipping.Passed]):
    """global step -> what it passed (split positions after it), for one rank.

    Kept: the newest `keep` steps published, and every step read past the newest
    published (the read-ahead). A step read but never published (past an epoch's end
    the world agreed on) is dropped once a later step is published: bounding by steps
    *read* would let a long run of such steps evict the one a checkpoint needs.
    """

    def __init__(self, keep: int) -> None:
        super().__init__()
        self.keep = keep
        self._published: collections.deque[int] = collections.deque(maxlen=keep)

    def published(self, step: int) -> None:
        self._published.append(step)
        if len(self) > 2 * self.keep:  # amortised: one pass per `keep` steps
            kept = set(self._published)
            for old in [k for k in self if k < step and k not in kept]:
                del self[old]


class SkipLedgers:
    """Each local rank's split positions after each step it read (skip jobs), for its
    checkpoints and for a reader that restarts mid-epoch: under skip a step no longer
    fixes the positions (docs/preprocessing.md). Other jobs: positions from the step."""

    KEEP = 4096
    """Published steps remembered per rank: a checkpoint is of a step the trainer just took."""
    ANCHORS = 4
    """Checkpoint states remembered per rank: a reader rewound past the ledger starts at one."""

    def __init__(self, data: specs.DataSpec | None, steps_per_epoch: int, start_step: int,
                 resume_state: dict[str, Any] | None) -> None:
        self.data = data
        self.spe = max(1, steps_per_epoch)
        self.start_step = start_step
        self.merged = resume_state
        self._ledgers: dict[int, Ledger] = {}
        self._anchors: dict[int, dict[int, dict[str, Any]]] = {}

    def ledger(self, rank: int) -> Ledger | None:
        if self.data is None or not self.data.drops_rows:
            return None
        return self._ledgers.setdefault(rank, Ledger(self.KEEP))

    def state(self, rank: int, step: int) -> dict[str, Any]:
        """The rank's checkpoint state once `step` steps are taken."""
        assert self.data is not None
        position = positions.position_of(step, self.spe)
        if not self.data.drops_rows or position.step == 0:
            return positions.state_dict(self.data, position)
        known = self._known(rank, step)
        if known is None:
            raise errors.SidecarFailed(f"rank {rank} holds no split positions for global step {step - 1}")
        anchors = self._anchors.setdefault(rank, {})
        anchors[step] = known
        while len(anchors) > self.ANCHORS:
            del anchors[min(anchors)]
        return dict(known)

    def _known(self, rank: int, step: int) -> dict[str, Any] | None:
        """The state at `step` if this sidecar knows it without reading: the ledger, a
        checkpoint it wrote, or the world's resume state."""
        assert self.data is not None
        ledger = self._ledgers.get(rank)
        passed = None if ledger is None else ledger.get(step - 1)
        if passed is not None:
            return positions.state_after(self.data, positions.position_of(step, self.spe), passed.at)
        anchor = self._anchors.get(rank, {}).get(step)
        if anchor is not None:
            return dict(anchor)
        if step == self.start_step and self.merged is not None:
            return dict(self.merged)  # nothing read yet: the world's resume state
        return None

    def published(self, rank: int, step: int) -> None:
        """Count the rows a published step dropped (the report's skippedRows)."""
        ledger = self._ledgers.get(rank)
        passed = None if ledger is None else ledger.get(step)
        if passed is not None:
            skipping.SKIPPED_ROWS[0] += passed.skipped
        if ledger is not None:
            ledger.published(step)

    def resume_from(self, rank: int, step: int) -> tuple[int, dict[str, Any] | None]:
        """Where a reader that must yield from `step` starts, and with what state (skip
        jobs, mid-epoch). A step the ledger has forgotten (a trainer restarted in place and
        rewound to the world's checkpoint, a sidecar restarted under a running trainer)
        starts at the newest state it knows at or before it in the same epoch — a checkpoint
        it wrote, the world's resume state, or else the epoch's start, which needs none —
        and the steps between are read again and passed over (iter_from)."""
        if self.data is None or not self.data.drops_rows or step % self.spe == 0:
            return step, None
        known = self._known(rank, step)
        if known is not None:
            return step, known
        epoch_start = step - step % self.spe
        anchors: dict[int, dict[str, Any] | None] = {epoch_start: None}
        if self.merged is not None:
            anchors[self.start_step] = self.merged
        anchors.update(self._anchors.get(rank, {}))
        start = max(a for a in anchors if epoch_start <= a <= step)
        state = anchors[start]
        return start, None if state is None else dict(state)


def iter_from(batches: Iterator[tuple[int, Any]], first_step: int) -> Iterator[tuple[int, Any]]:
    """The steps of `batches` from `first_step` on (a reader started earlier), closing it."""
    try:
        for step, batch in batches:
            if step >= first_step:
                yield step, batch
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
