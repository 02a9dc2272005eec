"""What the job's trainers did, read as they write it: their logs (tests/e2e/trainer.py).

Pure bookkeeping over JSON lines; `Progress.read` is the one edge that touches files. The
soak asks it whether an event settled: a batch trained after it (in a new world, of the
size asked, for events that change the world) or the job's end.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

_LOG = re.compile(r"^w(\d+)-r(\d+)\.jsonl$")


@dataclasses.dataclass
class WorldSeen:
    size: int = 0
    pids: dict[int, int] = dataclasses.field(default_factory=dict)
    """rank -> the trainer's pid (its start record)."""
    batches: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    """(time.time() it was logged, global step), every rank's."""
    exits: dict[int, str] = dataclasses.field(default_factory=dict)
    last_exit: float = 0.0
    """time.time() of the newest exit record."""

    def ended(self) -> bool:
        """Every rank ran to the end of the data."""
        return self.size > 0 and len(self.exits) == self.size and set(self.exits.values()) == {"end"}


class Progress:
    """Every world's trainers as their logs say, read incrementally."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.worlds: dict[int, WorldSeen] = {}
        self._offsets: dict[Path, int] = {}

    def read(self) -> None:
        for path in sorted(self.log_dir.glob("w*-r*.jsonl")):
            m = _LOG.match(path.name)
            if not m:
                continue
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            complete = data[:data.rfind(b"\n") + 1]  # a line half written waits for the next read
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                self.add(int(m.group(1)), int(m.group(2)), json.loads(line))

    def add(self, epoch: int, rank: int, record: dict[str, Any]) -> None:
        world = self.worlds.setdefault(epoch, WorldSeen())
        if record["event"] == "start":
            world.size, world.pids[rank] = int(record["worldSize"]), int(record["pid"])
        elif record["event"] == "batch":
            world.batches.append((float(record["t"]), int(record["step"])))
        elif record["event"] == "exit":
            world.exits[rank] = str(record["reason"])
            world.last_exit = max(world.last_exit, float(record["t"]))

    def newest(self) -> int:
        """The newest world that started a trainer (-1 before any)."""
        return max((e for e, w in self.worlds.items() if w.size), default=-1)

    def step(self) -> int:
        """The highest global step any rank logged (-1 before any)."""
        return max((s for w in self.worlds.values() for _, s in w.batches), default=-1)

    def ended(self) -> bool:
        return any(w.ended() for w in self.worlds.values())

    def settled(self, since: float, after_world: int | None, size: int | None) -> float | None:
        """When the first batch logged after `since` was, in a world newer than `after_world`
        (None: any world) of `size` ranks (None: any size); or the job's end; None before."""
        times = [t for e, w in self.worlds.items() if (after_world is None or e > after_world)
                 and (size is None or w.size == size) for t, _ in w.batches if t >= since]
        if times:
            return min(times)
        return max((w.last_exit for w in self.worlds.values() if w.ended()), default=None)

    def steps_since(self, since: float) -> int:
        """Distinct global steps logged after `since`."""
        return len({s for w in self.worlds.values() for t, s in w.batches if t >= since})
