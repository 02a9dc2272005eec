"""A member lost in place (issue 22 item 3): the coordinator ends the world without a drain,
the sidecars' next world, the world file, and `splitfeed run` stopping and restarting its script."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from splitfeed.sidecar.world import agreement
from splitfeed.sidecar.world import transitions
from splitfeed.sidecar.world.settings import SidecarSettings
from splitfeed.trainer_client.script import agent
from splitfeed.trainer_client.contract import wellknown, errors, membership, messages


def coordinator(replicas: int = 3) -> agreement.Coordinator:
    c = agreement.Coordinator(replicas=replicas, total_steps=100, resume_step=0)
    for r in range(replicas):
        c.on_join(f"p{r}".encode(), r)
    return c


def test_a_lost_member_ends_the_world_at_once_and_every_member_is_told_once():
    c = coordinator()
    out = c.on_lost(b"operator", "replace-w0-r2", [2], 3)
    lost = messages.WorldLost(replicas=3, lost=[2])
    assert out == [agreement.Out(agreement.EVERY, lost),
                   agreement.Out(b"operator", messages.DrainAck(token="replace-w0-r2", state=agreement.LOST))]
    assert c.recipients(agreement.EVERY) == [b"p1", b"p2", b"p0"]
    again = c.on_lost(b"operator", "replace-w0-r2", [2], 3)  # the operator asks at every look
    assert again == [agreement.Out(b"operator", messages.DrainAck(token="replace-w0-r2", state=agreement.LOST))]
    # A member that (re)joins the ended world learns it; a drain asked afterwards starts nothing.
    joined = c.on_join(b"p1-again", 1)
    assert joined[1:] == [agreement.Out(b"p1-again", lost)]
    assert c.on_request(b"p1", "preempt-x", "preempt") == [
        agreement.Out(b"p1", messages.DrainAck(token="preempt-x", state=agreement.LOST))]
    assert c.phase == agreement.LOST and c.next_replicas == 3


def test_a_loss_ends_a_drain_round_too_and_zero_replicas_means_the_same_size():
    c = coordinator()
    c.on_request(b"op", "rescale-w0", "rescale", replicas=2)
    assert c.phase == agreement.FREEZING
    out = c.on_lost(b"op", "replace-w0-r1", [1], 0)
    assert out[0].message == messages.WorldLost(replicas=3, lost=[1])
    assert c.on_frozen(0, c.round, 5) == []  # the round is over
    assert c.phase == agreement.LOST


@pytest.mark.parametrize("lost", [[0], [3], [], [True], ["1"]])
def test_replica_0_or_a_replica_outside_the_world_cannot_be_lost(lost):
    with pytest.raises(errors.ProtocolError):
        coordinator().on_lost(b"op", "t", lost, 3)


def settings(replica: int, **kw: object) -> SidecarSettings:
    return SidecarSettings(config=Path("c.json"), socket_dir=Path("s"), rank=replica, world_size=3,
                           replica=replica, coordinator="tcp://job-r0.job:29501", world_epoch=4,
                                master_port=29500, resume_step=12, **kw)  # type: ignore[arg-type]


def test_the_others_go_on_to_the_next_world_from_the_newest_complete_checkpoint_and_the_lost_one_ends():
    lost = messages.WorldLost(replicas=3, lost=[2])
    nxt = transitions.lost_world_next(settings(1), lost, table_version=7)
    assert nxt is not None
    assert (nxt.world_epoch, nxt.world_size, nxt.coordinator, nxt.master_port) == (
        5, 3, "tcp://job-r0.job:29511", 29510)  # the other port of the pair
    assert (nxt.resume_step, nxt.resume, nxt.table_version, nxt.after_loss) == (
        None, wellknown.RESUME_LATEST, 7, True)
    assert transitions.lost_world_next(settings(2), lost, table_version=7) is None


def world(epoch: int, state: str, *, after_loss: bool = False) -> membership.World:
    return membership.World(epoch, state, 0, 3, 3, "h", 29500, after_loss=after_loss)


@pytest.mark.parametrize("written,epoch,expected", [
    (world(4, membership.SERVING), 4, False),
    (world(4, membership.CHANGING), 4, False),
    (world(4, membership.LOST), 4, True),
    (world(5, membership.SERVING, after_loss=True), 4, True),  # the sidecar already moved on
    (world(5, membership.SERVING), 4, False),  # a drain's next world: the script ends on its own
    (world(5, membership.SERVING, after_loss=True), 5, False),  # the world it trains in
    (world(3, membership.LOST), 4, False),
])
def test_a_trainer_stops_only_when_its_own_world_lost_a_pod(tmp_path, written, epoch, expected):
    membership.write(tmp_path, written)
    assert membership.lost(tmp_path, epoch) is expected


SCRIPT = """
import json, os, sys, time
from pathlib import Path
from splitfeed.trainer_client.script import failures
from splitfeed.trainer_client.contract import membership
d = Path(os.environ["SPLITFEED_SOCKET_DIR"])
epoch = int(os.environ["SPLITFEED_WORLD_EPOCH"])
if os.environ.get("HOW") == "launcher":  # torchrun's part: a worker process has the client
    import subprocess
    sys.exit(subprocess.run([sys.executable, "-c", os.environ["SCRIPT"]], env={**os.environ, "HOW": "fails"}).returncode)
failures.install(d, 0, lambda: epoch)  # what StreamClient() installs
with open(d / "runs.jsonl", "a") as f:
    f.write(json.dumps({"epoch": epoch, "pid": os.getpid()}) + "\\n")
membership.mark_trained(d, 0, epoch)
if epoch == 1:
    membership.write(d, membership.World(1, membership.ENDED, 0, 2, 2, "h", 29510))
    sys.exit(0)
if os.environ.get("HOW") == "fails":  # what gloo raises when a peer's pod is gone
    raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                       "[127.0.0.1]:10645. This is typically caused by a remote worker crashing.")
if os.environ.get("HOW") == "own":
    sys.exit(3)  # the script's own failure
if os.environ.get("HOW") == "raises":
    raise ValueError("a bug in the training script")
time.sleep(600)  # stuck in an all-reduce whose peer is gone
"""


def run_agent(directory: Path, how: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`splitfeed run -- python -c SCRIPT` in world 0 of 2, with `directory` as its pod's socket directory."""
    return subprocess.run(
        [sys.executable, "-m", "splitfeed.trainer_client.cli", "run", "--", sys.executable, "-c", SCRIPT],
        env={**os.environ, wellknown.SOCKET_DIR_ENV: str(directory), wellknown.WORLD_EPOCH_ENV: "0",
             wellknown.WORLD_SIZE: "2", wellknown.MASTER_PORT_ENV: "29500", "HOW": how, "SCRIPT": SCRIPT},
        capture_output=True, text=True, timeout=timeout_s)


def lose_world_0(directory: Path, after_s: float) -> threading.Thread:
    """What the sidecar does when its coordinator says `world_lost`: LOST, then the next world,
    `after_s` after the script of world 0 began (a loss before it ran would find nothing to stop:
    under load an interpreter's start alone can take longer than `after_s`)."""
    def run() -> None:
        runs = directory / "runs.jsonl"
        deadline = time.monotonic() + 60
        while not (runs.exists() and runs.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(after_s)
        membership.write(directory, membership.World(0, membership.LOST, 0, 2, 2, "h", 29500))
        time.sleep(0.3)
        membership.write(directory, membership.World(1, membership.SERVING, 0, 2, 2, "h", 29510, after_loss=True))
    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("how", ["stuck", "fails", "launcher"])
def test_the_agent_starts_the_script_again_in_the_next_world_when_its_world_lost_a_pod(tmp_path, how):
    membership.write(tmp_path, membership.World(0, membership.SERVING, 0, 2, 2, "h", 29500))
    (tmp_path / messages.SOCKET_NAME).touch()  # a sidecar serves: it can still say what comes next
    sidecar = lose_world_0(tmp_path, 1.5)
    began = time.monotonic()
    done = run_agent(tmp_path, how, timeout_s=60)
    sidecar.join()
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert done.returncode == 0, done.stderr
    assert [r["epoch"] for r in runs] == [0, 1], (runs, done.stderr)
    assert time.monotonic() - began < 30  # a stuck script is stopped, not waited for
    if how == "stuck":
        assert "stopping" in done.stderr


def test_a_script_that_fails_without_a_serving_sidecar_ends_the_agent_at_once(tmp_path):
    membership.write(tmp_path, membership.World(0, membership.SERVING, 0, 2, 2, "h", 29500))
    done = run_agent(tmp_path, "fails", timeout_s=30)
    assert done.returncode == 1


@pytest.mark.parametrize("how, code", [("own", 3), ("raises", 1)])
def test_a_script_that_fails_of_its_own_ends_the_agent_with_its_code_while_the_sidecar_serves(tmp_path, how, code):
    membership.write(tmp_path, membership.World(0, membership.SERVING, 0, 2, 2, "h", 29500))
    (tmp_path / messages.SOCKET_NAME).touch()  # a sidecar serves, and would say a loss: nobody waits for it
    began = time.monotonic()
    done = run_agent(tmp_path, how, timeout_s=120)
    assert done.returncode == code, done.stderr
    assert time.monotonic() - began < agent.LOSS_WAIT_S / 2, "the agent waited for a loss nobody will say"
    assert "failed on its own" in done.stderr
    if how == "raises":
        assert "ValueError: a bug in the training script" in done.stderr  # the script's traceback, as python prints it


def test_the_world_file_says_after_loss_and_an_older_file_without_it_reads_as_false(tmp_path):
    membership.write(tmp_path, world(5, membership.SERVING, after_loss=True))
    assert membership.read(tmp_path) == world(5, membership.SERVING, after_loss=True)
    fields = dataclasses.asdict(world(5, membership.SERVING))
    del fields["after_loss"]
    (tmp_path / membership.FILE).write_text(json.dumps(fields))
    assert membership.read(tmp_path) == world(5, membership.SERVING)


def test_a_failed_trainer_waits_for_its_sidecars_word_only_while_the_sidecar_serves(tmp_path):
    membership.write(tmp_path, world(4, membership.SERVING))
    assert membership.wait_lost(tmp_path, 4, timeout_s=30) is False  # no sidecar bound: nobody will say
    (tmp_path / messages.SOCKET_NAME).touch()
    began = time.monotonic()
    assert membership.wait_lost(tmp_path, 4, timeout_s=0.3) is False  # it serves on: the failure is the trainer's
    assert 0.3 <= time.monotonic() - began < 5
    assert membership.wait_lost(tmp_path, 4, timeout_s=30, stop=lambda: True) is False  # SIGTERM: no wait
    sidecar = threading.Timer(0.3, membership.write, (tmp_path, world(4, membership.LOST)))
    sidecar.start()
    assert membership.wait_lost(tmp_path, 4, timeout_s=30) is True
    sidecar.join()


def test_the_next_worlds_interpreter_imports_once_the_script_said_hello(tmp_path, monkeypatch):
    """A change asked a few steps into a world finds the spare ready: it starts at the script's
    first hello (its imports are done), not SPARE_AFTER_S into the world (set out of reach here)."""
    monkeypatch.setattr(agent, "SPARE_AFTER_S", 600.0)
    membership.write(tmp_path, membership.World(0, membership.SERVING, 0, 2, 2, "h", 29500))
    script = tmp_path / "train.py"
    script.write_text("import os, sys, time\nfrom pathlib import Path\n"
                      "from splitfeed.trainer_client.contract import membership\n"
                      "time.sleep(0.5)\nmembership.mark_waiting(Path(sys.argv[1]), 0)  # what hello() does\n"
                      "time.sleep(2)\n")
    membership.mark_waiting(tmp_path, 0)  # the run before said hello long ago: not this run's
    os.utime(tmp_path / membership.WAITING.format(local_rank=0), (time.time() - 60, time.time() - 60))
    argv = [sys.executable, str(script), str(tmp_path)]
    spare = agent.Spare(argv)
    since = time.time()
    process = subprocess.Popen(argv)
    try:
        seen = []
        monkeypatch.setattr(spare, "prepare", lambda real=spare.prepare: (seen.append(time.monotonic()), real())[1])
        began = time.monotonic()
        assert agent._watch(process, tmp_path, 0, 0, [], spare, since) is False
        assert spare.process is not None and len(seen) == 1, "no spare started while the script trained"
        assert seen[0] - began >= 0.4  # not at once: the stale hello of the run before did not count
    finally:
        spare.close()
