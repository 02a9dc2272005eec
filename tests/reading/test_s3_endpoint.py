"""The S3 endpoint the throughput tests and benchmarks read through (tests/support/s3_endpoint.py).

Its answers are checked with the clients that will use it, never with its own code:
raw HTTP for exact statuses and headers, boto3 for listings, conditional puts and
multipart uploads, pyarrow's S3FileSystem (built as the checkpoint store builds it),
and lancedb, whose reads through the endpoint must equal its reads of the same folder
on local disk. Latency and faults are checked by what the endpoint counted and by
what the clients saw.
"""

from __future__ import annotations

import http.client
import os
import pathlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import boto3
import lancedb
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from botocore.exceptions import ClientError

from splitfeed.sidecar.world import checkpoints
from tests.reading.tables import TABLE, frames, write_table
from tests.support.s3_endpoint import S3Endpoint

pytestmark = pytest.mark.timeout(60)

BUCKET = "bucket"
BLOB = bytes(range(256)) * 40
"""10,240 bytes, each position's value known: a wrong range shows."""


@pytest.fixture
def endpoint(tmp_path: pathlib.Path) -> Iterator[S3Endpoint]:
    (tmp_path / BUCKET).mkdir()
    with S3Endpoint(tmp_path) as served:
        yield served


@pytest.fixture
def s3(endpoint: S3Endpoint) -> Iterator[Any]:
    client = boto3.client("s3", endpoint_url=endpoint.url, region_name="us-east-1",
                          aws_access_key_id="any", aws_secret_access_key="any")
    yield client
    client.close()


def request(endpoint: S3Endpoint, method: str, path: str,
            headers: Mapping[str, str] | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One request on a connection of its own: status, headers, body."""
    connection = http.client.HTTPConnection(endpoint.url.removeprefix("http://"), timeout=30)
    try:
        connection.request(method, path, headers=dict(headers or {}))
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def put_local(endpoint: S3Endpoint, key: str, data: bytes) -> None:
    path = endpoint.root / BUCKET / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def local_and_remote(endpoint: S3Endpoint) -> tuple[Any, Any]:
    """The `frames` table written to root/bucket/db, opened there and as s3://bucket/db."""
    write_table(str(endpoint.root / BUCKET / "db"))
    local = lancedb.connect(str(endpoint.root / BUCKET / "db")).open_table(TABLE)
    remote = lancedb.connect(f"s3://{BUCKET}/db", storage_options=endpoint.storage_options()).open_table(TABLE)
    return local, remote


def test_ranged_gets_answer_206_with_the_bytes_asked_for_and_head_describes_the_object(
        endpoint: S3Endpoint) -> None:
    put_local(endpoint, "dir/blob", BLOB)
    for header, first, last in [("bytes=100-199", 100, 199), ("bytes=10000-", 10000, 10239),
                                ("bytes=-300", 9940, 10239), ("bytes=10200-99999", 10200, 10239)]:
        status, headers, body = request(endpoint, "GET", "/bucket/dir/blob", {"Range": header})
        assert (status, body) == (206, BLOB[first:last + 1]), header
        assert headers["Content-Range"] == f"bytes {first}-{last}/{len(BLOB)}"
    status, _, body = request(endpoint, "GET", "/bucket/dir/blob")
    assert (status, body) == (200, BLOB)
    assert request(endpoint, "GET", "/bucket/dir/blob", {"Range": "bytes=10240-"})[0] == 416

    status, headers, body = request(endpoint, "HEAD", "/bucket/dir/blob")
    assert (status, body, headers["Content-Length"]) == (200, b"", str(len(BLOB)))
    assert headers["ETag"].startswith('"') and headers["Last-Modified"].endswith("GMT")
    status, _, body = request(endpoint, "GET", "/bucket/dir/missing")
    assert status == 404 and b"<Code>NoSuchKey</Code>" in body
    assert request(endpoint, "HEAD", "/bucket/dir")[0] == 404  # a folder is no object
    assert endpoint.statuses == {206: 4, 200: 2, 416: 1, 404: 2}
    assert endpoint.requests == {"GET": 7, "HEAD": 2}


def test_listing_rolls_up_common_prefixes_and_pages_without_repeating(endpoint: S3Endpoint, s3: Any) -> None:
    keys = ["a/1", "a/2", "a/b/3", "a/b/4", "a/c/5", "a0", "z"]
    for key in keys:
        put_local(endpoint, key, key.encode())

    def listed(max_keys: int, **params: str) -> tuple[list[str], list[str], int]:
        pages = list(s3.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, PaginationConfig={"PageSize": max_keys}, **params))
        return ([c["Key"] for p in pages for c in p.get("Contents", [])],
                [c["Prefix"] for p in pages for c in p.get("CommonPrefixes", [])], len(pages))

    for size in (1, 2, 1000):
        assert listed(size) == (keys, [], -(-7 // size))
        assert listed(size, Prefix="a/") == (keys[:5], [], -(-5 // size))
        assert listed(size, Prefix="a/", Delimiter="/") == (["a/1", "a/2"], ["a/b/", "a/c/"], -(-4 // size))
        assert listed(size, Delimiter="/") == (["a0", "z"], ["a/"], -(-3 // size))
        assert listed(size, Prefix="a", Delimiter="/") == (["a0"], ["a/"], -(-2 // size))
        assert listed(size, Prefix="a/", StartAfter="a/b/3") == (["a/b/4", "a/c/5"], [], -(-2 // size))
    first = s3.list_objects_v2(Bucket=BUCKET, Prefix="a/b/", MaxKeys=1)
    assert (first["KeyCount"], first["IsTruncated"], first["Contents"][0]["Size"]) == (1, True, 5)
    assert s3.list_objects_v2(Bucket=BUCKET, Prefix="nothing/")["KeyCount"] == 0


def test_boto3_puts_conditionally_uploads_in_parts_copies_and_deletes(endpoint: S3Endpoint, s3: Any) -> None:
    s3.put_object(Bucket=BUCKET, Key="x/once", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as taken:
        s3.put_object(Bucket=BUCKET, Key="x/once", Body=b"second", IfNoneMatch="*")
    assert taken.value.response["Error"]["Code"] == "PreconditionFailed"
    s3.put_object(Bucket=BUCKET, Key="x/once", Body=b"third")
    assert (endpoint.root / BUCKET / "x" / "once").read_bytes() == b"third"

    upload = s3.create_multipart_upload(Bucket=BUCKET, Key="x/parts")["UploadId"]
    parts = [{"PartNumber": n, "ETag": s3.upload_part(Bucket=BUCKET, Key="x/parts", UploadId=upload,
                                                      PartNumber=n, Body=body)["ETag"]}
             for n, body in [(1, BLOB), (2, b"tail")]]
    s3.complete_multipart_upload(Bucket=BUCKET, Key="x/parts", UploadId=upload, MultipartUpload={"Parts": parts})
    assert s3.get_object(Bucket=BUCKET, Key="x/parts")["Body"].read() == BLOB + b"tail"
    assert not any(endpoint.staging.iterdir())

    s3.copy_object(Bucket=BUCKET, Key="y/copy", CopySource={"Bucket": BUCKET, "Key": "x/parts"})
    s3.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": "x/parts"}, {"Key": "x/once"}]})
    with pytest.raises(ClientError) as missing:
        s3.head_object(Bucket=BUCKET, Key="x/parts")
    assert missing.value.response["Error"]["Code"] == "404"
    s3.delete_object(Bucket=BUCKET, Key="y/copy")
    assert sorted(os.listdir(endpoint.root / BUCKET)) == []  # emptied folders go, as prefixes do


def test_pyarrow_writes_reads_moves_and_deletes_through_the_endpoint(endpoint: S3Endpoint) -> None:
    fs, path = checkpoints.filesystem(f"s3://{BUCKET}/ck", endpoint.storage_options())
    with fs.open_output_stream(f"{path}/a/one") as out:  # a multipart upload, aws-chunked
        out.write(BLOB)
    assert (endpoint.root / BUCKET / "ck" / "a" / "one").read_bytes() == BLOB
    with fs.open_input_file(f"{path}/a/one") as f:
        assert (f.size(), f.read_at(5, 300)) == (len(BLOB), BLOB[300:305])
    fs.move(f"{path}/a/one", f"{path}/a/two")
    assert sorted(i.path for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))) == [
        f"{path}/a", f"{path}/a/two"]
    fs.delete_file(f"{path}/a/two")
    assert fs.get_file_info(f"{path}/a/two").type == pafs.FileType.NotFound
    assert fs.get_file_info(f"{path}/a").type == pafs.FileType.Directory  # pyarrow's marker


def test_lancedb_reads_the_same_rows_through_the_endpoint_as_from_the_folder(endpoint: S3Endpoint) -> None:
    local, remote = local_and_remote(endpoint)
    assert remote.to_arrow().equals(local.to_arrow())
    assert remote.to_arrow().sort_by("id").equals(frames())
    ids = [3, 500, 999]
    assert remote.take_row_ids(ids).to_arrow().equals(local.take_row_ids(ids).to_arrow())
    assert endpoint.requests["GET"] > 0 and endpoint.bytes_sent > 0


def test_lancedb_writes_a_table_through_the_endpoint(endpoint: S3Endpoint) -> None:
    rows = 11_000  # 5.6 MB of random payload: past lance's first part, so a multipart upload
    payload = np.random.default_rng(0).bytes(rows * 512)
    table = pa.table({"id": pa.array(np.arange(rows)),
                      "payload": pa.array([payload[i * 512:(i + 1) * 512] for i in range(rows)])})
    db = lancedb.connect(f"s3://{BUCKET}/written", storage_options=endpoint.storage_options())
    db.create_table("t", table)
    db.open_table("t").add(table.slice(0, 10))  # the second version's manifest: If-None-Match: *
    assert endpoint.requests["POST"] >= 2  # CreateMultipartUpload, CompleteMultipartUpload
    local = lancedb.connect(str(endpoint.root / BUCKET / "written")).open_table("t")
    assert local.version == 2
    assert local.to_arrow().equals(pa.concat_tables([table, table.slice(0, 10)]))


def test_latency_is_paid_per_request_and_requests_overlap(endpoint: S3Endpoint) -> None:
    put_local(endpoint, "blob", BLOB)
    endpoint.latency_s = 0.05
    start = threading.Barrier(8)
    took: list[float] = []

    def reader(i: int) -> None:
        start.wait()
        for j in range(3):
            began = time.monotonic()
            assert request(endpoint, "GET", "/bucket/blob", {"Range": f"bytes={i * 100 + j}-{i * 100 + j}"})[0] == 206
            took.append(time.monotonic() - began)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(took) == 24 and min(took) >= 0.05
    assert endpoint.max_in_flight > 1 and endpoint.in_flight == 0

    local = lancedb.connect(str(endpoint.root / BUCKET / "db")).create_table(TABLE, frames(250))
    for offset in (250, 500, 750):  # four data files, which lancedb reads at once
        local.add(frames(1000).slice(offset, 250))
    endpoint.latency_s = 0.01
    endpoint.reset_counters()
    remote = lancedb.connect(f"s3://{BUCKET}/db", storage_options=endpoint.storage_options()).open_table(TABLE)
    assert remote.to_arrow().sort_by("id").equals(frames())
    assert endpoint.max_in_flight > 1


def test_a_503_is_answered_as_s3_does_and_lancedb_retries_it(endpoint: S3Endpoint) -> None:
    put_local(endpoint, "blob", BLOB)
    endpoint.fail_next(1, 503)
    status, _, body = request(endpoint, "GET", "/bucket/blob")
    assert status == 503 and b"<Code>SlowDown</Code>" in body
    assert request(endpoint, "GET", "/bucket/blob")[0] == 200  # only the next one failed

    local, remote = local_and_remote(endpoint)
    endpoint.reset_counters()
    endpoint.fail_next(1, 503)
    assert remote.to_arrow().equals(local.to_arrow())
    assert endpoint.statuses[503] == 1 and sum(endpoint.requests.values()) == sum(endpoint.statuses.values())


def test_a_reset_connection_gets_no_answer_and_lancedb_retries_it(endpoint: S3Endpoint) -> None:
    put_local(endpoint, "blob", BLOB)
    endpoint.reset_next(1)
    with pytest.raises(ConnectionResetError) as reset:
        request(endpoint, "GET", "/bucket/blob")
    assert not isinstance(reset.value, http.client.RemoteDisconnected)  # a TCP reset, not a close
    assert request(endpoint, "GET", "/bucket/blob")[0] == 200
    assert endpoint.requests["GET"] == 2 and endpoint.statuses == {200: 1}

    local, remote = local_and_remote(endpoint)
    endpoint.reset_counters()
    endpoint.reset_next(1)
    assert remote.to_arrow().equals(local.to_arrow())
    assert sum(endpoint.requests.values()) == sum(endpoint.statuses.values()) + 1


def test_a_denied_prefix_answers_403_access_denied(endpoint: S3Endpoint, s3: Any) -> None:
    local, remote = local_and_remote(endpoint)
    put_local(endpoint, "open/blob", BLOB)
    endpoint.deny(f"{BUCKET}/db/{TABLE}.lance/data/")
    with pytest.raises(RuntimeError, match="privileges"):
        remote.to_arrow()
    data_file = next((endpoint.root / BUCKET / "db" / f"{TABLE}.lance" / "data").iterdir()).name
    calls: list[Callable[[], object]] = [
        lambda: s3.get_object(Bucket=BUCKET, Key=f"db/{TABLE}.lance/data/{data_file}"),
        lambda: s3.list_objects_v2(Bucket=BUCKET, Prefix=f"db/{TABLE}.lance/data/")]
    for call in calls:
        with pytest.raises(ClientError) as denied:
            call()
        assert (denied.value.response["Error"]["Code"], denied.value.response["ResponseMetadata"]["HTTPStatusCode"]
                ) == ("AccessDenied", 403)
    assert s3.get_object(Bucket=BUCKET, Key="open/blob")["Body"].read() == BLOB
    assert local.to_arrow().num_rows == 1000  # the files are untouched


def test_counters_count_requests_bytes_and_reset(endpoint: S3Endpoint) -> None:
    put_local(endpoint, "blob", BLOB)
    request(endpoint, "GET", "/bucket/blob", {"Range": "bytes=0-99"})
    request(endpoint, "HEAD", "/bucket/blob")
    request(endpoint, "GET", "/bucket/blob")
    assert (endpoint.requests, endpoint.bytes_sent) == ({"GET": 2, "HEAD": 1}, 100 + len(BLOB))
    assert endpoint.max_in_flight == 1 and endpoint.in_flight == 0
    endpoint.reset_counters()
    assert (endpoint.requests, endpoint.statuses, endpoint.bytes_sent, endpoint.max_in_flight) == ({}, {}, 0, 0)
