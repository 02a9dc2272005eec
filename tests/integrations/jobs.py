"""Running a framework trainer under `splitfeed local`, as the integration tests do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def exits(logs: Path) -> dict[str, dict]:
    """Each log file's last line (the trainer's exit record)."""
    return {p.name: [json.loads(line) for line in p.read_text().splitlines()][-1] for p in sorted(logs.glob("w*.jsonl"))}
