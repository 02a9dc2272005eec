"""The lifecycle issue's fault scenarios (issue 21) with `spec.rescale: inPlace` (issue 22 item 5).

The same scenarios, jobs and assertions as tests/e2e/test_early_stop.py, test_faults.py and
test_overlapping.py, with an inPlace manifest and the trainers following the world under
`splitfeed run --` (the agent) or in their own process (`--in-place`: `client.rejoin()`),
as tests/e2e/test_inplace.py does. The exactness rule is tests/support/exactness.py's,
against lancedb's StreamingDataset, as in the originals.

What in place changes, and so which assertions differ (none is dropped):
- pods are named by replica (`<job>-r<i>`), not by world (`<job>-w<e>-<i>`): the pod names
  the tests kill, and the ones a failure message must name, are the replica's;
- a rescale keeps the pods that stay, so a world's end is seen in the trainers' logs and
  status, not in pods going away; every world-level assertion (sizes, how each world ended,
  resume steps, steps replayed, restarts) is the original's;
- a scale-up in place creates the new replicas' pods first and asks the world to drain once
  their trainers are ready: a second request "during the drain" (phase Rescaling) may land in
  that wait, before the world was asked. The originals' check that the world had not drained
  before the second request applies unchanged;
- a job deleted during a drain: the operator deletes its pods gracefully at once (a
  preemption), and the kept pod may have gone on into world 1 before its SIGTERM came, which
  then drains world 1; so the newest complete checkpoint is a drained step of the job's last
  world, not necessarily world 0's (the original's "world 0's drain step is the newest");
- the member sidecar killed for good after the drain committed: the next world may serve
  before the operator sees the dead sidecar; the event DrainSurvivedLostSidecar then comes from
  the next world's coordinator's `status` answer (`stood_in`), with the original's assertions.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from typing import Any

import pytest

from tests.e2e.cluster import NS, Cluster, StatusWatch, log, wait_for
from tests.e2e.jobs import (assert_exact, assert_two_scales_ended_exact, finish, records, resume_step, wait_phase,
                            wait_running, wait_steps)
from tests.support.exactness import DRAINED, END, complete_checkpoints

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

ENDED_WITHIN_S = 30.0
"""Issue 21: from the last trainer's return to the job's end, with its pods stopped."""


def in_place(manifest: dict[str, Any], follow: str) -> dict[str, Any]:
    """`spec.rescale: inPlace`, the trainer under the agent or following worlds in its own process."""
    manifest["spec"]["rescale"] = "inPlace"
    trainer = manifest["spec"]["trainer"]["template"]["spec"]["containers"][0]
    trainer["command"] = (["splitfeed", "run", "--", *trainer["command"]] if follow == "agent"
                          else [*trainer["command"], "--in-place"])
    return manifest


def start(cluster: Cluster, name: str, follow: str = "agent", *, trainer_args: tuple[str, ...] = (),
          **kw: Any) -> None:
    spec = {"replicas": 2, "epochs": 1, "sleep_s": 0.5, "timeout_seconds": 120, **kw}
    manifest = cluster.manifest(name, **spec)
    if trainer_args:
        manifest["spec"]["trainer"]["template"]["spec"]["containers"][0]["command"] += list(trainer_args)
    log(f"{name}: kubectl apply {spec} in place ({follow}), trainer args {trainer_args}")
    cluster.apply(in_place(manifest, follow))
    wait_running(cluster, name, 0)


def pod(name: str, replica: int) -> str:
    return f"{name}-r{replica}"


def kill(cluster: Cluster, pod_name: str, container: str) -> int:
    pid = cluster.kubelet.pid(NS, pod_name, container)
    assert pid, f"no process for {pod_name}/{container}"
    os.kill(pid, signal.SIGKILL)
    log(f"SIGKILL {pod_name}/{container} (pid {pid})")
    return pid


def container_status(cluster: Cluster, pod_name: str, container: str) -> dict[str, Any]:
    p = cluster.get(f"/api/v1/namespaces/{NS}/pods/{pod_name}")
    return next(c for c in p["status"].get("containerStatuses") or [] if c["name"] == container)


def scale(cluster: Cluster, name: str, replicas: int) -> None:
    log(f"{name}: kubectl scale --replicas={replicas}")
    cluster.kubectl("-n", NS, "scale", f"sj/{name}", f"--replicas={replicas}")


def patch(cluster: Cluster, name: str, spec: dict[str, Any]) -> None:
    log(f"{name}: patch spec {spec}")
    cluster.kubectl("-n", NS, "patch", "sj", name, "--type=merge", "-p", json.dumps({"spec": spec}))


def exits(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return [r for r in records(cluster.log_dir(name), 0) if r["event"] == "exit"]


def running(cluster: Cluster, name: str) -> list[str]:
    """The job's containers whose processes still run on the test kubelet."""
    return [f"{p}/{c}" for (ns, p, c) in cluster.kubelet.pids() if ns == NS and p.startswith(f"{name}-")]


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


def drained_at(cluster: Cluster, name: str, world: int) -> float | None:
    times = [r["t"] for r in records(cluster.log_dir(name), world) if r["event"] == "checkpoint" and r.get("drained")]
    return min(times, default=None)


def draining(cluster: Cluster, name: str) -> None:
    wait_for(lambda: cluster.status(name).get("phase") == "Rescaling", 15, f"{name}'s drain to be requested")


def second_request_during_the_drain(cluster: Cluster, name: str, second_at: float) -> None:
    done = drained_at(cluster, name, 0)
    assert done is None or done > second_at, (
        f"world 0 drained {second_at - done:.1f} s before the second request: the timing missed the "
        "overlap this test is about (run it again)")


EARLY = ("--sleep-s", "0.3", "--checkpoint-every", "3")
"""test_early_stop.py's trainer arguments (the later ones win over the manifest's)."""


# test_early_stop.py


@pytest.mark.parametrize("follow", ["agent", "in-process"])
@pytest.mark.parametrize("close", [False, True], ids=["no-close", "close"])
def test_trainers_that_return_early_end_the_job_succeeded(cluster: Cluster, close: bool, follow: str) -> None:
    name = f"ip-early-{'close' if close else 'no-close'}-{follow}"
    start(cluster, name, follow, timeout_seconds=60,
          trainer_args=(*EARLY, "--stop-after", "5", *([] if close else ["--no-close"])))
    wait_for(lambda: len(exits(cluster, name)) == 2, 120, "both trainers to return")
    returned = max(r["t"] for r in exits(cluster, name))
    assert {r["reason"] for r in exits(cluster, name)} == {"stopped"}
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
                      "the TrainersStopped event")
    assert "trainers stopped at global step 5 of 20" in events[-1]["message"], events
    assert ended < ENDED_WITHIN_S and gone < ENDED_WITHIN_S, (ended, gone)
    assert max(complete_checkpoints(cluster.store(name))) == 3
    assert status.get("restarts", 0) == 0
    finish(cluster, name)


@pytest.mark.parametrize("follow", ["agent", "in-process"])
def test_a_rank_that_returns_while_its_peer_trains_fails_the_job_naming_it(cluster: Cluster, follow: str) -> None:
    """Rank 1 returns after step 4; rank 0 goes on into an all-reduce that rank 1 never joins."""
    name = f"ip-early-one-rank-{follow}"
    start(cluster, name, follow, timeout_seconds=20, trainer_args=(*EARLY, "--stop-after", "5", "--stop-rank", "1"))
    wait_for(lambda: exits(cluster, name), 120, "rank 1 to return")
    returned = min(r["t"] for r in exits(cluster, name))
    status = wait_for(lambda: (s := cluster.status(name)).get("phase") == "Failed" and s, 20 + 40,
                      f"{name} to fail")
    took = time.time() - returned
    failed = condition(status, "Failed")
    log(f"{name}: Failed {took:.1f} s after rank 1 returned: {failed.get('message')}")
    assert failed.get("reason") == "RanksStoppedEarly", failed
    assert "rank 1" in failed["message"] and pod(name, 1) in failed["message"], failed
    assert status.get("restarts", 0) == 0 and status.get("worldEpoch") == 0, status
    assert took < 20 + 15
    wait_for(lambda: not running(cluster, name), 60, f"the pods of {name} to stop")
    finish(cluster, name)


@pytest.mark.parametrize("follow", ["agent", "in-process"])
def test_a_rank_that_returns_while_its_peer_waits_fails_the_job_after_the_checkpoint_timeout(
        cluster: Cluster, follow: str) -> None:
    """Rank 1 returns after step 4; rank 0 waits for it for ever (NCCL's all-reduce would)."""
    name = f"ip-early-waiting-peer-{follow}"
    start(cluster, name, follow, timeout_seconds=15,
          trainer_args=(*EARLY, "--stop-after", "5", "--stop-rank", "1", "--peers-wait"))
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
    assert failed["message"].startswith(f"rank 1 (pod {pod(name, 1)}) of world 0 returned (exit 0)"), failed
    assert f"while rank 0 (pod {pod(name, 0)}) still ran 15 s later" in failed["message"], failed
    assert 15 - 2 <= took < 15 + 15, took
    assert status.get("restarts", 0) == 0 and status.get("worldEpoch") == 0, status
    wait_for(lambda: not running(cluster, name), 60, f"the pods of {name} to stop")
    finish(cluster, name)


# test_faults.py


def test_a_killed_sidecar_is_restarted_in_place_and_its_trainer_continues_exactly(cluster: Cluster) -> None:
    name = "ip-kill-sidecar"
    start(cluster, name, sleep_s=0.3, restart_policy="OnFailure", checkpoint_every=5, timeout_seconds=60)
    wait_steps(cluster, name, 0, 6)
    kill(cluster, pod(name, 1), "splitfeed-sidecar")
    wait_for(lambda: container_status(cluster, pod(name, 1), "splitfeed-sidecar")["restartCount"] >= 1,
             30, "the kubelet to restart the sidecar")
    log(f"{name}: sidecar restarted in place")
    status = wait_phase(cluster, name, "Succeeded")
    summary = assert_exact(cluster, name, 1)
    assert status["worldEpoch"] == 0 and status.get("restarts", 0) == 0
    assert [(w.size, w.resume_step, w.ended) for w in summary.worlds] == [(2, 0, END)], summary
    assert summary.replayed == 0, summary
    finish(cluster, name)


def test_a_member_sidecar_killed_for_good_after_the_drain_committed_still_drains_the_world_there(
        cluster: Cluster) -> None:
    """test_faults.py's, in place (the member is `<job>-r1`): `kubectl scale` 2 -> 1; once replica
    1's trainer took batch S - 1 and saw the checkpoint request, its sidecar is SIGKILLed
    (restartPolicy Never: it stays dead). The trainer checkpoints S through the world's
    coordinator; world 1 goes on exactly at S: exact, 0 steps redone, no restart, and announced
    once (the next world's coordinator names the replica in its `status` answer)."""
    name = "ip-kill-member-sidecar"
    start(cluster, name, sleep_s=0.5, timeout_seconds=120)
    member, log_dir = pod(name, 1), cluster.log_dir(name)
    wait_steps(cluster, name, 0, 4)
    scale(cluster, name, 1)

    def rank_1() -> list[dict[str, Any]]:
        path = log_dir / "w0-r1.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    seen = wait_for(lambda: next((r for r in rank_1() if r["event"] == "batch" and r.get("requested")), None),
                    60, "rank 1 to see the drain's checkpoint request")
    step = seen["step"] + 1
    kill(cluster, member, "splitfeed-sidecar")
    late = [r for r in rank_1() if r["event"] == "checkpoint"]
    assert not late, (f"rank 1 checkpointed through its own sidecar before the kill landed ({late}): "
                      "the timing missed what this test is about (run it again)")
    coordinator_log = cluster.kubelet.log_path(NS, pod(name, 0), "splitfeed-sidecar")
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


# issue 21: `kubectl scale` twice within a second


@pytest.mark.parametrize("follow", ["agent", "in-process"])
def test_two_scales_within_a_second_are_merged_or_queued_and_lose_nothing(cluster: Cluster, follow: str) -> None:
    """3 -> 1 and at once -> 2: the job ends with 2 replicas, no world failed, nothing trained twice."""
    name = f"ip-scale-twice-{follow}"
    start(cluster, name, follow, replicas=3)
    wait_steps(cluster, name, 0, 5)
    first = time.time()
    scale(cluster, name, 1)
    scale(cluster, name, 2)
    assert_two_scales_ended_exact(cluster, name, first)


# test_overlapping.py


def test_a_scale_during_a_suspend_drain_is_kept_for_the_resume(cluster: Cluster) -> None:
    name = "ip-scale-in-suspend"
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
    assert [(w.size, w.ended) for w in summary.worlds] == [(2, DRAINED), (3, END)], summary
    assert summary.replayed == 0 and status.get("restarts", 0) == 0, (summary, status)
    finish(cluster, name)


def test_a_suspend_during_a_rescale_drain_suspends_once_and_resumes_with_the_new_count(cluster: Cluster) -> None:
    name = "ip-suspend-in-scale"
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
    assert sizes in ([(2, DRAINED), (3, END)], [(2, DRAINED), (3, DRAINED), (3, END)]), summary
    assert summary.replayed == 0 and status.get("restarts", 0) == 0, (summary, status)
    finish(cluster, name)


def test_a_job_deleted_during_a_drain_leaves_a_checkpoint_that_resume_from_resumes(cluster: Cluster) -> None:
    """test_overlapping.py's, in place: 2 -> 1, then `kubectl delete sj` while world 0 drains.
    The operator deletes the deleted job's pods gracefully at once (operator/cluster/deleting.py): a
    preemption, after which every sidecar ends its world at one agreed step. What in place
    changes: the kept pod may have gone on into world 1 before its SIGTERM came, which then
    drains world 1; so the newest complete checkpoint is a drained (agreed) step of the job's
    last world (world 0 or 1), not necessarily world 0's. Nothing was trained past it, and the
    successor resumes exactly there (the original's assertions)."""
    name, successor = "ip-delete-in-drain", "ip-delete-in-drain-next"
    start(cluster, name, checkpoint_every=3)
    uid = cluster.job(name)["metadata"]["uid"]
    wait_steps(cluster, name, 0, 7)
    scale(cluster, name, 1)
    draining(cluster, name)
    log(f"{name}: kubectl delete sj (during the drain)")
    cluster.kubectl("-n", NS, "delete", "sj", name, "--wait=false")
    deleted = time.time()
    second_request_during_the_drain(cluster, name, deleted)
    wait_for(lambda: not any(k[1].startswith(f"{name}-") for k in cluster.kubelet.pids()), 60,
             f"the processes of {name} to be gone")
    log(f"{name}: its processes were gone {time.time() - deleted:.1f} s after the delete")
    log_dir = cluster.log_dir(name)
    complete = complete_checkpoints(cluster.store(name))
    assert complete, "the deleted job left no complete checkpoint"
    newest = max(complete)
    last = max(w for w in range(3) if list(records(log_dir, w)))
    agreed = {r["step"] for r in records(log_dir, last) if r["event"] == "checkpoint" and r.get("drained")}
    trained = max(r["step"] for w in range(last + 1) for r in records(log_dir, w) if r["event"] == "batch")
    log(f"{name}: complete checkpoints {sorted(complete)}; last world {last} drained at {agreed}; "
        f"last step trained {trained}")
    assert agreed == {newest}, (last, agreed, sorted(complete))
    assert trained == newest - 1, f"trained step {trained} past the newest complete checkpoint {newest}"
    # The trainers keep their models beside their logs: the successor gets its predecessor's.
    shutil.copytree(log_dir / "models", cluster.log_dir(successor) / "models")
    manifest = in_place(cluster.manifest(successor, replicas=2, epochs=1, sleep_s=0.2, timeout_seconds=120), "agent")
    manifest["spec"]["checkpoint"]["resumeFrom"] = {"uid": uid, "name": name}
    cluster.apply(manifest)
    status = wait_phase(cluster, successor, "Succeeded")
    assert status.get("restarts", 0) == 0, status
    assert resume_step(cluster.log_dir(successor), 0) == newest, (newest, status)
    steps = sorted({r["step"] for r in records(cluster.log_dir(successor), 0) if r["event"] == "batch"})
    assert steps == list(range(newest, 20)), steps
    finish(cluster, successor)
