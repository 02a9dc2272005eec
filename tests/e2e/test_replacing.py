"""End to end, `spec.rescale: inPlace`: a member pod killed mid-world is replaced alone (issue 22 item 3).

The same cluster, operator and DDP trainers as test_inplace.py, under `splitfeed run --` or
following the world in their own process (`client.rejoin(failed=True)` after the collective
raised). While world 0 trains, replica 2's pod is force-deleted (a lost node: its processes are
killed outright, nothing drains), or its trainer container is killed (SIGKILL to the container's
process group: the pod fails, its sidecar still runs). The operator deletes nothing else: it
tells world 0's coordinator, which ends the world without a drain; the other pods' sidecars go
on in place to world 1 from the newest complete checkpoint, their agents start the scripts
again (or the trainers rejoin in their process), and a new pod of replica 2 joins world 1. The
other pods keep their UIDs, start times and containers' processes; the job ends Succeeded, exact
against lancedb's StreamingDataset, with one counted restart.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e.cluster import NS, Cluster, log, wait_for
from tests.e2e.jobs import (assert_exact, event_reasons, finish, first_time, wait_phase, wait_running,
                            wait_steps)
from tests.support.exactness import END, FAILED

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def identities(cluster: Cluster, name: str) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """Pod name -> (UID, start time, PIDs of its containers) for every running pod of the job."""
    pids = cluster.kubelet.pids()
    return {p["metadata"]["name"]: (p["metadata"]["uid"], p["status"].get("startTime"),
                                    tuple(sorted(pid for k, pid in pids.items() if k[:2] == (NS, p["metadata"]["name"]))))
            for p in cluster.pods(name) if p["status"].get("phase") == "Running"}


def kill(cluster: Cluster, name: str, how: str) -> None:
    pod = f"{name}-r2"
    if how == "force-delete":
        log(f"{name}: kubectl delete pod {pod} --grace-period=0 --force")
        cluster.kubectl("-n", NS, "delete", "pod", pod, "--grace-period=0", "--force", "--wait=false")
        return
    pid = cluster.kubelet.pid(NS, pod, "trainer")
    assert pid, f"no process for {pod}/trainer"
    os.killpg(pid, signal.SIGKILL)  # the agent and its script: the container is gone
    log(f"{name}: SIGKILL {pod}/trainer's process group (pid {pid})")


@pytest.mark.parametrize("how,follow", [("force-delete", "agent"), ("kill-trainer", "agent"),
                                        ("force-delete", "in-process")])
def test_a_member_pod_killed_mid_world_is_replaced_alone_and_the_job_stays_exact(
        cluster: Cluster, how: str, follow: str) -> None:
    name, epochs = f"replace-{how}-{follow}", 2
    manifest = cluster.manifest(name, replicas=3, epochs=epochs, sleep_s=0.25, checkpoint_every=3,
                                timeout_seconds=60)
    manifest["spec"]["rescale"] = "inPlace"
    trainer = manifest["spec"]["trainer"]["template"]["spec"]["containers"][0]
    trainer["command"] = (["splitfeed", "run", "--", *trainer["command"]] if follow == "agent"
                          else [*trainer["command"], "--in-place"])
    cluster.apply(manifest)
    wait_for(lambda: len(identities(cluster, name)) == 3, 90, "3 pods running")
    before = identities(cluster, name)
    wait_steps(cluster, name, 0, 8)
    at = time.time()
    kill(cluster, name, how)
    wait_running(cluster, name, 1)
    first = wait_for(lambda: first_time(cluster.log_dir(name), 1, "batch"), 60, "world 1's first batch")
    log(f"{name}: {how} -> world 1's first batch {first - at:.1f} s")
    wait_steps(cluster, name, 1, 2)
    after = identities(cluster, name)
    kept = [f"{name}-r0", f"{name}-r1"]
    assert {n: after[n] for n in kept} == {n: before[n] for n in kept}, (before, after)
    assert after[f"{name}-r2"][0] != before[f"{name}-r2"][0], (before, after)  # a new pod
    status = wait_phase(cluster, name, "Succeeded", timeout=200)
    summary = assert_exact(cluster, name, epochs)
    assert [(w.size, w.ended) for w in summary.worlds] == [(3, FAILED), (3, END)], summary
    assert summary.worlds[1].resume_step >= 3, f"world 1 did not resume from a checkpoint: {summary}"
    assert (status["worldEpoch"], status["replicas"], status.get("restarts", 0)) == (1, 3, 1), status
    reasons = event_reasons(cluster, name)
    assert "PodReplacedInPlace" in reasons and "WorldResumedInPlace" in reasons, reasons
    assert "WorldFailed" not in reasons, reasons  # the world was not replaced as a whole
    finish(cluster, name)
