"""Whether a run's trainers, across every world, trained on exactly the reference steps.

The rule (what "none missing, none repeated, nothing replayed" means when worlds
are replaced). Every rank logs `resumeStep` when it starts (tests/e2e/trainer.py).
A world ends in one of three ways:

- *drained*: every rank logged a checkpoint with `drained: true`, all at one step
  S (the step the sidecars agreed on, docs/agreement.md), and exited. It commits
  its resume step .. S - 1; no rank may have received a batch of step S or later
  (that would be replayed: the agreement exists so that nothing is), and the next
  world must resume exactly at S.
- *end*: every rank ran to the end of the data (only the last world).
- *failed*: anything else (a rank killed, a pod force-deleted). It commits up to
  the next world's resume step (exclusive), which must be a complete checkpoint;
  its batches at or past that step came after its last complete checkpoint and
  are received again by the next world: they are counted as `replayed`, the only
  replay there may be.

Over all worlds:
  1. the first world resumes at step 0; resume steps never go back; every later
     resume step is a complete checkpoint in the store (each rank's record and
     commit marker), and the resumed model is the one saved at that step;
  2. inside its committed range a world has, for every step and every rank,
     exactly one batch, and its ids are rank r's batch of that step in lancedb's
     StreamingDataset order for that world size (reference_batches);
  3. the committed ranges tile 0..total-1, and the union of the ranks' ids of
     each step equals the unscaled reference (reference_global_steps);
  4. within a world every rank saw `checkpoint_requested` on the same steps and
     attempted checkpoints at the same steps, and ranks that checkpointed the
     same step hold the same model (DDP keeps them identical).
  A gap (a step nobody committed) breaks 2; a repeat inside a world, or a world
  that resumes before the data its predecessor committed, breaks 2 or 1.

Pure: trainer logs and checkpoint listings in, a Summary or an AssertionError out.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

_LOG = re.compile(r"^w(\d+)-r(\d+)\.jsonl$")
DRAINED, END, FAILED = "drained", "end", "failed"


@dataclasses.dataclass
class World:
    epoch: int
    size: int
    resume_step: int
    batches: dict[int, dict[int, list[list[int]]]]  # rank -> step -> every ids list logged for it
    events: list[dict[str, Any]]

    def of(self, rank: int, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["rank"] == rank and e["event"] == event]

    def ended(self) -> tuple[str, int | None]:
        """(DRAINED, S) when every rank drained at one step S; (END, None); else (FAILED, None)."""
        exits = [[e["reason"] for e in self.of(r, "exit")] for r in range(self.size)]
        if all(x == ["end"] for x in exits):
            return END, None
        if not all(x == ["drained"] for x in exits):
            return FAILED, None
        steps = {r: [e["step"] for e in self.of(r, "checkpoint") if e["drained"]] for r in range(self.size)}
        assert all(len(s) == 1 for s in steps.values()), (
            f"world {self.epoch}: each drained rank must log one drained checkpoint: {steps}")
        agreed = {s[0] for s in steps.values()}
        assert len(agreed) == 1, (
            f"world {self.epoch} drained, but its ranks checkpointed at different steps {steps}: "
            "the sidecars did not agree on one step")
        return DRAINED, agreed.pop()


@dataclasses.dataclass
class WorldRun:
    epoch: int
    size: int
    resume_step: int
    steps: int
    """Steps the world committed."""
    ended: str
    """DRAINED, END or FAILED."""
    agreed_step: int | None
    """The drain step S of a drained world."""

    def __repr__(self) -> str:
        how = f"drained at {self.agreed_step}" if self.ended == DRAINED else self.ended
        return f"(w{self.epoch} x{self.size} from {self.resume_step}, {self.steps} steps, {how})"


@dataclasses.dataclass
class Summary:
    worlds: list[WorldRun]
    replayed: int
    """Batches failed worlds received past their last complete checkpoint (drained worlds: none)."""
    checkpoint_failures: int

    def __str__(self) -> str:
        return (f"worlds {self.worlds}; {self.replayed} batches of failed worlds replayed; "
                f"{self.checkpoint_failures} failed checkpoint attempts")


def read_worlds(log_dir: Path) -> list[World]:
    """Every world that started a trainer, by world epoch."""
    worlds: dict[int, World] = {}
    for path in sorted(log_dir.glob("w*-r*.jsonl")):
        m = _LOG.match(path.name)
        if not m:
            continue
        epoch, rank = int(m.group(1)), int(m.group(2))
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["event"] == "start":
                w = worlds.setdefault(epoch, World(epoch, rec["worldSize"], rec["resumeStep"], {}, []))
                if (w.size, w.resume_step) != (rec["worldSize"], rec["resumeStep"]):
                    raise AssertionError(f"world {epoch}: rank {rank} started with {rec}, others with "
                                         f"worldSize {w.size}, resumeStep {w.resume_step}")
            elif epoch not in worlds:
                raise AssertionError(f"{path.name}: {rec['event']} before start")
            w = worlds[epoch]
            if rec["event"] == "batch":
                w.batches.setdefault(rank, {}).setdefault(rec["step"], []).append(rec["ids"])
            w.events.append({**rec, "rank": rank})
    return [worlds[e] for e in sorted(worlds)]


def complete_checkpoints(store: Path) -> set[int]:
    """Steps under the job's checkpoint directory where every rank of one world has its record
    (`[w<epoch>-]rank-R-of-W.json`) and its commit marker (the same name, `.commit`). The step
    directories may sit a level deeper (the job's UID), so they are searched for."""
    found: set[int] = set()
    for step_dir in store.rglob("step-*"):
        m = re.match(r"^step-(\d{12})$", step_dir.name)
        if not m or not step_dir.is_dir():
            continue
        names = {p.name for p in step_dir.iterdir()}
        by_world: dict[tuple[str, int], set[int]] = {}
        for name in names:
            f = re.match(r"^((?:w\d+-)?)rank-(\d{5})-of-(\d{5})\.json$", name)
            if f and name[:-len(".json")] + ".commit" in names:
                by_world.setdefault((f.group(1), int(f.group(3))), set()).add(int(f.group(2)))
        if any(ranks == set(range(w)) for (_, w), ranks in by_world.items()):
            found.add(int(m.group(1)))
    return found


def _check_lockstep(w: World, failed: bool) -> None:
    """Rule 4: the ranks agreed on every checkpoint request and attempt, and share one model.

    In a failed world only the steps every rank got past are compared."""
    requested: dict[int, dict[int, bool]] = {}
    for e in w.events:
        if e["event"] == "batch":
            requested.setdefault(e["step"], {})[e["rank"]] = e["requested"]
    for step, by_rank in sorted(requested.items()):
        if len(by_rank) == w.size:
            assert len(set(by_rank.values())) == 1, (
                f"world {w.epoch} step {step}: checkpoint_requested differs between ranks {by_rank}")
    attempts = {r: sorted({e["step"] for e in w.events if e["rank"] == r
                           and e["event"] in ("checkpoint", "checkpoint-failed")}) for r in range(w.size)}
    if failed:
        last = min(max(w.batches.get(r, {}), default=-1) for r in range(w.size))
        attempts = {r: [s for s in a if s <= last] for r, a in attempts.items()}  # every rank got there
    assert len({tuple(a) for a in attempts.values()}) == 1, (
        f"world {w.epoch}: ranks attempted checkpoints at different steps {attempts}")
    models: dict[int, set[str]] = {}
    for e in w.events:
        if e["event"] == "checkpoint":
            models.setdefault(e["step"], set()).add(e["model"])
    differ = {s: m for s, m in models.items() if len(m) > 1}
    assert not differ, f"world {w.epoch}: ranks hold different models at checkpoint steps {differ}"


def check(log_dir: Path, checkpoints: set[int], reference_global: list[set[int]],
          reference_rank: Callable[[int, int], Any], absent: frozenset[int] = frozenset()) -> Summary:
    """AssertionError unless the logged run trained exactly on the reference (see the module doc).

    `absent`: global steps that do not exist (onTransformError=skip ends epochs early); no
    rank may receive them, and they are not expected among the committed steps."""
    worlds = read_worlds(log_dir)
    total = len(reference_global)
    assert worlds, f"no trainer logged anything under {log_dir}"
    missing = [e for w in worlds for e in w.events if e["event"] == "model-missing"]
    assert not missing, f"a world resumed at a step whose model was never saved: {missing}"
    assert worlds[0].resume_step == 0, f"the first world resumed at {worlds[0].resume_step}, not 0"
    committed: dict[int, set[int]] = {}
    rows: list[WorldRun] = []
    saved: dict[int, str] = {}  # step -> the model digest last logged at that checkpoint
    replayed = 0
    for k, w in enumerate(worlds):
        ended, agreed = w.ended()
        nxt = worlds[k + 1] if k + 1 < len(worlds) else None
        _check_lockstep(w, ended == FAILED)
        if w.resume_step > 0:
            loaded = {e["model"] for e in w.events if e["event"] == "start"}
            assert len(loaded) == 1, f"world {w.epoch}: ranks loaded different models {loaded}"
            if w.resume_step in saved:
                assert loaded == {saved[w.resume_step]}, (
                    f"world {w.epoch} resumed at step {w.resume_step} with model {loaded}, but the model "
                    f"checkpointed there was {saved[w.resume_step]}")
        if ended == DRAINED:
            assert agreed is not None
            end = agreed
            if nxt is not None:
                assert nxt.resume_step == agreed, (
                    f"world {w.epoch} drained at step {agreed} on every rank, but world {nxt.epoch} "
                    f"resumed at {nxt.resume_step}, not there")
        elif ended == END:
            assert nxt is None, f"world {w.epoch} ran to the end, yet world {nxt.epoch} followed"
            end = total
        else:
            assert nxt is not None, (
                f"world {w.epoch}, the last, did not run to the end: exits "
                f"{[[e['reason'] for e in w.of(r, 'exit')] for r in range(w.size)]}")
            end = nxt.resume_step
        assert end >= w.resume_step, (
            f"world {w.epoch} ends at step {end}, before its own resume step {w.resume_step}: steps would repeat")
        if nxt is not None and end > 0:
            assert end in checkpoints, (
                f"world {nxt.epoch} resumed at step {end}, which has no complete checkpoint "
                f"(complete: {sorted(checkpoints)})")
        for r in range(w.size):
            expected = reference_rank(w.size, r)
            got = w.batches.get(r, {})
            for s in range(w.resume_step, end):
                logged = got.get(s, [])
                if s in absent:
                    assert not logged, f"world {w.epoch} rank {r} received step {s}, which does not exist"
                    continue
                assert len(logged) == 1, (
                    f"world {w.epoch} (size {w.size}) rank {r} step {s}: logged {len(logged)} times "
                    f"(it commits steps {w.resume_step}..{end - 1}; it logged {sorted(got)})")
                assert logged[0] == expected[s], (
                    f"world {w.epoch} rank {r} step {s}: ids {logged[0]} != reference {expected[s]}")
                committed.setdefault(s, set()).update(logged[0])
            past = sorted(s for s in got if s >= end)
            if ended == DRAINED:
                assert not past, (
                    f"world {w.epoch} drained at step {end}, yet rank {r} received steps {past}: "
                    "they are replayed by the next world")
            replayed += sum(len(got[s]) for s in past)
            early = [s for s in got if s < w.resume_step]
            assert not early, f"world {w.epoch} rank {r} got steps {early} before its resume step"
        for e in w.events:
            if e["event"] == "checkpoint":
                saved[e["step"]] = e["model"]
        rows.append(WorldRun(w.epoch, w.size, w.resume_step, end - w.resume_step, ended, agreed))
    assert sorted(committed) == [s for s in range(total) if s not in absent], (
        f"committed steps {sorted(committed)} != 0..{total - 1} but {sorted(absent)}")
    for s in sorted(committed):
        assert committed[s] == reference_global[s], f"step {s}: ids differ from the unscaled reference"
    failures = sum(e["event"] == "checkpoint-failed" for w in worlds for e in w.events)
    return Summary(rows, replayed, failures)
