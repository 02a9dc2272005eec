"""Faults on the end-to-end cluster; after each, the trainers' steps are still exactly the reference.

Every job: 2 replicas, numSplits 24, globalBatchSize 48, one epoch (20 steps),
real DDP trainers (tests/e2e/trainer.py) pacing themselves so that the fault
lands mid-epoch. The exactness rule is tests/support/exactness.py's: a world that
drained (a rescale, even with the operator killed, or with checkpoints failing
for a while) replays nothing and the next world resumes at its agreed step; a
world that failed (a killed trainer takes its DDP peers down with it, a pod
force-deleted) restarts from the last complete checkpoint, and only its
batches past that checkpoint are received again.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import NS, SYSTEM_NS, Cluster, StatusWatch, alive, log, wait_for
from tests.support.exactness import DRAINED, END, FAILED
from tests.e2e.jobs import assert_exact, event_reasons, finish, wait_phase, wait_running, wait_steps

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def start(cluster: Cluster, name: str, **kw: object) -> None:
    spec = {"replicas": 2, "epochs": 1, "sleep_s": 0.3, **kw}
    log(f"{name}: kubectl apply {spec}")
    cluster.apply(cluster.manifest(name, **spec))  # type: ignore[arg-type]
    wait_running(cluster, name, 0)


def kill(cluster: Cluster, pod: str, container: str) -> int:
    pid = cluster.kubelet.pid(NS, pod, container)
    assert pid, f"no process for {pod}/{container}"
    os.kill(pid, signal.SIGKILL)
    log(f"SIGKILL {pod}/{container} (pid {pid})")
    return pid


def container_status(cluster: Cluster, pod: str, container: str) -> dict:
    p = cluster.get(f"/api/v1/namespaces/{NS}/pods/{pod}")
    return next(c for c in p["status"].get("containerStatuses") or [] if c["name"] == container)


def test_a_killed_sidecar_is_restarted_in_place_and_its_trainer_continues_exactly(cluster: Cluster) -> None:
    name = "kill-sidecar"
    start(cluster, name, restart_policy="OnFailure", checkpoint_every=5)
    wait_steps(cluster, name, 0, 6)
    kill(cluster, f"{name}-w0-1", "splitfeed-sidecar")
    wait_for(lambda: container_status(cluster, f"{name}-w0-1", "splitfeed-sidecar")["restartCount"] >= 1,
             30, "the kubelet to restart the sidecar")
    log(f"{name}: sidecar restarted in place")
    status = wait_phase(cluster, name, "Succeeded")
    summary = assert_exact(cluster, name, 1)
    # No world was replaced: one world took every step, none twice.
    assert status["worldEpoch"] == 0 and status.get("restarts", 0) == 0
    assert [(w.size, w.resume_step, w.ended) for w in summary.worlds] == [(2, 0, END)], summary
    assert summary.replayed == 0, summary
    finish(cluster, name)


def test_a_killed_trainer_fails_its_world_and_the_next_resumes_from_the_last_complete_checkpoint(
        cluster: Cluster) -> None:
    """Rank 0 (it also hosts gloo's store) dies mid-step: rank 1's all-reduce fails, the world fails."""
    name = "kill-trainer"
    start(cluster, name, checkpoint_every=4)
    wait_steps(cluster, name, 0, 6)
    kill(cluster, f"{name}-w0-0", "trainer")
    wait_running(cluster, name, 1)
    log(f"{name}: world restarted")
    status = wait_phase(cluster, name, "Succeeded")
    summary = assert_exact(cluster, name, 1)
    assert status["restarts"] == 1 and status["worldEpoch"] == 1
    assert [(w.size, w.ended) for w in summary.worlds] == [(2, FAILED), (2, END)], summary
    assert summary.worlds[1].resume_step >= 4, f"world 1 did not resume from a checkpoint: {summary}"
    assert "WorldFailed" in event_reasons(cluster, name)
    finish(cluster, name)


def test_a_force_deleted_pod_fails_its_world_and_the_next_resumes_from_the_last_complete_checkpoint(
        cluster: Cluster) -> None:
    """`kubectl delete pod --grace-period=0 --force` (a lost node): the pod's processes are
    killed outright, nothing drains. A graceful delete is a preemption: tests/e2e/test_drains.py."""
    name = "delete-pod"
    start(cluster, name, checkpoint_every=4)
    wait_steps(cluster, name, 0, 6)
    log(f"{name}: kubectl delete pod {name}-w0-1 --grace-period=0 --force")
    cluster.kubectl("-n", NS, "delete", "pod", f"{name}-w0-1", "--grace-period=0", "--force", "--wait=false")
    wait_running(cluster, name, 1)
    status = wait_phase(cluster, name, "Succeeded")
    summary = assert_exact(cluster, name, 1)
    assert status["restarts"] == 1
    assert [(w.size, w.ended) for w in summary.worlds] == [(2, FAILED), (2, END)], summary
    assert summary.worlds[1].resume_step >= 4, f"world 1 did not resume from a checkpoint: {summary}"
    assert "WorldFailed" in event_reasons(cluster, name)
    finish(cluster, name)


def test_an_operator_killed_mid_rescale_comes_back_through_its_deployment_and_finishes(
        cluster: Cluster) -> None:
    name = "kill-operator"
    start(cluster, name)
    old = cluster.operator_pod()
    old_name = old["metadata"]["name"]
    with StatusWatch(cluster, name) as watch:
        wait_steps(cluster, name, 0, 5)
        log(f"{name}: kubectl scale --replicas=1")
        cluster.kubectl("-n", NS, "scale", f"sj/{name}", "--replicas=1")
        wait_for(lambda: cluster.status(name).get("phase") == "Rescaling", 30, "the rescale to start")
        # Mid-rescale means the request is out: the phase is written before the pods are
        # annotated, and a kill in between loses the request until the next operator is up (the
        # world may even run to its end meanwhile, which then ends the job: a test of another case).
        wait_for(lambda: all((p["metadata"].get("annotations") or {}).get("splitfeed.io/drain")
                             for p in cluster.pods(name)), 30, "every pod of world 0 asked to drain")
        pid = cluster.kubelet.pid(SYSTEM_NS, old_name, "operator")
        assert pid
        os.kill(pid, signal.SIGKILL)
        log(f"{name}: SIGKILL the operator (pid {pid}) in Rescaling/{watch.seen[-1][1]}; deleting its pod")
        cluster.kubectl("-n", SYSTEM_NS, "delete", "pod", old_name, "--grace-period=0", "--force")
        # the next pod may not exist yet: the ReplicaSet creates it once it saw the deletion
        new = wait_for(lambda: len(live := cluster.operator_pods()) == 1
                       and live[0]["metadata"]["name"] != old_name
                       and live[0]["status"].get("phase") == "Running" and live[0], 60,
                       "the Deployment's ReplicaSet to bring a new operator pod up")
        log(f"{name}: operator back as {new['metadata']['name']}")
        wait_running(cluster, name, 1)
        status = wait_phase(cluster, name, "Succeeded")
    assert not alive(pid)
    summary = assert_exact(cluster, name, 1)
    assert [(w.size, w.ended) for w in summary.worlds] == [(2, DRAINED), (1, END)], summary
    assert summary.replayed == 0, summary
    assert status.get("restarts", 0) == 0
    assert "RescaleComplete" in event_reasons(cluster, name)
    finish(cluster, name)


def test_a_member_sidecar_killed_for_good_after_the_drain_committed_still_drains_the_world_there(
        cluster: Cluster) -> None:
    """Issue 21 item 2: `kubectl scale` 2 -> 1; once replica 1's trainer took batch S - 1 and saw
    the checkpoint request (the drain is committed and its last batch published), its sidecar is
    SIGKILLed; restartPolicy Never, so it stays dead. The trainer checkpoints S through the world's
    coordinator; world 1 resumes exactly at S: exact, 0 steps redone, no restart, announced."""
    name = "kill-member-sidecar"
    start(cluster, name, sleep_s=0.5, timeout_seconds=120)
    member, log_dir = f"{name}-w0-1", cluster.log_dir(name)
    wait_steps(cluster, name, 0, 4)
    log(f"{name}: kubectl scale --replicas=1")
    cluster.kubectl("-n", NS, "scale", f"sj/{name}", "--replicas=1")

    def requested() -> dict | None:
        return next((r for r in _rank_records(log_dir, 0, 1) if r["event"] == "batch" and r.get("requested")), None)

    seen = wait_for(requested, 60, "rank 1 to see the drain's checkpoint request")
    step = seen["step"] + 1
    kill(cluster, member, "splitfeed-sidecar")
    late = [r for r in _rank_records(log_dir, 0, 1) if r["event"] == "checkpoint"]
    assert not late, (f"rank 1 checkpointed through its own sidecar before the kill landed ({late}): "
                      "the timing missed what this test is about (run it again)")
    coordinator_log = cluster.kubelet.log_path(NS, f"{name}-w0-0", "splitfeed-sidecar")
    assert coordinator_log is not None
    wait_for(lambda: f"wrote rank 1's commit marker at drain step {step}" in coordinator_log.read_text(
        errors="replace"), 60, "the coordinator to commit rank 1's drain step in its sidecar's stead")
    status = wait_phase(cluster, name, "Succeeded")
    summary = assert_exact(cluster, name, 1)
    assert [(w.size, w.ended, w.agreed_step) for w in summary.worlds] == [(2, DRAINED, step), (1, END, None)], summary
    assert summary.worlds[1].resume_step == step and summary.replayed == 0, summary
    assert status.get("restarts", 0) == 0
    assert (status.get("lastRescale") or {}).get("stepsRedone") == 0, status.get("lastRescale")
    found = [e for e in cluster.events(name) if e["reason"] == "DrainSurvivedLostSidecar"]
    assert len(found) == 1 and member in found[0]["message"] and f"step {step}" in found[0]["message"], found
    finish(cluster, name)


def _rank_records(log_dir: Path, world: int, rank: int) -> list[dict]:
    path = log_dir / f"w{world}-r{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@contextlib.contextmanager
def unwritable(path: Path) -> Iterator[None]:
    """No new entries under `path` for a while. Root ignores mode bits, so as root the
    immutable attribute (chattr +i) is set as well; both are restored, also on failure."""
    mode = stat.S_IMODE(path.stat().st_mode)
    immutable = os.geteuid() == 0
    if immutable and shutil.which("chattr") is None:
        raise AssertionError("running as root needs chattr (e2fsprogs) to make a directory unwritable")
    path.chmod(0o555)
    try:
        if immutable:
            subprocess.run(["chattr", "+i", str(path)], check=True, capture_output=True)
        with pytest.raises(OSError):
            (path / "probe").mkdir()
        log(f"{path} is unwritable")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True, capture_output=True)
        path.chmod(mode)
        log(f"{path} is writable again")


def test_an_unwritable_checkpoint_store_delays_checkpoints_and_loses_nothing(cluster: Cluster) -> None:
    name = "readonly-store"
    start(cluster, name, checkpoint_every=3)
    first = wait_for(lambda: next(cluster.store(name).rglob(f"step-{3:012d}"), None), 90, "the first checkpoint")
    steps_dir = first.parent  # where the job's step directories go (under the job's UID)
    log_dir = cluster.log_dir(name)

    def failures() -> int:
        return sum(p.read_text().count('"checkpoint-failed"') for p in log_dir.glob("w0-r*.jsonl"))
    with unwritable(steps_dir):
        wait_for(lambda: failures() >= 2, 60, "a periodic checkpoint to fail")
        before = failures()
        log(f"{name}: {before} checkpoint attempts failed; kubectl scale --replicas=1")
        cluster.kubectl("-n", NS, "scale", f"sj/{name}", "--replicas=1")
        wait_for(lambda: failures() >= before + 2, 30, "the drain's checkpoint to fail")
    wait_running(cluster, name, 1)
    status = wait_phase(cluster, name, "Succeeded")
    summary = assert_exact(cluster, name, 1)
    assert summary.checkpoint_failures >= 4
    # The drain's checkpoint was retried until the store took it: the world drained at its agreed step.
    assert [(w.size, w.ended) for w in summary.worlds] == [(2, DRAINED), (1, END)], summary
    assert summary.worlds[1].resume_step > 3, f"the drain's checkpoint was not written once writable: {summary}"
    assert summary.replayed == 0, summary
    assert status.get("restarts", 0) == 0
    finish(cluster, name)
