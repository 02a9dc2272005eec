"""How the soak finds a job's processes and ports, against the real kernel's view (/proc)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from splitfeed.trainer_client.transport import stranded
from tests.soak import probe
from tests.soak.progress import Progress


def test_a_sidecars_lock_names_its_holder_and_a_free_one_nobody(tmp_path):
    held, free = tmp_path / "w3-replica-1", tmp_path / "w4-replica-1"
    fd = stranded.hold(held)
    try:
        free.mkdir()
        (free / stranded.LOCK_FILE).write_text("")
        assert probe.lock_holder(held / stranded.LOCK_FILE) == os.getpid()
        assert probe.lock_holder(free / stranded.LOCK_FILE) is None
        assert probe.sidecar_pid(tmp_path, 1) == os.getpid()  # the newest world's dir has none
        assert probe.sidecar_pid(tmp_path, 0) is None
    finally:
        assert fd is not None
        os.close(fd)
    assert probe.lock_holder(held / stranded.LOCK_FILE) is None


def test_a_childs_listening_port_is_seen_and_gone_with_it():
    child = subprocess.Popen([sys.executable, "-c", "import socket, sys, time\ns = socket.socket(); "
                              "s.bind(('127.0.0.1', 0)); s.listen(); print(s.getsockname()[1], flush=True); "
                              "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        assert probe.descendants(os.getpid()) >= {child.pid}
        assert probe.parent(child.pid) == os.getpid()
        assert probe.ports_of({child.pid}) == {port} and port in probe.listening_ports()
    finally:
        child.kill()
        child.communicate()
    with socket.socket() as s:  # nobody listens there now
        assert s.connect_ex(("127.0.0.1", port)) != 0
    assert port not in probe.listening_ports()


def test_progress_settles_on_a_new_worlds_batch_of_the_size_asked(tmp_path: Path):
    (tmp_path / "w0-r0.jsonl").write_text(
        '{"event": "start", "pid": 1, "worldSize": 1, "rank": 0, "t": 1}\n'
        '{"event": "batch", "step": 0, "t": 2}\n{"event": "batch", "step": 1, "t": 5}\n')
    progress = Progress(tmp_path)
    progress.read()
    assert progress.newest() == 0 and progress.step() == 1
    assert progress.settled(4, None, None) == 5 and progress.settled(4, 0, None) is None
    with open(tmp_path / "w1-r1.jsonl", "w") as f:
        f.write('{"event": "start", "pid": 2, "worldSize": 2, "rank": 1, "t": 6}\n{"event": "batch", "step": 1, "t": 7}\n'
                '{"event": "batch", "st')  # half written: read next time
    progress.read()
    assert progress.settled(4, 0, 2) == 7 and progress.settled(4, 0, 3) is None and progress.step() == 1
    with open(tmp_path / "w1-r1.jsonl", "a") as f:
        f.write('ep": 2, "t": 8}\n{"event": "exit", "reason": "end", "t": 9}\n')
    progress.read()
    assert progress.step() == 2 and not progress.ended()  # rank 0 of world 1 has not ended
