"""End to end: helm-installed operator, `kubectl apply`, train, `kubectl scale` 4 -> 2 -> 3, finish exactly.

Everything runs for real except the container runtime: the test kubelet runs
every pod (the operator's too) as local processes, and plays cluster DNS in
/etc/hosts. The trainers are real DDP trainers (tests/e2e/trainer.py: gloo on
CPU, a backward pass with an all-reduce every step, the README's loop and no
barrier of their own). See tests/e2e/cluster.py.

Exactness rule (tests/support/exactness.py): every rank of a drained world
checkpointed at one agreed step S and received nothing past it, and the next
world resumed exactly at S with the model saved there; within each world's
range every rank has exactly one batch, equal to its StreamingDataset batch for
that world size, and the ranges tile the unscaled reference. Nothing is
replayed: only a failed world's batches past its last complete checkpoint may be.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.cluster import NS, SYSTEM_NS, Cluster, StatusWatch, alive, log, wait_for
from tests.support.exactness import DRAINED, END
from tests.e2e.jobs import (AGREED_WITHIN_S, assert_exact, event_reasons, reference_steps, rescale_latency, scale,
                            wait_phase)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_a_job_scaled_4_to_2_to_3_mid_epoch_trains_on_exactly_the_reference_steps(cluster: Cluster) -> None:
    name, epochs, timeout_s = "scenario", 2, 120
    manifest = cluster.manifest(name, replicas=4, epochs=epochs, sleep_s=0.25, timeout_seconds=timeout_s)
    latencies = []
    with StatusWatch(cluster, name) as watch:
        log(f"{name}: kubectl apply (4 replicas, numSplits 24, globalBatchSize 48, {epochs} epochs)")
        cluster.apply(manifest)
        wait_for(lambda: len([p for p in cluster.pods(name) if p["status"].get("phase") == "Running"]) == 4,
                 90, "4 pods running")
        log(f"{name}: 4 pods running")
        at = scale(cluster, name, 2, world=0, steps_in_world=6)
        latencies.append(rescale_latency(cluster, name, 0, at, "rescale 4 -> 2"))
        at = scale(cluster, name, 3, world=1, steps_in_world=5)
        latencies.append(rescale_latency(cluster, name, 1, at, "rescale 2 -> 3"))
        wait_phase(cluster, name, "Succeeded")

    # The trainers saw exactly the unscaled reference, world after world, and nothing twice.
    summary = assert_exact(cluster, name, epochs)
    assert [w.size for w in summary.worlds] == [4, 2, 3], summary
    assert [w.ended for w in summary.worlds] == [DRAINED, DRAINED, END], summary
    assert summary.replayed == 0, summary
    steps_per_epoch = len(reference_steps(cluster.table_uri, epochs)) // epochs
    assert 0 < summary.worlds[1].resume_step < steps_per_epoch, f"the first rescale was not mid-epoch: {summary}"
    # A rescale is the agreement's work, not checkpoint.timeoutSeconds running out. The new world's
    # first batch also waits for the old trainers' exit and the new pods' start (torch and lancedb
    # imports: most of the time on a small machine).
    for r in latencies:
        assert 0 < r.to_checkpoint < AGREED_WITHIN_S, (latencies, timeout_s)
        assert r.to_checkpoint < r.to_first_batch < timeout_s / 2, (latencies, timeout_s)

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
    # Events are posted after the status patch they describe: wait for the last one.
    wait_for(lambda: "Succeeded" in event_reasons(cluster, name), 30, f"{name}'s Succeeded event")
    events = event_reasons(cluster, name)
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
    assert table[0].split() == ["NAME", "REPLICAS", "WORLD", "PHASE", "EPOCH", "STEP", "STALL", "AGE"]
    row = table[1].split()
    assert row[:4] == [name, "3", "3", "Succeeded"], row
    assert row[4:6] == [str(epochs), "0"], f"progress of a finished {epochs}-epoch job: {row}"

    # The job's NetworkPolicy (networkPolicy.enabled by default) selects its pods; no CNI here enforces it.
    policy = cluster.get(f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/{name}")
    assert policy["spec"]["podSelector"] == {"matchLabels": {"splitfeed.io/job": name}}
    assert policy["metadata"]["ownerReferences"][0]["uid"] == cluster.job(name)["metadata"]["uid"]

    # Deleting the job removes every object and process it made.
    pids = [pid for k, pid in cluster.kubelet.pids().items() if k[1].startswith(f"{name}-")]
    shm = [r.shm for r in cluster.kubelet.runs.values() if r.name.startswith(f"{name}-")]
    log(f"{name}: kubectl delete sj")
    cluster.kubectl("-n", NS, "delete", "sj", name, "--wait=true", "--timeout=60s")

    def gone() -> bool:
        left = [k for k in ("api/v1/{}/pods", "api/v1/{}/services", "api/v1/{}/configmaps",
                            "apis/networking.k8s.io/v1/{}/networkpolicies") if cluster.get(
            "/" + k.format(f"namespaces/{NS}") + f"?labelSelector=splitfeed.io/job%3D{name}")["items"]]
        return not left and not any(k[1].startswith(f"{name}-") for k in cluster.kubelet.pids())
    wait_for(gone, 60, "pods, Service, ConfigMap, NetworkPolicy and processes of the job to be gone")
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

    def can(verb: str, resource: str) -> str:
        return cluster.kubectl("auth", "can-i", verb, resource, "-n", NS, f"--as={user}", check=False).stdout.strip()

    # Each job's control keypair (docs/security.md): created, and read back by name; nothing more.
    verbs = ("get", "create", "list", "watch", "update", "patch", "delete")
    assert {v: can(v, "secrets") for v in verbs} == {"get": "yes", "create": "yes", "list": "no", "watch": "no",
                                                     "update": "no", "patch": "no", "delete": "no"}
    # Each job's NetworkPolicy (networkPolicy.enabled, the default): made, read back, its spec put back.
    assert {v: can(v, "networkpolicies.networking.k8s.io") for v in verbs} == {
        "get": "yes", "create": "yes", "list": "no", "watch": "no", "update": "no", "patch": "yes", "delete": "no"}
