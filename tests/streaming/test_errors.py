"""Errors a newcomer meets first: one line that says what failed and what to do.

Real storage: moto on 127.0.0.1 for S3, a closed loopback port for an
unreachable endpoint, a local LanceDB for an unknown table. `splitfeed plan`
without --read-table is run with no network at all (a new network namespace).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.s3 import CREDENTIALS, endpoint_options, s3_bucket, s3_endpoint  # noqa: F401 - fixtures
from tests.support.tables import write_table
from tests.streaming.harness import manifest

CLI = [sys.executable, "-m", "splitfeed.trainer_client.cli"]


def run(*args: str, env: dict[str, str] | None = None, prefix: list[str] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, *CLI, *args], capture_output=True, text=True, timeout=120, env=env)


def job_file(tmp_path: Path, uri: str, **storage_options: str) -> str:
    job = manifest(uri)
    job["spec"]["data"]["storageOptions"] = storage_options
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def error_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, done.stderr
    assert len(done.stderr.strip().splitlines()) <= 3, f"more than a line or so:\n{done.stderr}"
    return lines[0]


@pytest.fixture(scope="module")
def s3_table(s3_bucket: str, s3_endpoint: str) -> str:  # noqa: F811 - the fixtures above
    uri = f"s3://{s3_bucket}/errors-db"
    write_table(uri, storage_options={**CREDENTIALS, **endpoint_options(s3_endpoint)})
    return uri


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when this returns


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_plan_computes_the_topology_with_no_network_and_no_credentials(tmp_path):
    job = job_file(tmp_path, "s3://some-bucket/db", aws_region="eu-west-1")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no AWS_* anywhere
    done = run("plan", "-f", job, "--replicas", "4", env=env, prefix=["unshare", "--net", "--"])
    assert done.returncode == 0, done.stderr
    assert "valid replica counts: [1, 2, 3, 4, 6, 8, 12, 24]" in done.stdout
    assert "rank 3: splits 18..23" in done.stdout
    assert "not read (add --read-table" in done.stdout


def test_missing_credentials_name_the_secret_field_and_the_local_flag(tmp_path, s3_table, s3_endpoint):  # noqa: F811
    job = job_file(tmp_path, s3_table, **endpoint_options(s3_endpoint))
    done = run("plan", "-f", job, "--read-table")
    assert done.returncode == 2
    line = error_line(done)
    assert "credentials are missing or not allowed" in line
    assert "spec.data.storageOptionsSecret" in line and "--storage-options-dir" in line
    # With the credentials the job names, the same plan reads the table.
    creds = tmp_path / "creds"
    creds.mkdir()
    for key, value in CREDENTIALS.items():
        (creds / key).write_text(value)
    done = run("plan", "-f", job, "--read-table", "--storage-options-dir", str(creds))
    assert done.returncode == 0, done.stderr
    assert "steps per epoch" in done.stdout


def test_an_unreachable_endpoint_says_where_and_what_to_check(tmp_path):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    job = job_file(tmp_path, "s3://bucket/db", aws_endpoint=endpoint, aws_region="us-east-1", allow_http="true")
    done = run("plan", "-f", job, "--read-table")
    assert done.returncode == 2
    line = error_line(done)
    assert f"cannot reach the object store of s3://bucket/db at {endpoint}" in line
    assert "spec.data.storageOptions" in line


def test_an_unknown_table_lists_the_tables_that_exist(tmp_path, table_uri):
    job = manifest(table_uri)
    job["spec"]["data"]["table"] = "framez"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    done = run("plan", "-f", str(path), "--read-table")
    assert done.returncode == 2
    line = error_line(done)
    assert "spec.data.table='framez' does not exist" in line and "['frames']" in line


def test_verbose_shows_the_whole_chain(tmp_path):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    job = job_file(tmp_path, "s3://bucket/db", aws_endpoint=endpoint, aws_region="us-east-1", allow_http="true")
    done = run("-v", "plan", "-f", job, "--read-table")
    assert done.returncode == 2
    assert "Traceback" in done.stderr and "tcp connect error" in done.stderr
