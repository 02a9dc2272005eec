"""Harness for the data plane: real LanceDB tables, real sidecars, real ZeroMQ.

Sidecars run either in a thread of the test process (fast: lancedb is imported
once) or as `splitfeed sidecar` processes (for tests that kill them by PID).
Expected batches always come from lancedb's StreamingDataset iterated
in-process, never from splitfeed itself.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from splitfeed.sidecar import main as sidecar_main, opening
from splitfeed.sidecar.data import reading, skipping
from splitfeed.sidecar.world.settings import SidecarSettings
from splitfeed.trainer_client.contract import specs
from tests.support import guards, keys, manifests, ports, tables

ROWS = 1000
JOB_UID = "0b5e55ed-0000-4000-8000-000000000001"
"""The test job's metadata.uid: its checkpoints live under <uri>/test/job/<uid>/."""
DIM = tables.TRAINING_DIM
write_table = tables.write_training_table


@pytest.fixture(scope="session")
def table_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    uri = str(tmp_path_factory.mktemp("lance") / "db")
    write_table(uri)
    return uri


manifest = manifests.data_manifest
reference_batches = tables.reference_batches
reference_global_steps = tables.reference_global_steps


@pytest.fixture
def socket_root():
    root = Path(tempfile.mkdtemp(prefix="sf-test-", dir=guards.shm_root()))
    yield root
    shutil.rmtree(root, ignore_errors=True)


class Pod:
    """One pod's sidecar: a config file, a socket dir, and the sidecar itself."""

    def __init__(self, root: Path, name: str, job_manifest: dict, *, replicas: int, replica: int,
                 gpus: int = 1, resume: str = "latest", coordinator: str | None = None,
                 resume_step: int | None = None, world_epoch: int = 0, job_uid: str = JOB_UID) -> None:
        job = specs.parse_job(job_manifest, check_replicas=False)
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket_dir = self.dir / "sock"
        self.config = self.dir / "config.json"
        self.config.write_text(json.dumps(job.data_config()))
        self.podinfo = self.dir / "podinfo"
        self.podinfo.mkdir(exist_ok=True)
        self.termination_log = self.dir / "termination-log"
        self.env = {"RANK": str(replica * gpus), "WORLD_SIZE": str(replicas * gpus),
                    "LOCAL_WORLD_SIZE": str(gpus), "SPLITFEED_SOCKET_DIR": str(self.socket_dir),
                    "SPLITFEED_RESUME": resume, "NODE_RANK": str(replica),
                    "SPLITFEED_JOB_UID": job_uid, "SPLITFEED_WORLD_EPOCH": str(world_epoch),
                    "SPLITFEED_KEYS_DIR": str(keys.session_dir())}
        if coordinator:
            self.env["SPLITFEED_COORDINATOR"] = coordinator
        if resume_step is not None:
            self.env["SPLITFEED_RESUME_STEP"] = str(resume_step)
        self.settings = SidecarSettings(
            config=self.config, socket_dir=self.socket_dir, rank=replica * gpus,
            world_size=replicas * gpus, local_world_size=gpus, resume=resume, replica=replica,
            coordinator=coordinator, resume_step=resume_step, job_uid=job_uid, world_epoch=world_epoch,
            podinfo_dir=self.podinfo, termination_log=self.termination_log, keys_dir=keys.session_dir())
        self._thread: threading.Thread | None = None
        self._sidecar: opening.Sidecar | None = None
        self.exit_code: int | None = None
        self.process: subprocess.Popen | None = None

    # in a thread -------------------------------------------------------------
    def start_thread(self) -> "Pod":
        ready = threading.Event()

        def run() -> None:
            self._sidecar = opening.prepare(self.settings)
            ready.set()
            self.exit_code = sidecar_main.serve(self._sidecar)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert ready.wait(60), "sidecar did not start"
        return self

    # as a process --------------------------------------------------------------
    def start_process(self) -> "Pod":
        env = {**os.environ, **self.env}
        if self.process is None:
            self.log = open(self.dir / "sidecar.log", "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "splitfeed.trainer_client.cli", "sidecar", "--config", str(self.config),
             "--podinfo-dir", str(self.podinfo), "--termination-log", str(self.termination_log)],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        return self

    def kill(self) -> None:
        """SIGKILL by PID: no cleanup runs, as when a container is OOM-killed."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def wait(self, timeout: float = 60) -> int:
        if self.process is not None:
            return self.process.wait(timeout)
        assert self._thread is not None
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "sidecar thread did not finish"
        assert self.exit_code is not None
        return self.exit_code

    def stop(self) -> None:
        if self._sidecar is not None:
            self._sidecar.server.stopping.set()
        if self._thread is not None:
            self._thread.join(30)
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None:
            self.log.close()

    def request(self, annotation: str, token: str) -> None:
        path = self.podinfo / "annotations"
        tmp = self.podinfo / ".annotations.tmp"
        tmp.write_text(f'{annotation}="{token}"\n')
        os.replace(tmp, path)


@pytest.fixture
def pods(socket_root: Path):
    """Factory of Pods; every pod is stopped at teardown, also on failure.

    A sidecar's row counts (filledRows, skippedRows) are its process's: pods started as
    threads of this process share them, so each test starts them at zero."""
    reading.FILLED_ROWS[0] = skipping.SKIPPED_ROWS[0] = 0
    made: list[Pod] = []

    def make(name: str, job_manifest: dict, **kwargs: object) -> Pod:
        pod = Pod(socket_root, name, job_manifest, **kwargs)  # type: ignore[arg-type]
        made.append(pod)
        return pod

    yield make
    for pod in made:
        pod.stop()


coordinator_address = ports.tcp_address
