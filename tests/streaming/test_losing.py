"""A member lost in place (issue 22 item 3), without an operator: the test does what the operator
does. Three `splitfeed sidecar` processes and three real DDP trainers (gloo), under `splitfeed run`
or following the world in their own process (catching the collective's failure and calling
`client.rejoin(failed=True)`); replica 2's sidecar and trainer are killed mid-world; world 0's
coordinator is told (`drain_request` with `lost`); a new sidecar and trainer for replica 2 start in
world 1. The other two sidecars and trainer containers are never restarted: they go on in world 1
from the newest complete checkpoint, and the trainers' batches are exact against lancedb's
StreamingDataset for each world."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from splitfeed.trainer_client.contract import wellknown, layout, membership
from splitfeed.trainer_client.transport import ring, worlds
from splitfeed.trainer_client.script.client import StreamClient
from splitfeed.trainer_client.contract.errors import WorldLost
from tests.streaming.harness import manifest, pods, reference_batches, socket_root, table_uri  # noqa: F401
from tests.support.tables import check_exact
from tests.support import exactness, ports, processes
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(300)

E2E_TRAINER = Path(__file__).parents[1] / "e2e" / "trainer.py"
EPOCHS = 2


def agent(pod, logs: Path, replica: int, master_port: int, epoch: int, how: str) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    """The pod's trainer container with the pod's environment: `splitfeed run -- python trainer.py`
    (agent), or the trainer itself following the world in its process (in-process)."""
    env = {**os.environ, **wellknown.rank_env(
        world_size=3, gpus_per_replica=1, replica=replica, local_rank=0, master_addr=wellknown.LOOPBACK,
        master_port=master_port, socket_dir=str(pod.socket_dir), world_epoch=epoch)}
    trainer = [sys.executable, str(E2E_TRAINER), str(logs), "--sleep-s", "0.2", "--checkpoint-every", "3",
               "--timeout-s", "60"]
    argv = ([sys.executable, "-m", "splitfeed.trainer_client.cli", "run", "--", *trainer] if how == "agent"
            else [*trainer, "--in-place"])
    with open(pod.dir / "agent.log", "ab") as out:  # the child holds its own descriptor
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=processes.die_with_parent())


def start_pod(pods, job: dict, name: str, replica: int, coordinator: str, master_port: int,  # type: ignore[no-untyped-def]
              epoch: int, resume: str):
    pod = pods(name, job, replicas=3, replica=replica, coordinator=coordinator, resume=resume, world_epoch=epoch)
    pod.env.update({wellknown.MASTER_ADDR: wellknown.LOOPBACK, wellknown.MASTER_PORT_ENV: str(master_port)})
    return pod.start_process()


def started(logs: Path) -> dict[tuple[int, int], int]:
    """(world, rank) -> the PID of the trainer process that started it."""
    found = {}
    for path in sorted(logs.glob("w*-r*.jsonl")):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "start":
                found[(event["world"], event["rank"])] = event["pid"]
    return found


@pytest.mark.parametrize("how", ["agent", "in-process"])
def test_a_member_killed_mid_world_is_replaced_alone_and_the_others_go_on_in_place_exactly(
        pods, table_uri, tmp_path, how):  # noqa: F811
    logs, store = tmp_path / "logs", tmp_path / "ckpt"
    job = manifest(table_uri, str(store), epochs=EPOCHS)
    coordinator, master_port = ports.tcp_address(), ports.free_port()
    sidecars = [start_pod(pods, job, f"r{r}", r, coordinator, master_port, 0, "none") for r in range(3)]
    agents = [agent(sidecars[r], logs, r, master_port, 0, how) for r in range(3)]
    try:
        wait_for(lambda: max(exactness.complete_checkpoints(store), default=-1) >= 6, 120,
                 "world 0 to complete the checkpoint of step 6")
        for pid in [*processes.children(agents[2].pid), agents[2].pid]:  # replica 2's pod is lost
            os.kill(pid, signal.SIGKILL)
        sidecars[2].kill()
        agents[2].wait()
        # What the operator does: tell world 0's coordinator, then start replica 2's pod of world 1.
        assert worlds.request_drain(coordinator, "replace-w0-r2", "replace", replicas=3, lost=[2]) == "lost"
        host, _, port = coordinator.rpartition(":")
        following = f"{host}:{layout.next_port(int(port), 0)}"
        new = start_pod(pods, job, "r2-w1", 2, following, layout.next_port(master_port, 0), 1, "latest")
        agents.append(agent(new, logs, 2, layout.next_port(master_port, 0), 1, how))
        for proc in (agents[0], agents[1], agents[3]):
            assert proc.wait(180) == 0
        for pod in (sidecars[0], sidecars[1], new):
            assert pod.wait(60) == 0
    finally:
        for proc in agents:
            processes.stop(proc)
    summary = check_exact(logs, store, table_uri, {"epochs": EPOCHS})
    assert [(w.size, w.ended) for w in summary.worlds] == [(3, exactness.FAILED), (3, exactness.END)], summary
    assert summary.worlds[1].resume_step >= 6, summary  # the newest complete checkpoint, chosen once
    pids = started(logs)
    if how == "agent":
        assert pids[(1, 0)] != pids[(0, 0)] and pids[(1, 1)] != pids[(0, 1)]  # the agents started them again
    else:  # the trainers caught their collective's failure and rejoined in their own process
        assert pids[(1, 0)] == pids[(0, 0)] and pids[(1, 1)] == pids[(0, 1)], pids
    for pod in sidecars[:2]:  # ... under sidecars that served both worlds in one process
        text = (pod.dir / "sidecar.log").read_text()
        assert "world 1 follows in place" in text and "lost replicas [2]" in text, text[-2000:]


def test_a_trainer_that_talks_to_its_sidecar_after_the_world_was_lost_is_told_so_and_never_joins_the_next_world_midway(
        pods, table_uri, tmp_path, monkeypatch):  # noqa: F811
    """The race behind a CI failure: world 0 is lost while a surviving rank's trainer is between
    collectives (checkpointing, or waiting for a batch). Its next word to the sidecar reaches the
    next world's server, which never welcomed it. It must be told that its world ended (WorldLost,
    a RuntimeError as a failed collective is), and must not be welcomed into world 1 at its own
    next step: world 1 starts from the newest complete checkpoint, which `rejoin(failed=True)`
    then gives it, exactly lancedb's batches from there. Trainers here are StreamClients driven
    by the test, so that the order of events is the test's, not the scheduler's."""
    store = tmp_path / "ckpt"
    job = manifest(table_uri, str(store), epochs=EPOCHS)
    coordinator, master_port = ports.tcp_address(), ports.free_port()
    sidecars = [start_pod(pods, job, f"r{r}", r, coordinator, master_port, 0, "none") for r in range(3)]
    monkeypatch.setenv(wellknown.WORLD_EPOCH_ENV, "0")  # the trainers' pods are world 0's
    clients = [StreamClient(pod.socket_dir, 0, timeout_s=60, as_tensors=False) for pod in sidecars]
    try:
        for _ in range(3):
            [next(c) for c in clients]
        assert [c.checkpoint() for c in clients] == [3, 3, 3]
        for c in clients:
            c.commit(3)
        for _ in range(2):  # steps 3 and 4 taken; world 0 goes on past its checkpoint
            [next(c) for c in clients[:2]]
        sidecars[2].kill()  # replica 2's pod is lost; the test does what the operator does
        clients[2].close()
        assert worlds.request_drain(coordinator, "replace-w0-r2", "replace", replicas=3, lost=[2]) == "lost"
        host, _, port = coordinator.rpartition(":")
        following = f"{host}:{layout.next_port(int(port), 0)}"
        new = start_pod(pods, job, "r2-w1", 2, following, layout.next_port(master_port, 0), 1, "latest")
        for pod in sidecars[:2]:
            wait_for(lambda: (w := membership.read(pod.socket_dir)) is not None and w.epoch == 1
                     and w.state == membership.SERVING, 60, f"{pod.dir.name} to serve world 1")
        with pytest.raises(WorldLost, match="ended"):
            clients[1].checkpoint()  # its Checkpoint reaches world 1's server, which never welcomed it
        with pytest.raises(WorldLost, match="ended"):
            for _ in range(ring.MAX_SLOTS + 1):  # what world 0 left in its ring, then its sidecar's word
                next(clients[0])
        assert isinstance(WorldLost("x"), RuntimeError)  # what the README's loop catches
        joined = [c.rejoin(timeout_s=60, failed=True) for c in clients[:2]]
        assert [(w.epoch, w.world_size) if w else None for w in joined] == [(1, 3), (1, 3)]
        clients[2] = StreamClient(new.socket_dir, 0, timeout_s=60, as_tensors=False)
        assert [c.resume_step for c in clients] == [3, 3, 3]
        for rank, client in enumerate(clients):
            got = [next(client)["id"].tolist() for _ in range(4)]
            assert got == reference_batches(table_uri, {"epochs": EPOCHS}, 3, rank)[3:7], rank
    finally:
        for c in clients:
            c.close()
