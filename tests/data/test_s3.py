"""Reading from object storage: the same table on S3 (moto) and on local disk.

`moto_server` (from moto[server]) runs as a subprocess on a free loopback port
and is stopped by PID when the module ends, also after a failure. Credentials
reach lancedb only as storage options passed to `iter_rank_batches` (the way
the sidecar gets them from the Secret), never through the environment; the
endpoint and region come from the spec's non-secret `storageOptions`.
"""

from __future__ import annotations

import contextlib
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import boto3
import pytest

from splitfeed.sidecar import workers
from tests.data.tables import as_rows, data_spec, reference_rows, whole_batches, write_table

BUCKET = "splitfeed-test"
CREDENTIALS = {"aws_access_key_id": "splitfeed", "aws_secret_access_key": "not-a-secret"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An S3 endpoint served by moto_server; the process is stopped whatever happens."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("moto") / "moto_server.log"
    moto_server = pathlib.Path(sys.executable).parent / "moto_server"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [str(moto_server), "-H", "127.0.0.1", "-p", str(port)],
            stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            if server.poll() is not None:
                pytest.fail(f"moto_server exited with {server.returncode}: {log_path.read_text()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"moto_server did not listen on port {port} within 30 s")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture(scope="module")
def s3_uri(s3_endpoint: str, db_uri: str) -> str:
    """The `frames` table written to s3://BUCKET/db (db_uri holds the local twin)."""
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1",
                          aws_access_key_id=CREDENTIALS["aws_access_key_id"],
                          aws_secret_access_key=CREDENTIALS["aws_secret_access_key"])
    try:
        client.create_bucket(Bucket=BUCKET)
    finally:
        client.close()
    uri = f"s3://{BUCKET}/db"
    write_table(uri, {**CREDENTIALS, **endpoint_options(s3_endpoint)})
    return uri


def endpoint_options(endpoint: str) -> dict[str, str]:
    return {"aws_endpoint": endpoint, "aws_region": "us-east-1", "allow_http": "true"}


def test_a_table_on_s3_yields_the_same_batches_as_on_local_disk_and_the_reference(
    s3_uri: str, s3_endpoint: str, db_uri: str
) -> None:
    # Rank 1 of 2, in-process: worker processes get the same storage options as
    # arguments, and each spawn costs seconds, so they are tested on local disk.
    on_s3 = data_spec(s3_uri, storage_options=endpoint_options(s3_endpoint), epochs=1)
    remote = list(workers.iter_rank_batches(on_s3, CREDENTIALS, rank=1, world_size=2,
                                            start_global_step=0))
    local = list(workers.iter_rank_batches(data_spec(db_uri, epochs=1), {}, rank=1,
                                           world_size=2, start_global_step=0))
    reference = reference_rows(on_s3, epoch=0, rank=1, world_size=2, storage_options=CREDENTIALS)
    assert len(remote) == len(local) > 0
    assert [step for step, _ in remote] == [step for step, _ in local]
    assert [as_rows(b) for _, b in remote] == [as_rows(b) for _, b in local]
    assert [as_rows(b) for _, b in remote] == whole_batches(reference, on_s3.global_batch_size // 2)

