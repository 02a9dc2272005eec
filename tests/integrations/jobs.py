"""Running a framework trainer under `splitfeed local`, as the integration tests do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.streaming.harness import manifest


def run(trainer: Path, table_uri: str, tmp_path: Path, *args: str, trainer_args: tuple[str, ...] = ()) -> str:
    """`splitfeed local` of the test job with `trainer` logging under tmp_path/logs; its stderr."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(manifest(table_uri, str(tmp_path / "ckpt"))))
    done = subprocess.run([sys.executable, "-m", "splitfeed.trainer_client.cli", "local", "-f", str(job), *args,
                           "--", sys.executable, str(trainer), str(tmp_path / "logs"), *trainer_args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stderr


def rescale_2_to_3_at_6(trainer: Path, table_uri: str, tmp_path: Path, *trainer_args: str) -> tuple[str, Any]:
    """A live 2 -> 3 rescale asked at step 6: exact against lancedb, world 0 drained at 6 and
    world 1 ran to the end, 0 steps redone. Its stderr and the exactness summary."""
    from tests.support import exactness
    from tests.support.tables import check_exact

    (tmp_path / "logs").mkdir()
    err = run(trainer, table_uri, tmp_path, "--replicas", "2", "--resume", "none", "--scale-at", "6:3",
              trainer_args=("--sleep-s", "0.2", *trainer_args))
    summary = check_exact(tmp_path / "logs", tmp_path / "ckpt" / "test" / "job", table_uri)
    assert [(w.size, w.resume_step, w.ended) for w in summary.worlds] == [
        (2, 0, exactness.DRAINED), (3, 6, exactness.END)], summary
    assert "; 0 steps redone" in err, err
    return err, summary


def stop_at_5_then_resume_on_3(trainer: Path, table_uri: str, tmp_path: Path) -> None:
    """`max_steps=5` on 2 ranks, then a run on 3 that resumes at step 5: exact against lancedb,
    with the framework's own step count restored from its checkpoint."""
    from tests.support.tables import check_exact

    (tmp_path / "logs").mkdir()
    err = run(trainer, table_uri, tmp_path, "--replicas", "2", "--resume", "none", trainer_args=("--max-steps", "5"))
    assert "trainers stopped at global step 5 of 20" in err, err
    run(trainer, table_uri, tmp_path, "--replicas", "3")
    summary = check_exact(tmp_path / "logs", tmp_path / "ckpt" / "test" / "job", table_uri)
    assert [(w.size, w.resume_step, w.steps) for w in summary.worlds] == [(2, 0, 5), (3, 5, 15)], summary
    first = json.loads((tmp_path / "logs" / "w1-r0.jsonl").read_text().splitlines()[0])
    assert first["globalStep"] == 5, first


def exits(logs: Path) -> dict[str, dict]:
    """Each log file's last line (the trainer's exit record)."""
    return {p.name: [json.loads(line) for line in p.read_text().splitlines()][-1] for p in sorted(logs.glob("w*.jsonl"))}
