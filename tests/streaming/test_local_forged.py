"""A `splitfeed local` job under attack: a process without the run's keypair forges every
coordinator message while real DDP trainers (tests/e2e/trainer.py) train and the world rescales.

Before the control plane was authenticated, three such messages ended a `recreate` job with
exit 1 and hung an `inPlace` one (issue 35). Now the job must end 0, exact against lancedb's
StreamingDataset order, and the forger (tests/streaming/forger.py) must never get an answer.
"""

from __future__ import annotations

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


@pytest.mark.parametrize("rescale", ["recreate", "inPlace"])
def test_forged_messages_from_a_process_without_the_key_change_nothing(table_uri, tmp_path, rescale):  # noqa: F811
    logs, store, report = tmp_path / "logs", tmp_path / "ckpt", tmp_path / "forger.json"
    job = manifest(table_uri, str(store))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    work_glob = str(guards.shm_root() / f"splitfeed-{job['metadata']['name']}-*")
    forger = subprocess.Popen([sys.executable, str(FORGER), work_glob, str(report)],
                              preexec_fn=processes.die_with_parent())
    try:
        done = subprocess.run(
            [sys.executable, "-m", "splitfeed.trainer_client.cli", "local", "-f", str(tmp_path / "job.yaml"),
             "--replicas", "2", "--resume", "none", "--rescale", rescale, "--scale-at", "8:4",
             "--", sys.executable, str(E2E_TRAINER), str(logs), "--sleep-s", "0.25"],
            capture_output=True, text=True, timeout=300)
        attacked = wait_for(lambda: json.loads(report.read_text()) if report.exists() else None, 30,
                            "the forger's report")
    finally:
        forger.terminate()
        forger.wait(30)
    assert done.returncode == 0, done.stderr
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
