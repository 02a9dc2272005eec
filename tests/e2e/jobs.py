"""Helpers for driving one StreamingJob through the cluster and judging its run."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.dataplane import harness as dataplane
from tests.e2e import exactness
from tests.e2e.cluster import NS, Cluster, log, max_step, wait_for


@functools.lru_cache(maxsize=None)
def _rank_batches(uri: str, epochs: int, world: int, rank: int) -> list[list[int]]:
    return dataplane.reference_batches(uri, {"epochs": epochs}, world, rank)


@functools.lru_cache(maxsize=None)
def reference_steps(uri: str, epochs: int) -> list[set[int]]:
    """The unscaled run's global steps: lancedb's StreamingDataset in-process, world size 1."""
    return dataplane.reference_global_steps(uri, {"epochs": epochs})


def assert_exact(cluster: Cluster, name: str, epochs: int) -> exactness.Summary:
    """The exactness rule of tests/e2e/exactness.py against lancedb's StreamingDataset."""
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


def scale(cluster: Cluster, name: str, replicas: int, *, world: int, steps_in_world: int) -> None:
    """Once world `world` has trained `steps_in_world` steps, `kubectl scale`; wait for the next world."""
    wait_steps(cluster, name, world, steps_in_world)
    log(f"{name}: kubectl scale --replicas={replicas}")
    cluster.kubectl("-n", NS, "scale", f"sj/{name}", f"--replicas={replicas}")
    wait_running(cluster, name, world + 1)
    log(f"{name}: world {world + 1} running with {replicas} replicas")


def event_reasons(cluster: Cluster, name: str) -> list[str]:
    return [e["reason"] for e in cluster.events(name)]
