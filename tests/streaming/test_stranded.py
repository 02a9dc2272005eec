"""A member's sidecar killed for good after its world committed a drain step (issue 21 item 2).

`restartPolicy: Never` with plain sidecar containers: a SIGKILLed sidecar stays dead. Three
`splitfeed sidecar` processes and three real DDP trainers (gloo, tests/e2e/trainer.py); the world
is asked to drain (a rescale 3 -> 2, what the operator asks), and once the drain step S is
committed and replica 2's sidecar has published batch S - 1 into its trainer's ring, that sidecar
is SIGKILLed before its trainer reached S. The trainer takes the batches already in shared
memory, sees the checkpoint request, finds its sidecar gone and checkpoints S through the world's
coordinator (replica 0's sidecar: trainer_client.stranded, sidecar.standins). S is complete; the
next world (2 sidecars and trainers, what the operator starts, resuming from the newest complete
checkpoint) starts exactly at S: 0 steps redone, every batch equal to lancedb's
StreamingDataset's for its world size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from splitfeed.sidecar.world import agreement, wire
from splitfeed.sidecar import main as sidecar_main
from splitfeed.trainer_client.contract import wellknown, messages
from splitfeed.trainer_client.transport import ring, stranded, worlds
from splitfeed.trainer_client.contract.errors import CheckpointError
from tests.streaming.harness import manifest, pods, reference_batches, socket_root, table_uri  # noqa: F401
from tests.support.tables import check_exact
from tests.support import exactness, ports, processes
from tests.support.waiting import wait_for
from tests.support.keys import session_keypair

pytestmark = pytest.mark.timeout(300)

E2E_TRAINER = Path(__file__).parents[1] / "e2e" / "trainer.py"
EPOCHS = 2
DRAIN_AT = 12
"""The drain step asked for (`not_before`): mid-epoch 0 of 20 steps, well after the start."""
KILLED = 2


def trainer(pod, logs: Path, replicas: int, replica: int, master_port: int, epoch: int) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    """The pod's trainer container: tests/e2e/trainer.py with the pod's environment."""
    env = {**os.environ, **wellknown.rank_env(
        world_size=replicas, gpus_per_replica=1, replica=replica, local_rank=0, master_addr=wellknown.LOOPBACK,
        master_port=master_port, socket_dir=str(pod.socket_dir), world_epoch=epoch)}
    with open(pod.dir / "trainer.log", "ab") as out:  # the child holds its own descriptor
        return subprocess.Popen([sys.executable, str(E2E_TRAINER), str(logs), "--sleep-s", "0.15", "--timeout-s", "60"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=processes.die_with_parent())


def world(pods, job: dict, logs: Path, replicas: int, epoch: int, resume: str):  # type: ignore[no-untyped-def]
    """`replicas` sidecar processes and their trainers for world `epoch`."""
    coordinator, master_port = ports.tcp_address(), ports.free_port()
    sidecars = [pods(f"r{r}-w{epoch}", job, replicas=replicas, replica=r, coordinator=coordinator,
                     resume=resume, world_epoch=epoch).start_process() for r in range(replicas)]
    trainers = [trainer(sidecars[r], logs, replicas, r, master_port, epoch) for r in range(replicas)]
    return coordinator, sidecars, trainers


def last_step(logs: Path, epoch: int, rank: int) -> int:
    """The last global step rank `rank` of world `epoch` logged (-1: none yet)."""
    path = logs / f"w{epoch}-r{rank}.jsonl"
    steps = [json.loads(line).get("step", -1) for line in path.read_text().splitlines()] if path.exists() else []
    return max(steps, default=-1)


def published(socket_dir: Path, step: int) -> bool:
    """Batch `step` is in the ring of the pod's rank (its control block says where)."""
    for path in socket_dir.glob("ctl-*-r0"):
        control = ring.Control(path, create=False)
        try:
            if control.find(step) is not None:
                return True
        finally:
            control.close()
    return False


def test_a_member_sidecar_killed_for_good_after_the_drain_committed_still_ends_the_world_at_the_drain_step(
        pods, table_uri, tmp_path):  # noqa: F811
    logs, store = tmp_path / "logs", tmp_path / "ckpt"
    job = manifest(table_uri, str(store), epochs=EPOCHS)
    coordinator, sidecars, trainers = world(pods, job, logs, 3, 0, "none")
    try:
        wait_for(lambda: last_step(logs, 0, 0) >= 1, 120, "world 0's trainers to train")
        wait_for(lambda: worlds.request_drain(coordinator, "rescale-w0", "rescale", timeout_s=2,
                                              not_before=DRAIN_AT) == agreement.COMMITTED,
                 20, "the drain committed")
        answer = worlds.request_status(coordinator, timeout_s=5)
        assert answer is not None and answer.drain_step is not None
        step = answer.drain_step
        wait_for(lambda: published(sidecars[KILLED].socket_dir, step - 1), 60,
                 f"replica {KILLED}'s sidecar to publish batch {step - 1}")
        reached = last_step(logs, 0, KILLED)
        if reached >= step - 1:  # it may have asked its own sidecar already: nothing would be shown
            pytest.fail(f"the kill came late: rank {KILLED} had logged step {reached} of drain step {step}; "
                        "slow the trainers (--sleep-s) or ask for a later DRAIN_AT")
        sidecars[KILLED].kill()  # SIGKILL, and never restarted
        for proc in trainers:
            assert proc.wait(120) == 0
        for pod in sidecars[:KILLED]:
            assert pod.wait(90) == 0
        coordinator_log = (sidecars[0].dir / "sidecar.log").read_text()
        assert f"wrote rank {KILLED}'s commit marker at drain step {step}" in coordinator_log, coordinator_log[-3000:]
        assert step in exactness.complete_checkpoints(store)
        # What the operator reads to resume exactly at S though replica 2 left no report.
        assert json.loads(sidecars[0].termination_log.read_text())["completeStep"] == step
        _, next_sidecars, next_trainers = world(pods, job, logs, 2, 1, "latest")  # the scale 3 -> 2
        trainers += next_trainers
        for proc in next_trainers:
            assert proc.wait(180) == 0
        for pod in next_sidecars:
            assert pod.wait(60) == 0
    finally:
        for proc in trainers:
            processes.stop(proc)
    summary = check_exact(logs, store, table_uri, {"epochs": EPOCHS})
    assert [(w.size, w.ended, w.agreed_step) for w in summary.worlds] == [
        (3, exactness.DRAINED, step), (2, exactness.END, None)], summary
    assert summary.worlds[1].resume_step == step and summary.replayed == 0, summary  # 0 steps redone


def test_the_coordinator_writes_what_it_accepts_and_refuses_the_rest_with_its_reason_over_zeromq():
    """Real ZeroMQ, no data: the coordinator thread with a store stand-in that records each write;
    a request for another step is refused with the reason, and nothing is written for it."""
    coordinator = agreement.Coordinator(replicas=2, total_steps=40, resume_step=0, world_epoch=0)
    for replica in (0, 1):
        coordinator.on_join(f"m{replica}".encode(), replica)
    coordinator.on_request(b"operator", "rescale-w0", "rescale")
    coordinator.on_frozen(0, coordinator.round, 5)
    coordinator.on_frozen(1, coordinator.round, 6)
    coordinator.on_committed(0, 8)
    written: list[messages.StandIn] = []

    def write(request: messages.StandIn) -> str:
        written.append(request)
        return f"store/step-{request.step}/rank-{request.rank}"

    thread = wire.CoordinatorThread(coordinator, ports.tcp_address(), keys=session_keypair(),
                                       stand_in=write, world_size=2)
    try:
        ask = messages.StandIn(rank=1, world_size=2, world_epoch=0, step=8)
        with pytest.raises(CheckpointError, match="step 7 is not world 0's drain step 8"):
            stranded.ask(thread.address, messages.StandIn(rank=1, world_size=2, world_epoch=0, step=7),
                         messages.Checkpointed, 5)
        with pytest.raises(CheckpointError, match="checkpoint before commit"):
            stranded.ask(thread.address, messages.StandIn(rank=1, world_size=2, world_epoch=0, step=8, commit=True),
                         messages.Committed, 5)
        assert written == []
        got = stranded.ask(thread.address, ask, messages.Checkpointed, 5)
        assert got == messages.Checkpointed(step=8, drained=True, uri="store/step-8/rank-1")
        assert stranded.ask(thread.address, messages.StandIn(rank=1, world_size=2, world_epoch=0, step=8, commit=True),
                            messages.Committed, 5) == messages.Committed(step=8)
        assert [(w.rank, w.step, w.commit) for w in written] == [(1, 8, False), (1, 8, True)]
        assert coordinator.complete_step == 8  # replica 1 counted through its ranks' stand-ins
    finally:
        thread.close()


def replica_zero(complete: int | None) -> tuple[types.SimpleNamespace, sidecar_main.Signals]:
    """What `wait_for_members` reads of replica 0's sidecar: its coordinator's complete step (and no store)."""
    coordinator = types.SimpleNamespace(complete_step=complete)
    return (types.SimpleNamespace(coordinator=types.SimpleNamespace(coordinator=coordinator), stores=[]),
            sidecar_main.Signals())


@pytest.mark.parametrize("ends", ["the-last-member-commits", "a-sigterm-comes"])
def test_replica_zero_keeps_the_coordinator_up_until_every_member_committed_or_its_pod_is_deleted(
        monkeypatch, ends):
    monkeypatch.setattr(sidecar_main, "STAND_IN_WAIT_S", 30.0)
    sidecar, signals = replica_zero(complete=4)
    signals.times.append(time.monotonic())  # the SIGTERM that asked for this drain (a preemption)
    drained = {"drained": True, "agreedStep": 9}

    def later() -> None:
        time.sleep(0.3)
        if ends == "the-last-member-commits":
            sidecar.coordinator.coordinator.complete_step = 9
        else:
            signals.times.append(time.monotonic())

    helper = threading.Thread(target=later)
    started = time.monotonic()
    helper.start()
    sidecar_main.wait_for_members(sidecar, drained, signals)  # type: ignore[arg-type]
    waited = time.monotonic() - started
    helper.join()
    assert 0.25 < waited < 5
    started = time.monotonic()
    sidecar_main.wait_for_members(replica_zero(complete=9)[0], drained, signals)  # type: ignore[arg-type]
    sidecar_main.wait_for_members(sidecar, {"drained": False, "agreedStep": None}, signals)  # type: ignore[arg-type]
    assert time.monotonic() - started < 0.2  # nothing to wait for
