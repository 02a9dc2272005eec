"""Overlapping requests (issue 21, item 3): a second request while a drain is under way is
merged or queued, never lost or doubled, and a deleted job's checkpoint stays resumable.

Jobs: 2 replicas, numSplits 24, globalBatchSize 48, one epoch (20 steps) of 0.5 s each, real
DDP trainers (tests/e2e/trainer.py). The second request comes once the operator asked world 0
to drain (phase Rescaling) and before the world drained; each test checks that it did (the drain had not finished) and says so
if the timing missed. The runs are judged by tests/support/exactness.py against lancedb's
StreamingDataset: every world that drained stopped at one agreed step, the next resumed
exactly there, nothing was trained twice.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from tests.e2e.cluster import NS, Cluster, StatusWatch, log, wait_for
from tests.e2e.jobs import assert_exact, finish, records, resume_step, wait_phase, wait_running, wait_steps
from tests.support.exactness import DRAINED, END, complete_checkpoints

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def start(cluster: Cluster, name: str, **kw: object) -> None:
    spec = {"replicas": 2, "epochs": 1, "sleep_s": 0.5, "timeout_seconds": 120, **kw}
    log(f"{name}: kubectl apply {spec}")
    cluster.apply(cluster.manifest(name, **spec))  # type: ignore[arg-type]
    wait_running(cluster, name, 0)


def patch(cluster: Cluster, name: str, spec: dict) -> None:
    log(f"{name}: patch spec {spec}")
    cluster.kubectl("-n", NS, "patch", "sj", name, "--type=merge", "-p", json.dumps({"spec": spec}))


def scale(cluster: Cluster, name: str, replicas: int) -> None:
    log(f"{name}: kubectl scale --replicas={replicas}")
    cluster.kubectl("-n", NS, "scale", f"sj/{name}", f"--replicas={replicas}")


def drained_at(cluster: Cluster, name: str, world: int) -> float | None:
    """When world `world`'s first rank logged its drained checkpoint (None: not yet)."""
    times = [r["t"] for r in records(cluster.log_dir(name), world) if r["event"] == "checkpoint" and r.get("drained")]
    return min(times, default=None)


def draining(cluster: Cluster, name: str) -> None:
    """The first request is under way: the operator asked world 0 to drain (phase Rescaling)."""
    wait_for(lambda: cluster.status(name).get("phase") == "Rescaling", 15, f"{name}'s drain to be requested")


def second_request_during_the_drain(cluster: Cluster, name: str, second_at: float) -> None:
    """The test is about overlap: the world must not have drained before the second request."""
    done = drained_at(cluster, name, 0)
    assert done is None or done > second_at, (
        f"world 0 drained {second_at - done:.1f} s before the second request: the timing missed the "
        "overlap this test is about (run it again)")


def test_a_scale_during_a_suspend_drain_is_kept_for_the_resume(cluster: Cluster) -> None:
    name = "scale-in-suspend"
    start(cluster, name)
    with StatusWatch(cluster, name) as watch:
        wait_steps(cluster, name, 0, 6)
        patch(cluster, name, {"suspend": True})
        draining(cluster, name)
        scale(cluster, name, 3)
        second_request_during_the_drain(cluster, name, time.time())
        status = wait_phase(cluster, name, "Suspended")
        assert status.get("replicas") == 0, status
        wait_for(lambda: not cluster.pods(name, include_deleting=True), 60, "the suspended job's pods to be gone")
        patch(cluster, name, {"suspend": False})
        wait_running(cluster, name, 1)
        status = wait_phase(cluster, name, "Succeeded")
    log(f"{name}: phases {watch.seen}")
    summary = assert_exact(cluster, name, 1)
    # One drain (the suspend's); the resumed world has the newest count.
    assert [(w.size, w.ended) for w in summary.worlds] == [(2, DRAINED), (3, END)], summary
    assert summary.replayed == 0 and status.get("restarts", 0) == 0, (summary, status)
    finish(cluster, name)


def test_a_suspend_during_a_rescale_drain_suspends_once_and_resumes_with_the_new_count(cluster: Cluster) -> None:
    name = "suspend-in-scale"
    start(cluster, name)
    with StatusWatch(cluster, name) as watch:
        wait_steps(cluster, name, 0, 6)
        scale(cluster, name, 3)
        draining(cluster, name)
        patch(cluster, name, {"suspend": True})
        second_request_during_the_drain(cluster, name, time.time())
        wait_phase(cluster, name, "Suspended")
        wait_for(lambda: not cluster.pods(name, include_deleting=True), 60, "the suspended job's pods to be gone")
        patch(cluster, name, {"suspend": False})
        status = wait_phase(cluster, name, "Succeeded")
    log(f"{name}: phases {watch.seen}")
    summary = assert_exact(cluster, name, 1)
    sizes = [(w.size, w.ended) for w in summary.worlds]
    # Merged: world 0 drained once and the resumed world has 3 replicas. Queued: a 3-replica
    # world started and drained for the suspend before the resume. Never a world that failed.
    assert sizes in ([(2, DRAINED), (3, END)], [(2, DRAINED), (3, DRAINED), (3, END)]), summary
    assert summary.replayed == 0 and status.get("restarts", 0) == 0, (summary, status)
    finish(cluster, name)


def test_a_job_deleted_during_a_drain_leaves_a_checkpoint_that_resume_from_resumes(cluster: Cluster) -> None:
    name, successor = "delete-in-drain", "delete-in-drain-next"
    start(cluster, name, checkpoint_every=3)
    uid = cluster.job(name)["metadata"]["uid"]
    wait_steps(cluster, name, 0, 7)
    scale(cluster, name, 1)
    draining(cluster, name)
    log(f"{name}: kubectl delete sj (during the drain)")
    cluster.kubectl("-n", NS, "delete", "sj", name, "--wait=false")
    second_request_during_the_drain(cluster, name, time.time())
    wait_for(lambda: not any(k[1].startswith(f"{name}-") for k in cluster.kubelet.pids()), 60,
             f"the processes of {name} to be gone")
    complete = complete_checkpoints(cluster.store(name))
    assert complete, "the deleted job left no complete checkpoint"
    newest = max(complete)
    drained = drained_at(cluster, name, 0)
    log(f"{name}: complete checkpoints {sorted(complete)}; world 0 drained: {drained is not None}")
    # The trainers keep their models beside their logs: the successor gets its predecessor's.
    shutil.copytree(cluster.log_dir(name) / "models", cluster.log_dir(successor) / "models")
    manifest = cluster.manifest(successor, replicas=2, epochs=1, sleep_s=0.2, timeout_seconds=120)
    manifest["spec"]["checkpoint"]["resumeFrom"] = {"uid": uid, "name": name}
    cluster.apply(manifest)
    status = wait_phase(cluster, successor, "Succeeded")
    assert status.get("restarts", 0) == 0, status
    assert resume_step(cluster.log_dir(successor), 0) == newest, (newest, status)
    if drained is not None:  # the drain finished before the pods went: its step is the newest
        agreed = {r["step"] for r in records(cluster.log_dir(name), 0) if r["event"] == "checkpoint"
                  and r.get("drained")}
        assert agreed == {newest}, (agreed, sorted(complete))
    steps = sorted({r["step"] for r in records(cluster.log_dir(successor), 0) if r["event"] == "batch"})
    assert steps == list(range(newest, 20)), steps
    finish(cluster, successor)
