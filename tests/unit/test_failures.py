"""What a failed script's client records for `splitfeed run`: a collective whose peer vanished
(real gloo, a peer process that exits mid-job) or a failure of its own."""

from __future__ import annotations

import subprocess
import sys
import time

from splitfeed.trainer_client.script import failures
from tests.support import ports

RANK = """
import os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from splitfeed.trainer_client.script import failures
rank, port, d = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
failures.install(d, rank, lambda: 7)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
t = torch.ones(4)
dist.all_reduce(t)
if rank == 1:
    os._exit(0)  # its pod is gone
time.sleep(0.5)
dist.all_reduce(t)  # its peer vanished: gloo raises
"""


def test_a_collective_whose_peer_vanished_is_recorded_as_such(tmp_path):
    began = time.time()
    port = str(ports.free_port())
    peer = subprocess.Popen([sys.executable, "-c", RANK, "1", port, str(tmp_path)])
    rank0 = subprocess.run([sys.executable, "-c", RANK, "0", port, str(tmp_path)],
                           capture_output=True, text=True, timeout=120)
    peer.wait(timeout=60)
    assert rank0.returncode == 1, rank0.stderr
    [found] = failures.recorded_since(tmp_path, began)  # rank 1 exited without an exception
    assert found.collective and found.epoch == 7 and found.pid != peer.pid, found
    assert found.exception.startswith("builtins.RuntimeError:") and "Traceback" in rank0.stderr


OWN = """
import sys
from pathlib import Path
from splitfeed.trainer_client.script import failures
failures.install(Path(sys.argv[1]), 0, lambda: 2)
how = sys.argv[2]
if how == "raises":
    try:
        {}["missing"]
    except KeyError as exc:
        raise ValueError("the model's config is wrong") from exc
if how == "interrupted":
    raise KeyboardInterrupt
sys.exit(3)
"""


def test_a_failure_of_its_own_is_recorded_as_not_a_collective_and_an_exit_records_nothing(tmp_path):
    began = time.time()
    raised = subprocess.Popen([sys.executable, "-c", OWN, str(tmp_path), "raises"], stderr=subprocess.PIPE)
    _, err = raised.communicate(timeout=60)
    [found] = failures.recorded_since(tmp_path, began)
    assert found.pid == raised.pid and not found.collective and found.epoch == 2
    assert found.exception == "builtins.ValueError: the model's config is wrong"
    assert b"KeyError" in err  # the script's own hook (python's) still printed the whole chain
    assert (tmp_path / failures.FILE.format(local_rank=0)).stat().st_mode & 0o777 == 0o600
    later = time.time()
    for how in ("exits", "interrupted"):
        other = subprocess.run([sys.executable, "-c", OWN, str(tmp_path), how], capture_output=True, timeout=60)
        assert other.returncode != 0
    assert failures.recorded_since(tmp_path, later) == []  # an exit and a ^C record nothing


def test_a_collective_failure_is_found_through_the_exceptions_it_caused():
    try:
        try:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.3]:4711")
        except RuntimeError as exc:
            raise ValueError("training step 41 failed") from exc  # a framework's wrapper
    except ValueError as wrapped:
        assert failures.collective(wrapped)
    assert not failures.collective(RuntimeError("CUDA out of memory"))
    import torch.distributed as dist  # NCCL's and the stores' errors are of this family
    assert failures.collective(dist.DistBackendError("NCCL communicator was aborted on rank 1"))
    assert failures.collective(dist.DistStoreError("wait timeout after 30000ms"))
