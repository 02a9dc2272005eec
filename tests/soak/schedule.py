"""The soak's events: a pure function of the seed, so a failing seed replays exactly.

Each event is one thing a cluster does to a running job (docs/agreement.md): a rescale (two
requests in quick succession included), a process killed (a trainer, a member's sidecar, the
coordinator's sidecar, an `inPlace` trainer container's agent), a preemption (SIGTERM), a
write to the table, an early stop, forged control messages. The generator follows the
replica count the job will have after each event, so every event is one the job can take:
only valid replica counts, only ranks and replicas that exist.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

SCALE, OVERLAP = "scale", "scale-overlap"
KILL_TRAINER, KILL_SIDECAR, KILL_COORDINATOR, KILL_AGENT = (
    "kill-trainer", "kill-sidecar", "kill-coordinator", "kill-agent")
SIGTERM, TABLE_WRITE, EARLY_STOP, FORGE = "sigterm", "table-write", "early-stop", "forge"
KILLS = (KILL_TRAINER, KILL_SIDECAR, KILL_COORDINATOR, KILL_AGENT)
"""Events that fail the world: `splitfeed local` exits 1 and the soak starts it again
(--resume latest), as the operator replaces a failed world."""
ENDS_RUN = (*KILLS, SIGTERM, EARLY_STOP)
"""Events after which the run ends and the next `splitfeed local` resumes the job."""
WEIGHTS = {SCALE: 3, OVERLAP: 1, KILL_TRAINER: 1, KILL_SIDECAR: 1, KILL_COORDINATOR: 1, KILL_AGENT: 1,
           SIGTERM: 1, TABLE_WRITE: 1, EARLY_STOP: 1, FORGE: 1}
RECREATE, IN_PLACE = "recreate", "inPlace"


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str
    replicas: int
    """The job's replica count once the event settled (a scale's target; others keep it)."""
    target: int = 0
    """The rank (kill-trainer, kill-agent, sigterm) or replica (kill-sidecar) it hits."""
    first: int = 0
    """scale-overlap: the count asked first, `delay_s` before `replicas` is asked."""
    delay_s: float = 0.0
    gap_steps: int = 0
    """Global steps the job trains after the event before it settled and the next one comes."""

    def __str__(self) -> str:
        what = {SCALE: f"-> {self.replicas}", OVERLAP: f"-> {self.first}, {self.delay_s:.1f} s later -> {self.replicas}",
                KILL_TRAINER: f"rank {self.target}", KILL_AGENT: f"rank {self.target}",
                SIGTERM: f"rank {self.target}", KILL_SIDECAR: f"replica {self.target}"}.get(self.kind, "")
        return f"{self.kind} {what}".strip() + f" (+{self.gap_steps} steps)"


@dataclasses.dataclass(frozen=True)
class Schedule:
    seed: int
    mode: str
    """spec.rescale of every run: recreate or inPlace."""
    start: int
    """Replicas of the first world."""
    events: tuple[Event, ...]

    def describe(self) -> str:
        lines = [f"seed {self.seed}: --rescale {self.mode}, {self.start} replicas, {len(self.events)} events"]
        lines += [f"  {k:2d}. {e}" for k, e in enumerate(self.events)]
        return "\n".join(lines)


def generate(seed: int, events: int, allowed: Sequence[int], mode: str | None = None) -> Schedule:
    """`events` events for seed `seed`, on replica counts `allowed` (each one valid for the job)."""
    rng = random.Random(seed)
    counts = sorted(set(allowed))
    if len(counts) < 3:
        raise ValueError(f"the soak needs at least 3 valid replica counts to choose from, got {counts}")
    chosen = mode or rng.choice([RECREATE, IN_PLACE])
    replicas = start = rng.choice(counts)
    made: list[Event] = []
    kinds = [k for k in WEIGHTS if chosen == IN_PLACE or k != KILL_AGENT]
    for _ in range(events):
        kind = rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0]
        event = _event(rng, kind, replicas, counts)
        made.append(event)
        replicas = event.replicas
    return Schedule(seed, chosen, start, tuple(made))


def _event(rng: random.Random, kind: str, replicas: int, counts: list[int]) -> Event:
    """One event of `kind` on a job of `replicas` replicas (a kill-sidecar of a one-replica job
    hits its only sidecar, the coordinator's)."""
    gap = rng.randint(0, 3)
    if kind == SCALE:
        return Event(kind, rng.choice([c for c in counts if c != replicas]), gap_steps=gap)
    if kind == OVERLAP:
        first = rng.choice([c for c in counts if c != replicas])
        final = rng.choice([c for c in counts if c not in (replicas, first)])
        return Event(kind, final, first=first, delay_s=round(rng.uniform(0.0, 3.0), 1), gap_steps=gap)
    if kind == KILL_SIDECAR and replicas == 1:
        kind = KILL_COORDINATOR
    if kind in (KILL_TRAINER, KILL_AGENT, SIGTERM):
        return Event(kind, replicas, target=rng.randrange(replicas), gap_steps=gap)
    if kind == KILL_SIDECAR:
        return Event(kind, replicas, target=rng.randrange(1, replicas), gap_steps=gap)
    return Event(kind, replicas, gap_steps=gap)
