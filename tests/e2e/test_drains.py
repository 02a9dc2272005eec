"""Drains other than a plain rescale: a suspend, a preemption (SIGTERM), a drain while a pod is Pending.

Each drains a world of real DDP trainers (tests/e2e/trainer.py) at one step the
sidecars agree on (docs/agreement.md): every rank checkpoints there and stops,
nothing is replayed, no restart is counted, and the next world resumes exactly
at that step (tests/support/exactness.py). Jobs: 2 replicas, numSplits 24,
globalBatchSize 48, one epoch (20 steps) of 0.5 s each: a drain asked at step 6 has 7 s
before the world would end on its own, room for the operator's reaction on a loaded machine.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e.cluster import NS, Cluster, StatusWatch, log, wait_for
from tests.support.exactness import DRAINED, END
from tests.e2e.jobs import (AGREED_WITHIN_S, assert_exact, event_reasons, finish, first_time, rescale_latency,
                            wait_phase, wait_running, wait_steps)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

TIMEOUT_S = 120
"""checkpoint.timeoutSeconds of these jobs: a world replaced this late did not agree, it timed out."""


def start(cluster: Cluster, name: str, **kw: object) -> None:
    spec = {"replicas": 2, "epochs": 1, "sleep_s": 0.5, "timeout_seconds": TIMEOUT_S, **kw}
    log(f"{name}: kubectl apply {spec}")
    cluster.apply(cluster.manifest(name, **spec))  # type: ignore[arg-type]


def suspend(cluster: Cluster, name: str, value: bool) -> None:
    log(f"{name}: spec.suspend = {value}")
    cluster.kubectl("-n", NS, "patch", "sj", name, "--type=merge", "-p", json.dumps({"spec": {"suspend": value}}))


def test_a_suspended_job_drains_at_one_step_and_resumes_exactly_there(cluster: Cluster) -> None:
    name = "suspend"
    start(cluster, name)
    wait_running(cluster, name, 0)
    wait_steps(cluster, name, 0, 6)
    at = time.time()
    suspend(cluster, name, True)
    status = wait_phase(cluster, name, "Suspended")
    assert status.get("replicas") == 0, status
    wait_for(lambda: not cluster.pods(name, include_deleting=True)
             and not any(k[1].startswith(f"{name}-") for k in cluster.kubelet.pids()),
             60, "the suspended job's pods and processes to be gone")
    agreed = first_time(cluster.log_dir(name), 0, "checkpoint", drained=True)
    assert agreed is not None, "world 0 was removed without a drained checkpoint"
    log(f"{name}: suspended; request -> agreed checkpoint {agreed - at:.1f} s")
    assert agreed - at < AGREED_WITHIN_S
    suspend(cluster, name, False)
    wait_running(cluster, name, 1)
    status = wait_phase(cluster, name, "Succeeded")

    summary = assert_exact(cluster, name, 1)
    assert [(w.size, w.ended) for w in summary.worlds] == [(2, DRAINED), (2, END)], summary
    assert summary.replayed == 0, summary
    assert 6 <= summary.worlds[1].resume_step < 20, summary
    assert status.get("restarts", 0) == 0, status
    assert "Suspended" in event_reasons(cluster, name)
    finish(cluster, name)


def test_sigterm_to_a_running_pod_drains_its_world_at_one_step_and_the_next_resumes_there(
        cluster: Cluster) -> None:
    """`kubectl delete pod` with a grace period, as a preemption or a node drain does, to replica 0:
    the pod whose sidecar coordinates the world and whose trainer hosts gloo's store."""
    name = "preempt"
    start(cluster, name)
    wait_running(cluster, name, 0)
    wait_steps(cluster, name, 0, 6)
    pod = f"{name}-w0-0"
    at = time.time()
    log(f"{name}: kubectl delete pod {pod} --grace-period=30")
    cluster.kubectl("-n", NS, "delete", "pod", pod, "--grace-period=30", "--wait=false")
    wait_running(cluster, name, 1)
    latency = rescale_latency(cluster, name, 0, at, "preemption")
    status = wait_phase(cluster, name, "Succeeded")

    summary = assert_exact(cluster, name, 1)
    assert [(w.size, w.ended) for w in summary.worlds] == [(2, DRAINED), (2, END)], summary
    assert summary.replayed == 0, summary
    assert status.get("restarts", 0) == 0, f"a preemption is no failure: {status}"
    assert latency.to_checkpoint < AGREED_WITHIN_S, "the world did not agree on its drain step promptly"
    assert latency.to_first_batch < TIMEOUT_S / 2, latency
    finish(cluster, name)


def test_a_drain_requested_while_a_pod_is_pending_waits_for_it_and_loses_nothing(cluster: Cluster) -> None:
    """Replica 1 is held Pending (the test kubelet's stand-in for a slow image pull) while the job is
    scaled 2 -> 1: the world cannot cut until every member has joined; once the pod starts, the world
    trains to the agreed step, drains, and the next world resumes there."""
    name = "pending-drain"
    held = f"{name}-w0-1"
    cluster.kubelet.hold(NS, held)
    try:
        with StatusWatch(cluster, name) as watch:
            start(cluster, name)

            def phases() -> dict[str, str]:
                return {p["metadata"]["name"]: p["status"].get("phase") for p in cluster.pods(name)}
            wait_for(lambda: phases() == {f"{name}-w0-0": "Running", held: "Pending"}, 60,
                     f"replica 0 running and {held} Pending")
            log(f"{name}: {phases()}; kubectl scale --replicas=1")
            cluster.kubectl("-n", NS, "scale", f"sj/{name}", "--replicas=1")
            wait_for(lambda: cluster.status(name).get("phase") == "Rescaling", 30, "the drain to be requested")
            time.sleep(3)
            assert phases()[held] == "Pending", phases()
            assert not first_time(cluster.log_dir(name), 0, "batch"), "a world trained without all its ranks"
            log(f"{name}: releasing {held}")
            released = time.time()
            cluster.kubelet.release(NS, held)
            wait_running(cluster, name, 1)
            latency = rescale_latency(cluster, name, 0, released, "drain of a world that was Pending")
            status = wait_phase(cluster, name, "Succeeded")
    finally:
        cluster.kubelet.release(NS, held)

    log(f"{name}: phases {watch.seen}")
    summary = assert_exact(cluster, name, 1)
    assert [(w.size, w.ended) for w in summary.worlds] == [(2, DRAINED), (1, END)], summary
    assert summary.replayed == 0, summary
    assert status.get("restarts", 0) == 0, status
    assert latency.to_first_batch < TIMEOUT_S / 2, latency
    finish(cluster, name)
