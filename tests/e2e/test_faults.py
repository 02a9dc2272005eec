"""Faults on the end-to-end cluster; after each, the trainers' steps are still exactly the reference.

Every job: 2 replicas, numSplits 24, globalBatchSize 48, one epoch (20 steps),
trainers pacing themselves so that the fault lands mid-epoch. The exactness
rule is tests/e2e/exactness.py's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import NS, SYSTEM_NS, Cluster, StatusWatch, alive, log, wait_for
from tests.e2e.jobs import (assert_exact, event_reasons, wait_phase, wait_running, wait_steps)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def start(cluster: Cluster, name: str, **kw: object) -> None:
    spec = {"replicas": 2, "epochs": 1, "sleep_s": 0.3, **kw}
    log(f"{name}: kubectl apply {spec}")
    cluster.apply(cluster.manifest(name, **spec))  # type: ignore[arg-type]
    wait_running(cluster, name, 0)


def done(cluster: Cluster, name: str) -> None:
    """Delete a finished job (the garbage collector removes its pods)."""
    cluster.kubectl("-n", NS, "delete", "sj", name, "--wait=false")


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
    assert [(size, resume) for _, size, resume, _ in summary.worlds] == [(2, 0)]
    assert summary.replayed == 0
    done(cluster, name)


def test_a_killed_trainer_fails_its_pod_and_the_world_restarts_from_the_last_checkpoint(
        cluster: Cluster) -> None:
    name = "kill-trainer"
    start(cluster, name, checkpoint_every=4)
    wait_steps(cluster, name, 0, 6)
    kill(cluster, f"{name}-w0-0", "trainer")
    wait_running(cluster, name, 1)
    log(f"{name}: world restarted")
    status = wait_phase(cluster, name, "Succeeded")
    summary = assert_exact(cluster, name, 1)
    assert status["restarts"] == 1 and status["worldEpoch"] == 1
    assert [size for _, size, _, _ in summary.worlds] == [2, 2]
    assert summary.worlds[1][2] >= 4, f"world 1 did not resume from a checkpoint: {summary}"
    assert "WorldFailed" in event_reasons(cluster, name)
    done(cluster, name)


def test_a_deleted_pod_restarts_the_world_from_the_last_checkpoint(cluster: Cluster) -> None:
    name = "delete-pod"
    start(cluster, name, checkpoint_every=4)
    wait_steps(cluster, name, 0, 6)
    log(f"{name}: kubectl delete pod {name}-w0-1")
    cluster.kubectl("-n", NS, "delete", "pod", f"{name}-w0-1", "--wait=false")
    wait_running(cluster, name, 1)
    status = wait_phase(cluster, name, "Succeeded")
    summary = assert_exact(cluster, name, 1)
    assert status["restarts"] == 1
    assert summary.worlds[1][2] >= 4, f"world 1 did not resume from a checkpoint: {summary}"
    assert "WorldFailed" in event_reasons(cluster, name)
    done(cluster, name)


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
        pid = cluster.kubelet.pid(SYSTEM_NS, old_name, "operator")
        assert pid
        os.kill(pid, signal.SIGKILL)
        log(f"{name}: SIGKILL the operator (pid {pid}) in Rescaling/{watch.seen[-1][1]}; deleting its pod")
        cluster.kubectl("-n", SYSTEM_NS, "delete", "pod", old_name, "--grace-period=0", "--force")
        new = wait_for(lambda: (p := cluster.operator_pod())["metadata"]["name"] != old_name
                       and p["status"].get("phase") == "Running" and p, 60,
                       "the Deployment's ReplicaSet to bring a new operator pod up")
        log(f"{name}: operator back as {new['metadata']['name']}")
        wait_running(cluster, name, 1)
        status = wait_phase(cluster, name, "Succeeded")
    assert not alive(pid)
    summary = assert_exact(cluster, name, 1)
    assert [size for _, size, _, _ in summary.worlds] == [2, 1]
    assert status.get("restarts", 0) == 0
    assert "RescaleComplete" in event_reasons(cluster, name)
    done(cluster, name)


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
    wait_for(lambda: (cluster.store(name) / f"step-{3:012d}").is_dir(), 90, "the first checkpoint")
    log_dir = cluster.log_dir(name)

    def failures() -> int:
        return sum(p.read_text().count('"checkpoint-failed"') for p in log_dir.glob("w0-r*.jsonl"))
    with unwritable(cluster.store(name)):
        wait_for(lambda: failures() >= 2, 60, "a periodic checkpoint to fail")
        before = failures()
        log(f"{name}: {before} checkpoint attempts failed; kubectl scale --replicas=1")
        cluster.kubectl("-n", NS, "scale", f"sj/{name}", "--replicas=1")
        wait_for(lambda: failures() >= before + 2, 30, "the drain's checkpoint to fail")
    wait_running(cluster, name, 1)
    status = wait_phase(cluster, name, "Succeeded")
    summary = assert_exact(cluster, name, 1)
    assert summary.checkpoint_failures >= 4
    assert [size for _, size, _, _ in summary.worlds] == [2, 1]
    assert summary.worlds[1][2] > 3, f"the drain's checkpoint was not written once writable: {summary}"
    assert status.get("restarts", 0) == 0
    done(cluster, name)
