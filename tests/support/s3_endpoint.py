"""An S3 endpoint over a local folder, fast enough to measure reading throughput through.

moto_server spends milliseconds of Python on each request (it could not serve 28,800
rows of a 512-byte column in 10 minutes), which hides whatever a reader does. This
serves the calls of lancedb (the Rust object_store crate) and pyarrow's S3FileSystem
from files, a thread per connection so that requests overlap as on a real store;
`latency_s` stands in for a store's time to first byte.

Each top-level folder of `root` is a bucket, each file below it an object keyed by its
path in the bucket: a table written to `root/<bucket>/db` reads as `s3://<bucket>/db`.
An empty folder is a directory marker (`key/`, as pyarrow writes them), and a delete
removes the folders it empties, as a prefix with no keys is gone on S3. Signatures
are not checked.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import email.utils
import io
import os
import pathlib
import re
import shutil
import socket
import stat
import struct
import sys
import tempfile
import threading
import time
import uuid
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import IO
from urllib.parse import parse_qsl, unquote, urlsplit
from xml.sax.saxutils import escape

CREDENTIALS = {"aws_access_key_id": "splitfeed", "aws_secret_access_key": "not-a-secret"}
"""Any will do; without some, lance looks for real ones (the AWS SDK's chain) and fails."""
_RESET = 0
"""A queued fault that resets the connection instead of answering."""
_CODES = {400: "InvalidRequest", 403: "AccessDenied", 404: "NoSuchKey", 412: "PreconditionFailed",
          416: "InvalidRange", 500: "InternalError", 501: "NotImplemented", 503: "SlowDown"}


class S3Endpoint:
    """Serves `root` as S3 on 127.0.0.1, on a port of its own, while entered.

    Counters, kept under a lock: `requests` by method, `statuses` by status answered,
    `bytes_sent` (bodies only), `in_flight` now and `max_in_flight` since the last
    `reset_counters()`. A request is in flight from its arrival to its answer's start.
    """

    def __init__(self, root: str | os.PathLike[str], latency_s: float = 0.0) -> None:
        self.root = pathlib.Path(root)
        self.latency_s = latency_s
        """Slept before answering each request (a fault too); may be changed at any time."""
        self.staging = self.root / ".s3-staging"
        """Staged files and multipart parts: on root's file system, so that a rename into place
        is atomic, and dot-named, as no bucket can be."""
        self.in_flight = 0
        self._lock = threading.Lock()
        self._faults: collections.deque[int] = collections.deque()
        self._denied: list[str] = []
        self._server: _Server | None = None
        self.reset_counters()

    @property
    def url(self) -> str:
        assert self._server is not None, "enter the endpoint first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def storage_options(self) -> dict[str, str]:
        """lancedb's storage options, which `checkpoints.filesystem` also reads for pyarrow;
        object_store addresses buckets path-style, as served here, unless told otherwise."""
        return {"aws_endpoint": self.url, "aws_region": "us-east-1", "allow_http": "true", **CREDENTIALS}

    def reset_counters(self) -> None:
        with self._lock:
            self.requests: collections.Counter[str] = collections.Counter()
            self.statuses: collections.Counter[int] = collections.Counter()
            self.bytes_sent = 0
            self.max_in_flight = self.in_flight  # those still running are still in flight

    def fail_next(self, n: int, status: int = 503) -> None:
        """The next n requests are answered `status` with an S3 error body."""
        with self._lock:
            self._faults.extend([status] * n)

    def reset_next(self, n: int) -> None:
        """The next n requests get no answer: their connection is reset."""
        with self._lock:
            self._faults.extend([_RESET] * n)

    def deny(self, prefix: str) -> None:
        """From now on any request for `bucket/key`, or a listing of `bucket/prefix`, that starts
        with `prefix` is answered 403 AccessDenied."""
        with self._lock:
            self._denied.append(prefix)

    def denied(self, resource: str) -> bool:
        return any(resource.startswith(prefix) for prefix in self._denied)

    def __enter__(self) -> S3Endpoint:
        self.staging.mkdir(parents=True, exist_ok=True)
        self._server = _Server(self)
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},  # leave fast
                         name="s3-endpoint", daemon=True).start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        assert self._server is not None
        self._server.shutdown()  # returns once serve_forever has
        with self._lock:
            connections = list(self._server.connections)
        for connection in connections:  # kept alive by the clients' pools
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self._server.server_close()  # joins the connections' threads
        shutil.rmtree(self.staging, ignore_errors=True)

    def _count(self, method: str | None = None, status: int | None = None, sent: int = 0,
               ended: bool = False) -> int | None:
        """A request's arrival (`method`; returns the fault it is to get), its answer, bytes sent,
        or the end of its time in flight."""
        with self._lock:
            self.bytes_sent += sent
            self.in_flight -= ended
            if status is not None:
                self.statuses[status] += 1
            if method is None:
                return None
            self.requests[method] += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return self._faults.popleft() if self._faults else None


class _S3Error(Exception):
    def __init__(self, status: int, code: str = "") -> None:
        super().__init__(status)
        self.status, self.code = status, code or _CODES.get(status, HTTPStatus(status).phrase.replace(" ", ""))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # object_store opens dozens of connections at once

    def __init__(self, endpoint: S3Endpoint) -> None:
        self.endpoint = endpoint
        self.connections: set[socket.socket] = set()
        super().__init__(("127.0.0.1", 0), _Handler)

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that went away is none of our errors; anything else is printed."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


def _xml(tag: str, *children: str, **fields: object) -> str:
    inner = "".join(f"<{k}>{escape(str(v).lower() if isinstance(v, bool) else str(v))}</{k}>"
                    for k, v in fields.items())
    return f"<{tag}>{inner}{''.join(children)}</{tag}>"


def _document(element: str) -> bytes:
    return f'<?xml version="1.0" encoding="UTF-8"?>\n{element}'.encode()


def _etag(st: os.stat_result) -> str:
    return f'"{st.st_size:x}-{st.st_mtime_ns:x}"'


def _iso(st: os.stat_result) -> str:
    return datetime.fromtimestamp(st.st_mtime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _byte_range(header: str, size: int) -> tuple[int, int] | None:
    """(first, last) of `bytes=a-b`, `bytes=a-` or `bytes=-n`; None for any other form (which
    RFC 9110 says to ignore); 416 when no byte of the object is in it."""
    match = re.fullmatch(r"bytes=(\d*)-(\d*)", header.strip())
    if not match or match[1] == match[2] == "":
        return None
    if match[1] == "":
        first, last = max(size - int(match[2]), 0), size - 1
    else:
        first, last = int(match[1]), min(int(match[2]) if match[2] else size - 1, size - 1)
    if first > last:
        raise _S3Error(416)
    return first, last


def _dechunk(stream: IO[bytes] | io.BufferedIOBase) -> bytes:
    """A chunked body, HTTP's or S3's aws-chunked inside it (pyarrow's uploads, with a checksum
    trailer): `size[;extension]` CRLF data CRLF ... `0` CRLF trailers CRLF."""
    out = bytearray()
    while size := int(stream.readline().split(b";")[0], 16):
        out += stream.read(size)
        stream.readline()
    while stream.readline().strip():
        pass
    return bytes(out)


def _xml_texts(body: bytes, name: str) -> list[str]:
    """The text of each element `name` in a request body, in any namespace."""
    return [e.text or "" for e in ElementTree.fromstring(body).iter() if e.tag.rsplit("}", 1)[-1] == name]


def _keys(base: str, prefix: str) -> list[str]:
    """The keys in bucket folder `base` that may start with `prefix` (only the folder named by its
    whole segments is walked): every file, and every empty folder as a marker `folder/`."""
    keys: list[str] = []
    if ".." in prefix.split("/"):
        return keys
    for folder, folders, files in os.walk(os.path.join(base, prefix.rpartition("/")[0])):
        relative = os.path.relpath(folder, base).replace(os.sep, "/")
        keys.extend(name if relative == "." else f"{relative}/{name}" for name in files)
        if not folders and not files and relative != ".":
            keys.append(relative + "/")
    return keys


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, which object_store's connection pool relies on
    disable_nagle_algorithm = True  # headers and body go out as separate writes
    server: _Server
    OPERATIONS = {  # (method, the query parameter or what the path names): the S3 operation
        ("GET", "key"): "_get", ("HEAD", "key"): "_get", ("GET", "bucket"): "_list",
        ("HEAD", "bucket"): "_head_bucket", ("PUT", "key"): "_put", ("DELETE", "key"): "_delete_object",
        ("POST", "delete"): "_delete_objects", ("POST", "uploads"): "_create_upload",
        ("PUT", "partNumber"): "_upload_part", ("POST", "uploadId"): "_complete_upload",
        ("DELETE", "uploadId"): "_abort_upload"}

    def setup(self) -> None:
        super().setup()
        with self.server.endpoint._lock:
            self.server.connections.add(self.connection)

    def finish(self) -> None:
        with self.server.endpoint._lock:
            self.server.connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        endpoint = self.server.endpoint
        fault = endpoint._count(self.command)
        self.answered = False
        url = urlsplit(self.path)
        query = dict(parse_qsl(url.query, keep_blank_values=True))
        bucket, _, key = unquote(url.path).lstrip("/").partition("/")
        try:
            body = self._body()
            if endpoint.latency_s > 0:
                time.sleep(endpoint.latency_s)
            if fault == _RESET:
                return self._reset()
            if fault is not None:
                raise _S3Error(fault)
            if endpoint.denied(f"{bucket}/{key or query.get('prefix', '')}"):
                raise _S3Error(403)
            subject = next((p for p in ("uploads", "partNumber", "uploadId", "delete") if p in query),
                           "key" if key else "bucket")
            operation = self.OPERATIONS.get((self.command, subject))
            if operation is None:
                raise _S3Error(501)
            getattr(self, operation)(bucket, key, query, body)
        except _S3Error as error:
            self._reply(error.status, _document(_xml(
                "Error", Code=error.code, Message=HTTPStatus(error.status).phrase,
                Resource=f"/{bucket}/{key}", RequestId=uuid.uuid4().hex)))
        finally:
            if not self.answered:  # reset, or a failure of ours or the client's
                endpoint._count(ended=True)

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def _body(self) -> bytes:
        """The request's body, read whole so that the connection stays usable whatever the answer."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raw = _dechunk(self.rfile)
        else:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.headers.get("x-amz-content-sha256", "").startswith("STREAMING-"):
            raw = _dechunk(io.BytesIO(raw))
        return raw

    def _reply(self, status: int, body: bytes = b"", headers: Mapping[str, str] | None = None,
               length: int | None = None) -> None:
        """Status, headers, and `body` unless this is a HEAD; `length` is the Content-Length of a
        HEAD or of a body the caller sends itself. The request stops being in flight here, so
        that a client's next request never overlaps the end of this one."""
        self.answered = True
        self.server.endpoint._count(status=status, sent=len(body) if self.command != "HEAD" else 0, ended=True)
        self.send_response(status)
        for name, value in {"Content-Type": "application/xml", **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _reset(self) -> None:
        """Close without answering; a zero linger makes the close a TCP reset."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()  # takes effect once finish() has closed rfile and wfile
        self.close_connection = True

    def _bucket(self, bucket: str) -> str:
        if not bucket or bucket.startswith(".") or "/" in bucket:
            raise _S3Error(400, "InvalidBucketName")
        return os.path.join(self.server.endpoint.root, bucket)

    def _path(self, bucket: str, key: str) -> str:
        """The file of an object, or the folder of a directory marker (a key ending in /)."""
        if any(part in ("", ".", "..") for part in key.rstrip("/").split("/")):
            raise _S3Error(400, "InvalidKey")
        return os.path.join(self._bucket(bucket), key.rstrip("/"))

    def _stat(self, bucket: str, key: str) -> tuple[str, os.stat_result]:
        path = self._path(bucket, key)
        with contextlib.suppress(OSError):
            if stat.S_ISDIR((st := os.stat(path)).st_mode) == key.endswith("/"):
                return path, st
        raise _S3Error(404, "NoSuchKey" if os.path.isdir(self._bucket(bucket)) else "NoSuchBucket")

    # -- the operations (OPERATIONS), each given the bucket, key, query and body

    def _head_bucket(self, bucket: str, key: str, query: Mapping[str, str], body: bytes) -> None:
        self._reply(200 if os.path.isdir(self._bucket(bucket)) else 404)

    def _get(self, bucket: str, key: str, query: Mapping[str, str], body: bytes) -> None:
        path, st = self._stat(bucket, key)
        size = 0 if key.endswith("/") else st.st_size
        span = _byte_range(self.headers["Range"], size) if self.headers["Range"] else None
        first, last = span or (0, size - 1)
        headers = {"Content-Type": "application/octet-stream", "ETag": _etag(st), "Accept-Ranges": "bytes",
                   "Last-Modified": email.utils.formatdate(st.st_mtime, usegmt=True)}
        if span:
            headers["Content-Range"] = f"bytes {first}-{last}/{size}"
        self._reply(206 if span else 200, headers=headers, length=last - first + 1)
        if self.command == "GET" and last >= first:
            # Counted before it goes out: counted after, a client that already has the bytes
            # could reset the counters first and see them counted again (a flaky test did).
            self.server.endpoint._count(sent=last - first + 1)
            with open(path, "rb") as f:  # not socket.sendfile, which builds a selector per call
                offset, end = first, last + 1
                while offset < end and (sent := os.sendfile(self.connection.fileno(), f.fileno(), offset,
                                                            end - offset)):
                    offset += sent

    def _put(self, bucket: str, key: str, query: Mapping[str, str], body: bytes) -> None:
        """PutObject, CopyObject, or a directory marker."""
        source = self.headers.get("x-amz-copy-source")
        if key.endswith("/"):
            os.makedirs(self._path(bucket, key), exist_ok=True)
            self._reply(200, headers={"ETag": '"0"'})
        elif source is not None:
            from_bucket, _, from_key = unquote(source.split("?")[0]).lstrip("/").partition("/")
            with open(self._stat(from_bucket, from_key)[0], "rb") as original:
                st = self._store(bucket, key, lambda out: shutil.copyfileobj(original, out))
            self._reply(200, _document(_xml("CopyObjectResult", LastModified=_iso(st), ETag=_etag(st))))
        else:
            self._reply(200, headers={"ETag": _etag(self._store(bucket, key, lambda out: out.write(body)))})

    def _store(self, bucket: str, key: str, write: Callable[[IO[bytes]], object]) -> os.stat_result:
        """Write an object into a staged file and move that into place atomically; with
        `If-None-Match: *` (how lance commits a version) only if the key is free, which a hard
        link checks atomically."""
        path = self._path(bucket, key)
        if not os.path.isdir(self._bucket(bucket)):
            raise _S3Error(404, "NoSuchBucket")
        with tempfile.NamedTemporaryFile(dir=self.server.endpoint.staging, delete=False) as staged:
            write(staged)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if self.headers.get("If-None-Match", "").strip() == "*":
                os.link(staged.name, path)
            else:
                os.replace(staged.name, path)
            return os.stat(path)
        except FileExistsError:
            raise _S3Error(412) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged.name)

    def _delete_object(self, bucket: str, key: str, query: Mapping[str, str], body: bytes) -> None:
        self._delete(bucket, key)
        self._reply(204)

    def _delete_objects(self, bucket: str, key: str, query: Mapping[str, str], body: bytes) -> None:
        results = []
        for key in _xml_texts(body, "Key"):
            if self.server.endpoint.denied(f"{bucket}/{key}"):
                results.append(_xml("Error", Key=key, Code="AccessDenied", Message="Access Denied"))
            else:
                self._delete(bucket, key)
                results.append(_xml("Deleted", Key=key))
        self._reply(200, _document(_xml("DeleteResult", *results)))

    def _delete(self, bucket: str, key: str) -> None:
        """Remove an object, then the folders left empty up to the bucket."""
        path, top = self._path(bucket, key), self._bucket(bucket)
        with contextlib.suppress(OSError):  # absent, or a folder that still holds something
            if key.endswith("/"):
                os.rmdir(path)
            else:
                os.unlink(path)
            while len(path := os.path.dirname(path)) > len(top):
                os.rmdir(path)

    def _upload(self, upload_id: str) -> str:
        folder = os.path.join(self.server.endpoint.staging, upload_id)
        if not re.fullmatch(r"[0-9a-f]{32}", upload_id) or not os.path.isdir(folder):
            raise _S3Error(404, "NoSuchUpload")
        return folder

    def _create_upload(self, bucket: str, key: str, query: Mapping[str, str], body: bytes) -> None:
        upload_id = uuid.uuid4().hex
        os.mkdir(os.path.join(self.server.endpoint.staging, upload_id))
        self._reply(200, _document(_xml("InitiateMultipartUploadResult", Bucket=bucket, Key=key, UploadId=upload_id)))

    def _upload_part(self, bucket: str, key: str, query: Mapping[str, str], body: bytes) -> None:
        with open(os.path.join(self._upload(query["uploadId"]), str(int(query["partNumber"]))), "wb") as f:
            f.write(body)
        self._reply(200, headers={"ETag": f'"{uuid.uuid4().hex}"'})

    def _complete_upload(self, bucket: str, key: str, query: Mapping[str, str], body: bytes) -> None:
        """The parts the body names, in its order, become the object."""
        folder = self._upload(query["uploadId"])

        def concatenate(out: IO[bytes]) -> None:
            for number in _xml_texts(body, "PartNumber"):
                with open(os.path.join(folder, str(int(number))), "rb") as part:
                    shutil.copyfileobj(part, out)

        st = self._store(bucket, key, concatenate)
        shutil.rmtree(folder)
        self._reply(200, _document(_xml("CompleteMultipartUploadResult", Location=f"/{bucket}/{key}",
                                        Bucket=bucket, Key=key, ETag=_etag(st))))

    def _abort_upload(self, bucket: str, key: str, query: Mapping[str, str], body: bytes) -> None:
        shutil.rmtree(self._upload(query["uploadId"]))
        self._reply(204)

    def _list(self, bucket: str, key: str, query: Mapping[str, str], body: bytes) -> None:
        """ListObjectsV2: keys in UTF-8 order after start-after or the continuation token; those
        sharing a prefix up to the delimiter rolled into one CommonPrefixes; max-keys entries of
        both per page. The token is the page's last entry, so a common prefix is never repeated."""
        base = self._bucket(bucket)
        if not os.path.isdir(base):
            raise _S3Error(404, "NoSuchBucket")
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        max_keys = int(query.get("max-keys", 1000))
        last = max(query.get("start-after", ""), base64.urlsafe_b64decode(query.get("continuation-token", "")).decode())
        contents: list[str] = []
        prefixes: list[str] = []
        truncated = False
        for key in sorted(k for k in _keys(base, prefix) if k.startswith(prefix) and k > last):
            cut = key.find(delimiter, len(prefix)) if delimiter else -1
            entry = key[: cut + len(delimiter)] if cut >= 0 else key
            if entry == last:
                continue
            if truncated := len(contents) + len(prefixes) == max_keys:
                break
            if cut >= 0:
                prefixes.append(_xml("CommonPrefixes", Prefix=entry))
            else:
                st = os.stat(os.path.join(base, key))
                contents.append(_xml("Contents", Key=key, LastModified=_iso(st), ETag=_etag(st),
                                     Size=0 if key.endswith("/") else st.st_size, StorageClass="STANDARD"))
            last = entry
        page: dict[str, object] = dict(Name=bucket, Prefix=prefix, Delimiter=delimiter, MaxKeys=max_keys,
                                       KeyCount=len(contents) + len(prefixes), IsTruncated=truncated)
        if "continuation-token" in query:
            page["ContinuationToken"] = query["continuation-token"]
        if truncated:
            page["NextContinuationToken"] = base64.urlsafe_b64encode(last.encode()).decode()
        self._reply(200, _document(_xml("ListBucketResult", *contents, *prefixes, **page)))
