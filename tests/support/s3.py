"""A real S3 API for the tests: moto_server on a free loopback port, and a bucket in it.

Fixtures (session scope): a tier's conftest imports them by name.
"""

from __future__ import annotations

import contextlib
import pathlib
import socket
import subprocess
import sys
from collections.abc import Iterator

import boto3
import pytest

from tests.support import waiting
from tests.support.ports import free_port

BUCKET = "splitfeed-test"
CREDENTIALS = {"aws_access_key_id": "splitfeed", "aws_secret_access_key": "not-a-secret"}
"""moto's: credentials reach lancedb and pyarrow only as storage options."""


def endpoint_options(endpoint: str) -> dict[str, str]:
    """The non-secret storage options of the moto endpoint (spec.data.storageOptions)."""
    return {"aws_endpoint": endpoint, "aws_region": "us-east-1", "allow_http": "true"}


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An S3 endpoint served by moto_server on a free loopback port; the process is
    stopped by PID when the session ends, also after a failure."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("moto") / "moto_server.log"
    moto_server = pathlib.Path(sys.executable).parent / "moto_server"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [str(moto_server), "-H", "127.0.0.1", "-p", str(port)],
            stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        def listening() -> bool:
            if server.poll() is not None:
                pytest.fail(f"moto_server exited with {server.returncode}: {log_path.read_text()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                return True
            return False

        waiting.wait_for(listening, 30, f"moto_server to listen on port {port}", interval=0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture(scope="session")
def s3_bucket(s3_endpoint: str) -> str:
    """BUCKET, created once on the moto endpoint."""
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1",
                          aws_access_key_id=CREDENTIALS["aws_access_key_id"],
                          aws_secret_access_key=CREDENTIALS["aws_secret_access_key"])
    try:
        client.create_bucket(Bucket=BUCKET)
    finally:
        client.close()
    return BUCKET
