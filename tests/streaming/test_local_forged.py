"""A `splitfeed local` job under attack: a process without the run's keypair forges every
coordinator message while real DDP trainers (tests/e2e/trainer.py) train and the world rescales.

Before the control plane was authenticated, three such messages ended a `recreate` job with
exit 1 and hung an `inPlace` one (issue 35). Now the job must end 0, exact against lancedb's
StreamingDataset order, and the forger (tests/streaming/forger.py) must never get an answer.
"""

from __future__ import annotations

import glob
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.streaming.harness import manifest
from tests.support import guards, processes
from tests.support.tables import check_exact
from tests.support.waiting import wait_for

E2E_TRAINER = Path(__file__).parents[1] / "e2e" / "trainer.py"
FORGER = Path(__file__).with_name("forger.py")


def owner_only(work_glob: str) -> dict[str, int] | None:
    """The modes of a running world's private files (docs/security.md), once they all exist: the
    run's work dir (under /dev/shm, where the `replicas` control file goes), its keypair, each
    replica's socket dir (the trainer's ipc socket, ring files, sidecar lock); None before."""
    works = glob.glob(work_glob)
    if len(works) != 1:
        return None
    work = Path(works[0])
    paths = [work, work / "keys", *(work / "keys").glob("*.key"), *work.glob("w0-replica-*"),
             *work.glob("w0-replica-*/ctl-*"), *work.glob("w0-replica-*/sidecar.lock")]
    if sum(p.name.startswith("ctl-") for p in paths) < 2 or sum(p.name == "sidecar.lock" for p in paths) < 2:
        return None
    return {str(p): p.stat().st_mode & 0o777 for p in paths}


@pytest.mark.parametrize("rescale", ["recreate", "inPlace"])
def test_forged_messages_from_a_process_without_the_key_change_nothing(table_uri, tmp_path, rescale):  # noqa: F811
    logs, store, report = tmp_path / "logs", tmp_path / "ckpt", tmp_path / "forger.json"
    job = manifest(table_uri, str(store))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    work_glob = str(guards.shm_root() / f"splitfeed-{job['metadata']['name']}-*")
    forger = subprocess.Popen([sys.executable, str(FORGER), work_glob, str(report)],
                              preexec_fn=processes.die_with_parent())
    try:
        run = subprocess.Popen(
            [sys.executable, "-m", "splitfeed.trainer_client.cli", "local", "-f", str(tmp_path / "job.yaml"),
             "--replicas", "2", "--resume", "none", "--rescale", rescale, "--scale-at", "8:4",
             "--", sys.executable, str(E2E_TRAINER), str(logs), "--sleep-s", "0.25"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=processes.die_with_parent())
        try:
            modes = wait_for(lambda: owner_only(work_glob), 120, "the run's work dir, keys and rings")
            _, err = run.communicate(timeout=300)
        finally:
            processes.stop(run)
        done = subprocess.CompletedProcess(run.args, run.returncode, "", err)
        attacked = wait_for(lambda: json.loads(report.read_text()) if report.exists() else None, 30,
                            "the forger's report")
    finally:
        forger.terminate()
        forger.wait(30)
    assert done.returncode == 0, done.stderr
    assert all(mode in (0o700, 0o600) for mode in modes.values()), {p: oct(m) for p, m in modes.items()}
    assert attacked["answered"] == 0, attacked
    assert attacked["sent"] > 0 and len(attacked["addresses"]) == 2, attacked  # both worlds' coordinators
    summary = check_exact(logs, store / "test" / "job", table_uri)
    assert [w.size for w in summary.worlds] == [2, 4], summary
    assert [w.resume_step for w in summary.worlds[1:]] == [8], summary
    assert summary.replayed == 0, summary
    assert done.stderr.count("; 0 steps redone") == 1, done.stderr
    found = re.search(r"logs in (\S+)", done.stderr)
    assert found, done.stderr
    rejected = "".join(p.read_text() for p in Path(found.group(1)).glob("w*-sidecar-0.log"))
    assert "coordinator: rejected a peer at" in rejected
