"""A sidecar whose trainer returned without close() (issue 21): SIGTERM ends it at once.

`sidecar/serving/ending.py: trainers_gone` says whether a sidecar's trainers are gone (each said
hello, none is connected now); the SIGTERM handler of `splitfeed sidecar` stops at once
then instead of asking for a drain nobody can commit (the kubelet stopping a native
sidecar, the operator deleting the pod of a world whose trainers returned).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitfeed.sidecar.serving import ending
from tests.streaming.harness import manifest
from tests.support.waiting import wait_for

SCRIPT = Path(__file__).with_name("trainer_script.py")


def trainer(pod, log: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, **pod.env, "LOCAL_RANK": "0"}
    return subprocess.Popen([sys.executable, str(SCRIPT), str(log), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_connections_counts_the_accepted_connections_of_one_socket(tmp_path):
    table = tmp_path / "unix"
    table.write_text(
        "Num       RefCount Protocol Flags    Type St Inode Path\n"
        "0000000000000000: 00000002 00000000 00010000 0001 01 11 /run/sf/control.sock\n"
        "0000000000000000: 00000003 00000000 00000000 0001 03 12 /run/sf/control.sock\n"
        "0000000000000000: 00000003 00000000 00000000 0001 03 13\n"
        "0000000000000000: 00000003 00000000 00000000 0001 03 14 /run/other/control.sock\n")
    assert ending.connections(Path("/run/sf/control.sock"), table) == 1
    assert ending.connections(Path("/run/none.sock"), table) == 0
    assert ending.connections(Path("/run/sf/control.sock"), tmp_path / "missing") is None


def test_trainers_gone_follows_the_trainer_process(pods, table_uri, tmp_path):
    pod = pods("pod", manifest(table_uri), replicas=1, replica=0).start_thread()
    server = pod._sidecar.server
    assert not ending.trainers_gone(server), "no trainer came yet: it may still be starting"
    paused = trainer(pod, tmp_path / "ids.jsonl", "--pause-after", "2")
    try:
        assert paused.stdout.readline().startswith("resume")
        wait_for(lambda: server.feeds[0].session.peer is not None, 30, "the trainer's hello", interval=0.05)
        time.sleep(0.5)
        assert not ending.trainers_gone(server), "a connected trainer (in a long step, say) is not gone"
    finally:
        paused.kill()
        paused.communicate()
    wait_for(lambda: ending.trainers_gone(server), 10, "the killed trainer's connection to close", interval=0.05)
    returned = trainer(pod, tmp_path / "ids.jsonl", "--stop-after", "3", "--no-close")
    out, err = returned.communicate(timeout=60)
    assert returned.returncode == 0, err
    wait_for(lambda: ending.trainers_gone(server), 10, "the returned trainer's connection to close", interval=0.05)


def test_a_sigterm_after_the_trainer_returned_ends_the_sidecar_at_once_with_its_step(pods, table_uri, tmp_path):
    pod = pods("pod", manifest(table_uri, str(tmp_path / "ckpt")), replicas=1, replica=0).start_process()
    returned = trainer(pod, tmp_path / "ids.jsonl", "--stop-after", "3", "--no-close")
    out, err = returned.communicate(timeout=120)
    assert returned.returncode == 0, err
    time.sleep(1.0)
    assert pod.process.poll() is None, "without bye the sidecar serves on (nothing tells it the trainer is gone)"
    os.kill(pod.process.pid, signal.SIGTERM)
    started = time.monotonic()
    try:
        code = pod.process.wait(10)
    except subprocess.TimeoutExpired:
        pytest.fail("the sidecar still waits for a drain its gone trainer cannot commit 10 s after SIGTERM")
    assert code == 0 and time.monotonic() - started < 5
    report = json.loads(pod.termination_log.read_text())
    assert report["globalStep"] == 3 and report["drained"] is False and report["error"] is None, report
