"""The world file between a pod's sidecar and its trainer side (trainer_client.membership),
and `splitfeed run` (the agent) following it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from splitfeed.trainer_client.contract import wellknown, layout, membership
from splitfeed.trainer_client.script import groups


def world(epoch: int, state: str = membership.SERVING, size: int = 4, port: int = 29500) -> membership.World:
    return membership.World(epoch=epoch, state=state, rank=2, world_size=size, replicas=size,
                            master_addr="job-0.job", master_port=port, resume_step=7 * epoch)


def test_consecutive_worlds_alternate_between_two_ports():
    ports = [layout.world_port(29500, e) for e in range(4)]
    assert ports == [29500, 29510, 29500, 29510]
    assert [layout.next_port(ports[e], e) for e in range(3)] == ports[1:]


def test_a_world_gives_a_trainer_the_environment_a_new_pod_of_it_would_get():
    base = {wellknown.LOCAL_RANK: "0", wellknown.LOCAL_WORLD_SIZE: "1", "PATH": "/bin", wellknown.WORLD_SIZE: "2"}
    env = membership.world_env(base, world(3, size=3, port=29510))
    assert env[wellknown.WORLD_SIZE] == "3" and env[wellknown.RANK] == "2" and env[wellknown.NODE_RANK] == "2"
    assert env[wellknown.MASTER_PORT_ENV] == "29510" and env[wellknown.WORLD_EPOCH_ENV] == "3"
    assert env["PATH"] == "/bin" and "PET_NNODES" not in env  # torchrun's only where the pod has them
    several = membership.world_env({**base, "PET_NNODES": "2", "PET_MASTER_PORT": "29500",
                                    wellknown.LOCAL_WORLD_SIZE: "2", wellknown.LOCAL_RANK: "1"},
                                   membership.World(3, membership.SERVING, 2, 6, 3, "h", 29510))
    assert several["PET_NNODES"] == "3" and several["PET_MASTER_PORT"] == "29510"
    assert several[wellknown.RANK] == "3"  # replica 1's second GPU


def test_the_file_is_read_back_whole_and_an_unwritten_one_is_none(tmp_path):
    assert membership.read(tmp_path) is None
    membership.write(tmp_path, world(2))
    assert membership.read(tmp_path) == world(2)
    (tmp_path / membership.FILE).write_text("{not json")
    assert membership.read(tmp_path) is None


@pytest.mark.parametrize("state, epoch, after, expected", [
    (membership.SERVING, 1, 1, None),             # the script stopped on its own: no next world
    (membership.ENDED, 1, 1, None),
    (membership.LEFT, 2, 1, None),                # a scale-down left this pod out
    (membership.SERVING, 2, 1, 2),                # the next world serves
    (membership.CHANGING, 2, 1, 2),               # ... and already drains for the one after it
])
def test_what_a_stopped_trainer_does_next(tmp_path, state, epoch, after, expected):
    membership.write(tmp_path, world(epoch, state))
    found = membership.next_world(tmp_path, after=after, timeout_s=1)
    assert (found.epoch if found else None) == expected


def test_a_trainer_of_a_world_that_changes_waits_for_the_next_one(tmp_path):
    membership.write(tmp_path, world(1, membership.CHANGING))
    threading.Timer(0.3, membership.write, (tmp_path, world(2, size=3))).start()
    started = time.monotonic()
    found = membership.next_world(tmp_path, after=1, timeout_s=10)
    assert found == world(2, size=3) and time.monotonic() - started >= 0.25
    membership.write(tmp_path, world(2, membership.CHANGING))
    with pytest.raises(TimeoutError, match="did not start the next world"):
        membership.next_world(tmp_path, after=2, timeout_s=0.2)


SCRIPT = """
import json, os, sys
from pathlib import Path
from splitfeed.trainer_client.contract import membership
d = Path(os.environ["SPLITFEED_SOCKET_DIR"])
with open(d / "runs.jsonl", "a") as f:
    f.write(json.dumps({k: os.environ[k] for k in ("WORLD_SIZE", "MASTER_PORT", "SPLITFEED_WORLD_EPOCH")}) + "\\n")
epoch = int(os.environ["SPLITFEED_WORLD_EPOCH"])
membership.mark_trained(d, 0, epoch)
plan = json.loads((d / "plan.json").read_text())  # what the sidecar does once this run ends
nxt = plan.get(str(epoch))
if nxt is not None:
    membership.write(d, membership.World(**nxt))
sys.exit(int(os.environ.get("EXIT_AT_" + str(epoch), "0")))
"""


def agent(tmp_path: Path, plan: dict, **env: str) -> tuple[int, list[dict]]:
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    membership.write(tmp_path, world(0, size=4, port=29500))
    done = subprocess.run(
        [sys.executable, "-m", "splitfeed.trainer_client.cli", "run", "--", sys.executable, "-c", SCRIPT],
        env={**__import__("os").environ, wellknown.SOCKET_DIR_ENV: str(tmp_path), wellknown.WORLD_EPOCH_ENV: "0",
             wellknown.WORLD_SIZE: "4", wellknown.MASTER_PORT_ENV: "29500", **env},
        capture_output=True, text=True, timeout=60)
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    return done.returncode, runs


def as_dict(w: membership.World) -> dict:
    import dataclasses

    return dataclasses.asdict(w)


def test_the_agent_starts_the_script_again_in_each_world_until_none_follows(tmp_path):
    code, runs = agent(tmp_path, {"0": as_dict(world(1, size=2, port=29510)),
                                  "1": as_dict(world(2, size=3, port=29500)),
                                  "2": as_dict(world(2, membership.ENDED, size=3))})
    assert code == 0
    assert runs == [{"WORLD_SIZE": "4", "MASTER_PORT": "29500", "SPLITFEED_WORLD_EPOCH": "0"},
                    {"WORLD_SIZE": "2", "MASTER_PORT": "29510", "SPLITFEED_WORLD_EPOCH": "1"},
                    {"WORLD_SIZE": "3", "MASTER_PORT": "29500", "SPLITFEED_WORLD_EPOCH": "2"}]


def test_the_agent_ends_with_the_scripts_failure_and_a_left_pod_ends_cleanly(tmp_path):
    code, runs = agent(tmp_path, {"0": as_dict(world(1, size=2, port=29510))}, EXIT_AT_1="3")
    assert code == 3 and len(runs) == 2  # a failure is the pod's: never started again
    left = tmp_path / "left"
    left.mkdir()
    code, runs = agent(left, {"0": as_dict(world(0, membership.LEFT))}, EXIT_AT_0="1")
    assert code == 0 and len(runs) == 1  # out of the world: whatever the script said, the pod is done


WARM_SCRIPT = """
import json, os, sys, time
from pathlib import Path
from splitfeed.trainer_client.contract import membership
d = Path(os.environ["SPLITFEED_SOCKET_DIR"])
epoch = int(os.environ["SPLITFEED_WORLD_EPOCH"])
started = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
with open(d / "runs.jsonl", "a") as f:
    f.write(json.dumps({"epoch": epoch, "size": os.environ["WORLD_SIZE"], "argv": sys.argv,
                        "file": __file__, "warm": "torch" in sys.modules, "pid": os.getpid(),
                        "dynamo": "torch._dynamo" in sys.modules, "process_started": started}) + "\\n")
membership.mark_trained(d, 0, epoch)
if epoch < 2:  # the sidecar says a change comes, then serves the next world
    membership.write(d, membership.World(epoch, membership.CHANGING, 0, 4, 4, "h", 29500))
    time.sleep(0.5)
    membership.write(d, membership.World(epoch + 1, membership.SERVING, 0, 3 - epoch, 3 - epoch, "h", 29500))
else:
    membership.write(d, membership.World(epoch, membership.ENDED, 0, 2, 2, "h", 29500))
with open(d / "ends.jsonl", "a") as f:  # the time since boot, as /proc/PID/stat's start times
    f.write(json.dumps(time.clock_gettime(time.CLOCK_BOOTTIME)) + "\\n")
"""


def test_a_python_script_runs_next_in_an_interpreter_that_imported_torch_while_the_world_before_trained(tmp_path):
    import os

    script = tmp_path / "train.py"
    script.write_text(WARM_SCRIPT)
    membership.write(tmp_path, world(0, size=4))
    done = subprocess.run(
        [sys.executable, "-m", "splitfeed.trainer_client.cli", "run", "--", sys.executable, str(script), "--lr", "1"],
        env={**os.environ, wellknown.SOCKET_DIR_ENV: str(tmp_path), wellknown.WORLD_EPOCH_ENV: "0",
             wellknown.WORLD_SIZE: "4", wellknown.MASTER_PORT_ENV: "29500"},
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["size"]) for r in runs] == [(0, "4"), (1, "3"), (2, "2")]
    ends = [json.loads(line) for line in (tmp_path / "ends.jsonl").read_text().splitlines()]
    # the next world's interpreter was started while the script of the world before still ran
    assert [r["process_started"] < end for r, end in zip(runs[1:], ends)] == [True, True], (runs, ends)
    assert all(r["warm"] and r["dynamo"] for r in runs)  # torch and what DDP's constructor imports lazily
    assert all(r["argv"] == [str(script), "--lr", "1"] and r["file"] == str(script) for r in runs), runs


def test_a_restarted_sidecar_joins_the_world_its_pod_is_in_not_the_one_it_was_created_for(tmp_path):
    from splitfeed.sidecar.world.settings import SidecarSettings
    from splitfeed.sidecar.world.transitions import adopt_world

    created = SidecarSettings(config=tmp_path / "c.json", socket_dir=tmp_path, rank=2, world_size=4, world_epoch=1,
                              coordinator="tcp://job-r0.job:29511", master_port=29510, resume_step=7)
    now = membership.World(epoch=4, state=membership.SERVING, rank=2, world_size=3, replicas=3,
                           master_addr="job-r0.job", master_port=29500, resume_step=40)
    adopted = adopt_world(created, now)
    assert (adopted.world_epoch, adopted.world_size, adopted.coordinator, adopted.master_port, adopted.resume_step) \
        == (4, 3, "tcp://job-r0.job:29501", 29500, None)
    odd = adopt_world(created, membership.World(**{**as_dict(now), "epoch": 5, "master_port": 29510}))
    assert (odd.coordinator, odd.master_port) == ("tcp://job-r0.job:29511", 29510)
    for stale in ({"epoch": 1}, {"rank": 0}, {"state": membership.ENDED}, {"state": membership.LEFT}):
        assert adopt_world(created, membership.World(**{**as_dict(now), **stale})) == created, stale
    assert adopt_world(created, None) == created


QUICK_EXIT_SCRIPT = """
import atexit, gc, json, os, sys
from pathlib import Path
out = Path(sys.argv[1])

class Cyclic:  # garbage only the cyclic collector frees: the script's model, hooks, buffers
    def __init__(self):
        self.me = self
    def __del__(self):
        (out / "finalized").write_text("yes")

held = Cyclic()  # reachable until the exit (through the handler below): python finalizes it then
frozen = gc.get_freeze_count()
atexit.register(lambda: (out / "at-exit.json").write_text(json.dumps(
    {"frozen": frozen, "main": sys.modules["__main__"].__name__, "torch": "torch" in sys.modules})))
sys.exit(int(os.environ["EXIT_CODE"]))
"""


@pytest.mark.parametrize("exit_code", [0, 3])
def test_a_script_the_agent_runs_starts_with_torch_frozen_and_its_own_objects_are_finalized(tmp_path, exit_code):
    """The interpreter's last collections over torch's objects took 0.4-0.7 s of each world
    change (agent.AHEAD): they are frozen before the script runs, and the script's objects
    are collected and finalized at the exit as python would."""
    import os

    script = tmp_path / "train.py"
    script.write_text(QUICK_EXIT_SCRIPT)
    membership.write(tmp_path, world(0, size=2))
    done = subprocess.run(
        [sys.executable, "-m", "splitfeed.trainer_client.cli", "run", "--", sys.executable, str(script), str(tmp_path)],
        env={**os.environ, wellknown.SOCKET_DIR_ENV: str(tmp_path), wellknown.WORLD_EPOCH_ENV: "0",
             wellknown.WORLD_SIZE: "2", wellknown.MASTER_PORT_ENV: "29500", "EXIT_CODE": str(exit_code)},
        capture_output=True, text=True, timeout=60)
    assert done.returncode == exit_code, done.stderr
    at_exit = json.loads((tmp_path / "at-exit.json").read_text())
    assert at_exit["frozen"] > 10_000 and at_exit["torch"], at_exit  # skipped by the exit's collections
    assert at_exit["main"] == "__main__"
    assert (tmp_path / "finalized").read_text() == "yes"  # a cycle of the script's, finalized at the exit


def test_a_rank_waits_for_rank_0s_store_to_listen_then_connects_at_once_and_gives_up_at_its_timeout():
    """TCPStore's own retry connected 0.15-0.68 s after its server was up (groups._wait_listening)."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    listening = threading.Event()

    def listen_late() -> None:
        time.sleep(0.3)
        server.listen()
        listening.set()

    opener = threading.Thread(target=listen_late)
    opener.start()
    try:
        groups._wait_listening("127.0.0.1", port, timeout_s=30)
        assert listening.is_set()  # it returned once the port took connections, not before
    finally:
        opener.join()
        server.close()
    started = time.monotonic()
    groups._wait_listening("127.0.0.1", port, timeout_s=0.2)  # nothing listens: TCPStore says so
    assert time.monotonic() - started < 5
