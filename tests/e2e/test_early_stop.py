"""Trainers that stop early (issue 21): a normal end, or a failure naming the ranks; never a hang.

Every job: 2 replicas, numSplits 24, globalBatchSize 48, one epoch (20 global steps), real
DDP trainers (tests/e2e/trainer.py with `--stop-after`: the README's loop, gloo) that checkpoint every
3 steps and return after global step 4 (`--stop-after 5`, a max_steps loop), with and
without `client.close()`. The end-to-end cluster runs sidecars as plain containers
(`--sidecar-mode container`): nobody stops a sidecar whose trainer returned but the
operator. Measured before the operator knew of it (issue 21): without close() the job was
still Running 60 s after the trainers returned, its sidecars serving; with close() it
Succeeded ("all 2 pods of world 0 succeeded") without saying where the trainers stopped.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import NS, Cluster, log, wait_for
from tests.e2e.jobs import finish, records, wait_running
from tests.support.exactness import complete_checkpoints

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

ENDED_WITHIN_S = 30.0
"""Issue 21: from the last trainer's return to the job's end, with its pods stopped."""
TRAINER = Path(__file__).with_name("trainer.py")


def start(cluster: Cluster, name: str, *trainer_args: str, **kw: Any) -> None:
    manifest = cluster.manifest(name, replicas=2, epochs=1, **kw)
    manifest["spec"]["trainer"]["template"]["spec"]["containers"][0]["command"] = [
        "python", str(TRAINER), str(cluster.log_dir(name)), "--sleep-s", "0.3", "--checkpoint-every", "3",
        "--timeout-s", "60", *trainer_args]
    log(f"{name}: kubectl apply (trainer args {trainer_args})")
    cluster.apply(manifest)
    wait_running(cluster, name, 0)


def exits(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return [r for r in records(cluster.log_dir(name), 0) if r["event"] == "exit"]


def running(cluster: Cluster, name: str) -> list[str]:
    """The job's containers whose processes still run on the test kubelet."""
    return [f"{pod}/{c}" for (ns, pod, c) in cluster.kubelet.pids() if ns == NS and pod.startswith(f"{name}-")]


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


@pytest.mark.parametrize("close", [False, True], ids=["no-close", "close"])
def test_trainers_that_return_early_end_the_job_succeeded(cluster: Cluster, close: bool) -> None:
    name = f"early-stop-{'close' if close else 'no-close'}"
    start(cluster, name, "--stop-after", "5", *([] if close else ["--no-close"]))
    wait_for(lambda: len(exits(cluster, name)) == 2, 120, "both trainers to return")
    returned = max(r["t"] for r in exits(cluster, name))
    assert {r["reason"] for r in exits(cluster, name)} == {"stopped"}
    log(f"{name}: both trainers returned")
    status = wait_for(lambda: (s := cluster.status(name)).get("phase") in ("Succeeded", "Failed") and s,
                      ENDED_WITHIN_S + 30, f"{name} to end")
    ended = time.time() - returned
    wait_for(lambda: not running(cluster, name), 60, f"the pods of {name} to stop")
    gone = time.time() - returned
    log(f"{name}: {status['phase']} {ended:.1f} s after the trainers returned; pods stopped after {gone:.1f} s")
    assert status["phase"] == "Succeeded", status
    complete = condition(status, "Complete")
    assert complete.get("status") == "True" and complete.get("reason") == "TrainersStopped", complete
    assert "trainers stopped at global step 5 of 20" in complete["message"], complete
    events = wait_for(lambda: [e for e in cluster.events(name) if e["reason"] == "TrainersStopped"], 10,
                      "the TrainersStopped event")  # Kopf posts events after the status patch
    assert "trainers stopped at global step 5 of 20" in events[-1]["message"], events
    assert ended < ENDED_WITHIN_S and gone < ENDED_WITHIN_S, (ended, gone)
    # The last committed checkpoint (step 3) is still there, complete, for a resume.
    assert max(complete_checkpoints(cluster.store(name))) == 3
    assert status.get("restarts", 0) == 0
    finish(cluster, name)


def test_a_rank_that_returns_while_its_peer_trains_fails_the_job_naming_it(cluster: Cluster) -> None:
    """Rank 1 returns after step 4; rank 0 goes on into an all-reduce that rank 1 never joins."""
    name = "early-stop-one-rank"
    start(cluster, name, "--stop-after", "5", "--stop-rank", "1", timeout_seconds=20)
    wait_for(lambda: exits(cluster, name), 120, "rank 1 to return")
    returned = min(r["t"] for r in exits(cluster, name))
    status = wait_for(lambda: (s := cluster.status(name)).get("phase") == "Failed" and s, 20 + 40,
                      f"{name} to fail")
    took = time.time() - returned
    failed = condition(status, "Failed")
    log(f"{name}: Failed {took:.1f} s after rank 1 returned: {failed.get('message')}")
    assert failed.get("reason") == "RanksStoppedEarly", failed
    assert "rank 1" in failed["message"] and f"{name}-w0-1" in failed["message"], failed
    assert status.get("restarts", 0) == 0 and status.get("worldEpoch") == 0, status
    assert took < 20 + 15
    wait_for(lambda: not running(cluster, name), 60, f"the pods of {name} to stop")
    finish(cluster, name)


def test_a_rank_that_returns_while_its_peer_waits_fails_the_job_after_the_checkpoint_timeout(
        cluster: Cluster) -> None:
    """Rank 1 returns after step 4; rank 0 waits for it for ever (NCCL's all-reduce would)."""
    name = "early-stop-waiting-peer"
    start(cluster, name, "--stop-after", "5", "--stop-rank", "1", "--peers-wait", timeout_seconds=15)
    wait_for(lambda: exits(cluster, name), 120, "rank 1 to return")
    returned = min(r["t"] for r in exits(cluster, name))
    ready = wait_for(lambda: condition(cluster.status(name), "Ready").get("reason") == "RanksStoppedEarly"
                     and condition(cluster.status(name), "Ready"), 20, "the Ready condition to say why")
    log(f"{name}: {ready['message']}")
    status = wait_for(lambda: (s := cluster.status(name)).get("phase") == "Failed" and s, 15 + 30,
                      f"{name} to fail")
    took = time.time() - returned
    failed = condition(status, "Failed")
    log(f"{name}: Failed {took:.1f} s after rank 1 returned: {failed.get('message')}")
    assert failed.get("reason") == "RanksStoppedEarly", failed
    assert failed["message"].startswith(f"rank 1 (pod {name}-w0-1) of world 0 returned (exit 0)"), failed
    assert f"while rank 0 (pod {name}-w0-0) still ran 15 s later" in failed["message"], failed
    assert 15 - 2 <= took < 15 + 15, took  # finishedAt has whole seconds
    assert status.get("restarts", 0) == 0 and status.get("worldEpoch") == 0, status
    wait_for(lambda: not running(cluster, name), 60, f"the pods of {name} to stop")
    finish(cluster, name)
