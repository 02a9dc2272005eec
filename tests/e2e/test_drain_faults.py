"""A sidecar SIGKILLed during a drain (issue 21 item 2), with `restartPolicy: OnFailure` (the
kubelet restarts it) or `Never` (it stays dead), on the end-to-end cluster with real DDP trainers.

Each test scales 2 -> 1 and kills the sidecar once its own trainer saw the checkpoint request:
the drain step S is committed then, and the world cannot simply be asked again. A kill that
landed after that trainer already checkpointed missed what the test is about, and the test
says so (run it again); it never passes on a timing that tested nothing. What must hold:

- restartable, coordinator or member: the restarted sidecar rejoins, learns the committed step,
  and the world drains exactly at S: nothing redone (docs/agreement.md, "A coordinator
  restarted during a drain");
- the coordinator dead for good: its own trainer cannot checkpoint S (no coordinator to stand
  in for it), so the next world resumes from the newest complete checkpoint; the steps redone
  are bounded by it, and announced (event, status.lastRescale.stepsRedone);
- a member dead for good: tests/e2e/test_faults.py (its trainer checkpoints S through the
  coordinator).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.cluster import NS, Cluster, log, wait_for
from tests.e2e.jobs import (assert_exact, assert_two_scales_ended_exact, event_reasons, finish, wait_phase,
                            wait_running, wait_steps)
from tests.support.exactness import DRAINED, END

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def _records(log_dir: Path, world: int, rank: int) -> list[dict]:
    path = log_dir / f"w{world}-r{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def scale_and_kill_once_committed(cluster: Cluster, name: str, replica: int, **kw: object) -> int:
    """Start a 2-replica job, scale it to 1, SIGKILL replica `replica`'s sidecar once its
    trainer saw the checkpoint request; the committed drain step S."""
    spec = {"replicas": 2, "epochs": 1, "sleep_s": 0.5, "timeout_seconds": 120, **kw}
    log(f"{name}: kubectl apply {spec}")
    cluster.apply(cluster.manifest(name, **spec))  # type: ignore[arg-type]
    wait_running(cluster, name, 0)
    wait_steps(cluster, name, 0, 4)
    log(f"{name}: kubectl scale --replicas=1")
    cluster.kubectl("-n", NS, "scale", f"sj/{name}", "--replicas=1")
    log_dir = cluster.log_dir(name)
    seen = wait_for(lambda: next((r for r in _records(log_dir, 0, replica)
                                  if r["event"] == "batch" and r.get("requested")), None),
                    60, f"rank {replica} to see the drain's checkpoint request")
    pod = f"{name}-w0-{replica}"
    pid = cluster.kubelet.pid(NS, pod, "splitfeed-sidecar")
    assert pid, f"no sidecar process in {pod}"
    os.kill(pid, signal.SIGKILL)
    log(f"SIGKILL {pod}/splitfeed-sidecar (pid {pid})")
    step = int(seen["step"]) + 1
    late = [r for r in _records(log_dir, 0, replica) if r["event"] == "checkpoint" and r["step"] >= step]
    assert not late, (f"rank {replica} checkpointed drain step {step} through its sidecar before the kill "
                      f"landed ({late}): the timing missed what this test is about (run it again)")
    return step


def restarts_of(cluster: Cluster, pod: str) -> int:
    p = cluster.get(f"/api/v1/namespaces/{NS}/pods/{pod}")
    return next((c.get("restartCount", 0) for c in p["status"].get("containerStatuses") or []
                 if c["name"] == "splitfeed-sidecar"), 0)


@pytest.mark.parametrize("replica", [0, 1], ids=["coordinator", "member"])
def test_a_sidecar_restarted_during_a_drain_rejoins_and_the_world_drains_at_the_committed_step(
        cluster: Cluster, replica: int) -> None:
    name = f"restart-during-drain-{replica}"
    step = scale_and_kill_once_committed(cluster, name, replica, restart_policy="OnFailure")
    wait_for(lambda: restarts_of(cluster, f"{name}-w0-{replica}") >= 1, 30, "the kubelet to restart the sidecar")
    status = wait_phase(cluster, name, "Succeeded")
    summary = assert_exact(cluster, name, 1)
    assert [(w.size, w.ended, w.agreed_step) for w in summary.worlds] == [(2, DRAINED, step), (1, END, None)], summary
    assert summary.worlds[1].resume_step == step and summary.replayed == 0, summary
    assert (status.get("lastRescale") or {}).get("stepsRedone") == 0, status.get("lastRescale")
    # The drain's own work, not checkpoint.timeoutSeconds running out (a restarted sidecar whose
    # trainer had already drained once held its pod, and the world, until then).
    assert "CheckpointTimeout" not in event_reasons(cluster, name), event_reasons(cluster, name)
    assert "ResumeStepChosen" in event_reasons(cluster, name), event_reasons(cluster, name)
    finish(cluster, name)


def test_the_coordinator_dead_for_good_during_a_drain_costs_at_most_the_steps_since_the_last_checkpoint_announced(
        cluster: Cluster) -> None:
    """Replica 0's sidecar is the world's coordinator: dead for good (restartPolicy Never), no
    one can checkpoint its trainer's drain step. The world is replaced from the newest complete
    checkpoint (every 2 steps here): exact, at most the steps since it redone, and announced
    (a Warning event naming the pod, status.lastRescale.stepsRedone), never silent."""
    name = "coordinator-dead-in-drain"
    step = scale_and_kill_once_committed(cluster, name, 0, checkpoint_every=2, timeout_seconds=30)
    status = wait_phase(cluster, name, "Succeeded")
    summary = assert_exact(cluster, name, 1)
    assert [w.size for w in summary.worlds] == [2, 1], summary
    resumed = summary.worlds[1].resume_step
    assert step - 2 <= resumed <= step, (step, summary)  # the newest complete checkpoint
    redone = (status.get("lastRescale") or {}).get("stepsRedone")
    assert redone == step - resumed, (redone, step, resumed, status.get("lastRescale"))
    warnings = [e for e in cluster.events(name) if e["type"] == "Warning"]
    assert any(f"{name}-w0-0" in e["message"] for e in warnings), warnings
    finish(cluster, name)


def test_two_scales_within_a_second_are_merged_or_queued_and_lose_nothing(cluster: Cluster) -> None:
    """Issue 21 item 3, recreate mode (tests/e2e/test_faults_in_place.py has it in place): 3 -> 1
    and at once -> 2; the job ends with 2 replicas, no world failed, nothing trained twice."""
    name = "scale-twice"
    spec = {"replicas": 3, "epochs": 1, "sleep_s": 0.5, "timeout_seconds": 120}
    cluster.apply(cluster.manifest(name, **spec))  # type: ignore[arg-type]
    wait_running(cluster, name, 0)
    wait_steps(cluster, name, 0, 4)
    first = time.time()
    for replicas in (1, 2):
        log(f"{name}: kubectl scale --replicas={replicas}")
        cluster.kubectl("-n", NS, "scale", f"sj/{name}", f"--replicas={replicas}")
    assert_two_scales_ended_exact(cluster, name, first)
