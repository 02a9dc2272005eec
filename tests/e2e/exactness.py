"""Whether a run's trainers, across every world, trained on exactly the reference steps.

The rule (what "none missing, none repeated" means when worlds are replaced):

  A world resumes from the newest complete data checkpoint; every rank logs
  that step as `resumeStep` when it starts. World k *commits* the steps from
  its own resume step up to the next world's resume step (exclusive); the
  last world commits up to the end. Batches a world received at or after the
  next world's resume step came after its last complete checkpoint: the next
  world receives them again, and they are not counted (they are reported as
  `replayed`). So:
  1. the first world resumes at step 0; resume steps never go back; every
     later resume step is a step with a complete checkpoint in the store;
  2. inside its committed range a world has, for every step and every rank,
     exactly one batch, and its ids are rank r's batch of that step in
     lancedb's StreamingDataset order for that world size (reference_batches);
  3. the committed ranges tile 0..total-1, and the union of the ranks' ids of
     each step equals the unscaled reference (reference_global_steps).
  A gap (a step nobody committed) breaks 2; a repeat inside a world, or a
  world that resumes before the data its predecessor committed, breaks 2 or 1.

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


@dataclasses.dataclass
class World:
    epoch: int
    size: int
    resume_step: int
    batches: dict[int, dict[int, list[list[int]]]]  # rank -> step -> every ids list logged for it
    events: list[dict[str, Any]]


@dataclasses.dataclass
class Summary:
    worlds: list[tuple[int, int, int, int]]
    """(world epoch, world size, resume step, committed steps)"""
    replayed: int
    checkpoint_failures: int

    def __str__(self) -> str:
        return (f"worlds (epoch, size, resume step, steps) {self.worlds}; {self.replayed} batches "
                f"received past the last complete checkpoint and replayed; "
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
    """Steps under <checkpoint uri>/<namespace>/<job> with a file from every rank of one world size."""
    found: set[int] = set()
    for step_dir in store.glob("step-*"):
        files = [re.match(r"^rank-(\d{5})-of-(\d{5})\.json$", p.name) for p in step_dir.iterdir()]
        by_world: dict[int, set[int]] = {}
        for m in filter(None, files):
            by_world.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
        if any(ranks == set(range(w)) for w, ranks in by_world.items()):
            found.add(int(step_dir.name.split("-")[1]))
    return found


def check(log_dir: Path, checkpoints: set[int], reference_global: list[set[int]],
          reference_rank: Callable[[int, int], list[list[int]]]) -> Summary:
    """AssertionError unless the logged run trained exactly on the reference (see the module doc)."""
    worlds = read_worlds(log_dir)
    total = len(reference_global)
    assert worlds, f"no trainer logged anything under {log_dir}"
    assert worlds[0].resume_step == 0, f"the first world resumed at {worlds[0].resume_step}, not 0"
    committed: dict[int, set[int]] = {}
    rows: list[tuple[int, int, int, int]] = []
    replayed = 0
    for k, w in enumerate(worlds):
        end = worlds[k + 1].resume_step if k + 1 < len(worlds) else total
        assert end >= w.resume_step, (
            f"world {worlds[k + 1].epoch} resumed at step {end}, before world {w.epoch}'s own "
            f"resume step {w.resume_step}: steps would repeat")
        if k + 1 < len(worlds) and end > 0:
            assert end in checkpoints, (
                f"world {worlds[k + 1].epoch} resumed at step {end}, which has no complete checkpoint "
                f"(complete: {sorted(checkpoints)})")
        for r in range(w.size):
            expected = reference_rank(w.size, r)
            got = w.batches.get(r, {})
            for s in range(w.resume_step, end):
                logged = got.get(s, [])
                assert len(logged) == 1, (
                    f"world {w.epoch} (size {w.size}) rank {r} step {s}: logged {len(logged)} times "
                    f"(it commits steps {w.resume_step}..{end - 1}; it logged {sorted(got)})")
                assert logged[0] == expected[s], (
                    f"world {w.epoch} rank {r} step {s}: ids {logged[0]} != reference {expected[s]}")
                committed.setdefault(s, set()).update(logged[0])
            replayed += sum(len(v) for s, v in got.items() if s >= end)
            early = [s for s in got if s < w.resume_step]
            assert not early, f"world {w.epoch} rank {r} got steps {early} before its resume step"
        rows.append((w.epoch, w.size, w.resume_step, end - w.resume_step))
    assert sorted(committed) == list(range(total)), (
        f"committed steps {sorted(committed)} != 0..{total - 1}")
    for s in range(total):
        assert committed[s] == reference_global[s], f"step {s}: ids differ from the unscaled reference"
    failures = sum(e["event"] == "checkpoint-failed" for w in worlds for e in w.events)
    return Summary(rows, replayed, failures)
