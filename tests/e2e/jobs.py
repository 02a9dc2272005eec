"""Helpers for driving one StreamingJob through the cluster and judging its run."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.support import tables
from tests.support import exactness
from tests.e2e.cluster import NS, Cluster, log, max_step, wait_for


@functools.lru_cache(maxsize=None)
def _rank_batches(uri: str, epochs: int, world: int, rank: int) -> list[list[int]]:
    return tables.reference_batches(uri, {"epochs": epochs}, world, rank)


@functools.lru_cache(maxsize=None)
def reference_steps(uri: str, epochs: int) -> list[set[int]]:
    """The unscaled run's global steps: lancedb's StreamingDataset in-process, world size 1."""
    return tables.reference_global_steps(uri, {"epochs": epochs})


def assert_exact(cluster: Cluster, name: str, epochs: int) -> exactness.Summary:
    """The exactness rule of tests/support/exactness.py against lancedb's StreamingDataset."""
    global_steps = reference_steps(cluster.table_uri, epochs)
    rank_batches: Callable[[int, int], list[list[int]]] = functools.partial(
        _rank_batches, cluster.table_uri, epochs)
    summary = exactness.check(cluster.log_dir(name), exactness.complete_checkpoints(cluster.store(name)),
                              global_steps, rank_batches)
    log(f"{name}: exact over {len(global_steps)} global steps: {summary}")
    return summary


def resume_step(log_dir: Path, world: int) -> int | None:
    """The step world `world` resumed at, as its first trainer logged it."""
    for path in sorted(log_dir.glob(f"w{world}-r*.jsonl")):
        lines = path.read_text().splitlines()
        if lines:
            return int(json.loads(lines[0])["resumeStep"])
    return None


def wait_steps(cluster: Cluster, name: str, world: int, steps: int, timeout: float = 120) -> int:
    """Wait until world `world` has trained `steps` steps past its resume step; the step reached."""
    log_dir = cluster.log_dir(name)

    def reached() -> int | None:
        start = resume_step(log_dir, world)
        top = max_step(log_dir, world)
        return top if start is not None and top >= start + steps - 1 else None
    top = wait_for(reached, timeout, f"world {world} of {name} to train {steps} steps")
    log(f"{name}: world {world} at step {top}")
    return int(top)


def wait_running(cluster: Cluster, name: str, world: int, timeout: float = 120) -> None:
    wait_for(lambda: (st := cluster.status(name)).get("worldEpoch") == world and st.get("phase") == "Running",
             timeout, f"world {world} of {name} running")


def wait_phase(cluster: Cluster, name: str, phase: str, timeout: float = 150) -> dict[str, Any]:
    st = wait_for(lambda: (s := cluster.status(name)).get("phase") == phase and s, timeout,
                  f"{name} to be {phase}")
    log(f"{name}: {phase}")
    return st


def records(log_dir: Path, world: int) -> Iterator[dict[str, Any]]:
    """Every line world `world`'s trainers logged (tests/e2e/trainer.py), rank by rank."""
    for path in sorted(log_dir.glob(f"w{world}-r*.jsonl")):
        for line in path.read_text().splitlines():
            yield json.loads(line)


def first_time(log_dir: Path, world: int, event: str, **fields: Any) -> float | None:
    """time.time() of the earliest `event` line of world `world` with these field values."""
    times = [r["t"] for r in records(log_dir, world)
             if r["event"] == event and all(r.get(k) == v for k, v in fields.items())]
    return min(times, default=None)


AGREED_WITHIN_S = 15.0
"""A drained world's agreed checkpoint comes this soon after the request at the latest. It takes
the operator's reaction, one round trip to the coordinator and prefetchBatches + 1 steps: about
1-2 s here. A world that reached the next only through checkpoint.timeoutSeconds fails this."""


@dataclasses.dataclass
class Rescale:
    """Seconds from a request (`kubectl scale`, a suspend, a SIGTERM) to the old world's agreed
    checkpoint and to the next world's first batch, from the trainers' own timestamps."""

    to_checkpoint: float
    to_first_batch: float


def rescale_latency(cluster: Cluster, name: str, world: int, requested_at: float,
                    what: str = "rescale") -> Rescale:
    """Wait for world `world + 1`'s first batch; how long after `requested_at` world `world`
    checkpointed at its agreed (drained) step and the next world trained."""
    log_dir = cluster.log_dir(name)
    first = wait_for(lambda: first_time(log_dir, world + 1, "batch"), 120, f"world {world + 1}'s first batch")
    agreed = first_time(log_dir, world, "checkpoint", drained=True)
    assert agreed is not None, f"world {world} of {name} never logged a drained checkpoint"
    r = Rescale(agreed - requested_at, first - requested_at)
    startup = [rec["startup"] for rec in records(log_dir, world + 1) if rec["event"] == "start"]
    # Kept ranks of an in-place change log their rejoin, new ones their imports: each phase's slowest.
    slowest = {k: max(s.get(k, 0.0) for s in startup) for k in sorted({k for s in startup for k in s})}
    log(f"{name}: {what} latency: request -> world {world}'s agreed checkpoint {r.to_checkpoint:.1f} s, "
        f"-> world {world + 1}'s first batch {r.to_first_batch:.1f} s (its trainers' slowest start, s: {slowest})")
    return r


def scale(cluster: Cluster, name: str, replicas: int, *, world: int, steps_in_world: int) -> float:
    """Once world `world` has trained `steps_in_world` steps, `kubectl scale`; wait for the next world.

    Returns the time.time() of the `kubectl scale`."""
    wait_steps(cluster, name, world, steps_in_world)
    log(f"{name}: kubectl scale --replicas={replicas}")
    at = time.time()
    cluster.kubectl("-n", NS, "scale", f"sj/{name}", f"--replicas={replicas}")
    wait_running(cluster, name, world + 1)
    log(f"{name}: world {world + 1} running with {replicas} replicas")
    return at


def finish(cluster: Cluster, name: str) -> None:
    """Delete a job and wait until none of its processes runs (the next job's world 0 binds
    the same rendezvous ports on the shared host network)."""
    cluster.kubectl("-n", NS, "delete", "sj", name, "--wait=false")
    wait_for(lambda: not any(k[1].startswith(f"{name}-") for k in cluster.kubelet.pids()), 60,
             f"the processes of {name} to be gone")


def event_reasons(cluster: Cluster, name: str) -> list[str]:
    return [e["reason"] for e in cluster.events(name)]


def assert_two_scales_ended_exact(cluster: Cluster, name: str, started: float) -> None:
    """After `kubectl scale` 3 -> 1 -> 2 asked from `started` on: both within a second, and the
    job ended exact, merged (one drain, the newest count) or queued (a 1-replica world drained
    again), never lost, never failed; then the job is removed."""
    assert time.time() - started < 1.0, "the two scales were not within a second (a loaded machine: run it again)"
    status = wait_phase(cluster, name, "Succeeded", timeout=200)
    summary = assert_exact(cluster, name, 1)
    sizes = [(w.size, w.ended) for w in summary.worlds]
    assert sizes in ([(3, exactness.DRAINED), (2, exactness.END)],
                     [(3, exactness.DRAINED), (1, exactness.DRAINED), (2, exactness.END)]), summary
    assert summary.replayed == 0 and status.get("restarts", 0) == 0, (summary, status)
    assert status["replicas"] == 2, status
    finish(cluster, name)
