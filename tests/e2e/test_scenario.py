"""End to end: helm-installed operator, `kubectl apply`, train, `kubectl scale` 4 -> 2 -> 3, finish exactly.

Everything runs for real except the container runtime: the test kubelet runs
every pod (the operator's too) as local processes. See tests/e2e/cluster.py.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest

from tests.dataplane import harness as dataplane
from tests.e2e import exactness
from tests.e2e.cluster import NS, SYSTEM_NS, Cluster, StatusWatch, alive, log, max_step, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def reference(cluster: Cluster, epochs: int) -> tuple[list[set[int]], "functools._lru_cache_wrapper"]:
    """The unscaled run's global steps, and rank r's batches at world size w (lancedb in-process)."""
    overrides = {"epochs": epochs}

    @functools.lru_cache(maxsize=None)
    def rank_batches(world: int, rank: int) -> list[list[int]]:
        return dataplane.reference_batches(cluster.table_uri, overrides, world, rank)

    return dataplane.reference_global_steps(cluster.table_uri, overrides), rank_batches


def assert_exact(cluster: Cluster, name: str, log_dir: Path, checkpoint_dir: Path,
                 epochs: int) -> exactness.Summary:
    """The exactness rule of tests/e2e/exactness.py against lancedb's StreamingDataset."""
    global_steps, rank_batches = reference(cluster, epochs)
    summary = exactness.check(log_dir, exactness.complete_checkpoints(checkpoint_dir / NS / name),
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


def scale(cluster: Cluster, name: str, replicas: int, *, world: int, steps_in_world: int) -> None:
    """Once world `world` has trained `steps_in_world` steps, `kubectl scale` the job; wait for the next world."""
    log_dir = cluster.work / "logs" / name
    wait_for(lambda: resume_step(log_dir, world) is not None
             and max_step(log_dir, world) >= resume_step(log_dir, world) + steps_in_world - 1,
             120, f"world {world} to train {steps_in_world} steps")
    log(f"{name}: world {world} at step {max_step(log_dir, world)}: kubectl scale --replicas={replicas}")
    cluster.kubectl("-n", NS, "scale", f"sj/{name}", f"--replicas={replicas}")
    wait_for(lambda: (st := cluster.status(name)).get("worldEpoch") == world + 1 and st.get("phase") == "Running",
             120, f"world {world + 1} running")
    log(f"{name}: world {world + 1} running with {replicas} replicas")


def test_a_job_scaled_4_to_2_to_3_mid_epoch_trains_on_exactly_the_reference_steps(cluster: Cluster) -> None:
    name, epochs = "scenario", 2
    log_dir, ckpt = cluster.work / "logs" / name, cluster.work / "ckpt"
    manifest = cluster.manifest(name, log_dir=log_dir, replicas=4, epochs=epochs, sleep_s=0.25,
                                checkpoint_uri=str(ckpt))
    with StatusWatch(cluster, name) as watch:
        log(f"{name}: kubectl apply (4 replicas, numSplits 24, globalBatchSize 48, {epochs} epochs)")
        cluster.apply(manifest)
        wait_for(lambda: len([p for p in cluster.pods(name) if p["status"].get("phase") == "Running"]) == 4,
                 90, "4 pods running")
        log(f"{name}: 4 pods running")
        scale(cluster, name, 2, world=0, steps_in_world=6)
        scale(cluster, name, 3, world=1, steps_in_world=5)
        wait_for(lambda: cluster.status(name).get("phase") == "Succeeded", 150, "the job to succeed")
        log(f"{name}: Succeeded")

    # The trainers saw exactly the unscaled reference, world after world.
    summary = assert_exact(cluster, name, log_dir, ckpt, epochs)
    sizes = [size for _, size, _, _ in summary.worlds]
    assert sizes == [4, 2, 3], summary
    steps_per_epoch = len(reference(cluster, epochs)[0]) // epochs
    assert 0 < summary.worlds[1][2] < steps_per_epoch, f"the first rescale was not mid-epoch: {summary}"

    # The status walked through the rescale phases, and events say so.
    phases = [p for p, _ in watch.seen]
    assert phases[-1] == "Succeeded", watch.seen
    assert [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p][-6:] == [
        "Running", "Rescaling", "Running", "Rescaling", "Running", "Succeeded"], watch.seen
    reasons = [r for _, r in watch.seen if r]
    assert reasons[-1] == "RescaleComplete", watch.seen
    assert {"CheckpointRequested", "WaitingForCheckpoint"} & set(reasons), watch.seen
    status = cluster.status(name)
    assert (status["worldEpoch"], status["replicas"], status["worldSize"]) == (2, 3, 3)
    assert status.get("restarts", 0) == 0
    events = [e["reason"] for e in cluster.events(name)]
    log(f"{name}: events {events}")
    for reason in ("CheckpointRequested", "Drained", "StartingNewWorld", "RescaleComplete"):
        assert events.count(reason) >= (3 if reason == "StartingNewWorld" else 2), (reason, events)
    assert "Succeeded" in events
    described = cluster.kubectl("-n", NS, "get", "events", "--field-selector",
                                f"involvedObject.name={name}").stdout
    assert "replicas 4 -> 2" in described and "replicas 2 -> 3" in described, described

    # `kubectl get sj` shows the printer columns.
    table = cluster.kubectl("-n", NS, "get", "sj", name).stdout.splitlines()
    log(f"{name}: kubectl get sj\n" + "\n".join(table))
    assert table[0].split() == ["NAME", "REPLICAS", "WORLD", "PHASE", "EPOCH", "STEP", "AGE"]
    row = table[1].split()
    assert row[:4] == [name, "3", "3", "Succeeded"], row
    assert row[4:6] == [str(epochs), "0"], f"progress of a finished {epochs}-epoch job: {row}"

    # Deleting the job removes every object and process it made.
    pids = [pid for k, pid in cluster.kubelet.pids().items() if k[1].startswith(f"{name}-")]
    shm = [r.shm for r in cluster.kubelet.runs.values() if r.name.startswith(f"{name}-")]
    log(f"{name}: kubectl delete sj")
    cluster.kubectl("-n", NS, "delete", "sj", name, "--wait=true", "--timeout=60s")

    def gone() -> bool:
        left = [k for k in ("pods", "services", "configmaps") if cluster.get(
            f"/api/v1/namespaces/{NS}/{k}?labelSelector=splitfeed.io/job%3D{name}")["items"]]
        return not left and not any(k[1].startswith(f"{name}-") for k in cluster.kubelet.pids())
    wait_for(gone, 60, "pods, Service, ConfigMap and processes of the job to be gone")
    assert not [pid for pid in pids if alive(pid)]
    assert not [d for d in shm if d.exists()]
    log(f"{name}: every object, process and shared-memory directory is gone")


def test_the_operator_pod_runs_as_the_charts_service_account(cluster: Cluster) -> None:
    """The kubelet gave the operator its service account's token: RBAC applies to it, not to an admin."""
    pod = cluster.operator_pod()
    run = next(r for r in cluster.kubelet.runs.values() if r.uid == pod["metadata"]["uid"])
    config = json.loads((run.dir / "kubeconfig").read_text())
    token = Path(config["users"][0]["user"]["tokenFile"]).read_text()
    review = cluster.kubelet.api.call("POST", "/apis/authentication.k8s.io/v1/tokenreviews", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}})
    user = review["status"]["user"]["username"]
    assert user == f"system:serviceaccount:{SYSTEM_NS}:{pod['spec']['serviceAccountName']}"
    can = cluster.kubectl("auth", "can-i", "get", "secrets", "-n", NS, f"--as={user}", check=False)
    assert can.stdout.strip() == "no", "the chart grants the operator no access to Secrets"
