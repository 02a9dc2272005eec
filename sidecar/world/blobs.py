"""Checksummed JSON records in one store, written whole and read with retries (for checkpoints.py).

A record is written whole (temp file + rename locally; S3 puts are atomic) with the
sha256 of its content beside it, so a torn or corrupted file reads as None, never as
a wrong record. Transient storage errors are retried with doubling waits and then
raised as StoreUnavailable; absence is not retried: a flaky read must never look like
a missing file, which would make one rank fall back to an older step than its peers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import pyarrow.fs as pafs

from splitfeed.trainer_client.contract import errors

log = logging.getLogger(__name__)

T = TypeVar("T")


class StoreUnavailable(errors.UserError):
    """The checkpoint store kept failing after retries; a restart may succeed."""


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def sealed(record: Mapping[str, Any]) -> bytes:
    """`record` as JSON with its sha256 added."""
    return json.dumps({**record, "sha256": _digest(record)}).encode()


def unsealed(blob: bytes, version: int) -> dict[str, Any] | None:
    """The record if it is of `version` and its checksum holds, else None (torn, corrupt, or not ours)."""
    try:
        record = json.loads(blob)
        if not isinstance(record, dict) or record.get("version") != version:
            return None
        digest = record.pop("sha256", None)
        return record if digest == _digest(record) else None
    except (ValueError, TypeError):
        return None


class Blobs:
    """The records of format `version` under one filesystem; `where` names it in messages."""

    retries = 5
    """Attempts per storage call before StoreUnavailable; the waits double from backoff_s."""
    backoff_s = 0.2

    def __init__(self, fs: pafs.FileSystem, where: str, version: int) -> None:
        self.fs = fs
        self.where = where
        self.version = version

    def put(self, path: str, record: Mapping[str, Any]) -> None:
        """Write `path` whole, retrying a store's transient errors as reads do (a put of the
        same bytes again is harmless): a drain's checkpoint must not fail on one 503."""
        blob = sealed(record)
        self._retry(f"writing {path}", lambda: self._put_once(path, blob))

    def _put_once(self, path: str, blob: bytes) -> None:
        """Write `path` whole: temp file + rename locally, a single put on object storage."""
        if isinstance(self.fs, pafs.LocalFileSystem):  # object stores have no directories to make
            self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:
            with self.fs.open_output_stream(path) as f:
                f.write(blob)

    def _retry(self, what: str, read: Callable[[], T]) -> T:
        """`read()` (or a write), retried with doubling waits on transient errors (not on absence)."""
        delay = self.backoff_s
        for attempt in range(1, self.retries + 1):
            try:
                return read()
            except FileNotFoundError:
                raise
            except OSError as exc:
                if attempt == self.retries:
                    raise StoreUnavailable(
                        f"checkpoint store {self.where}: {what} failed {attempt} times ({exc}); "
                        "check spec.checkpoint.uri and its credentials") from exc
                log.warning("checkpoint store %s: %s failed (%s); retry %d of %d in %.1f s",
                            self.where, what, exc, attempt, self.retries - 1, delay)
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def list(self, directory: str) -> list[pafs.FileInfo]:
        """What `directory` holds; empty when it does not exist."""
        def read() -> list[pafs.FileInfo]:
            infos = self.fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
            return list(infos)
        try:
            return self._retry(f"listing {directory}", read)
        except FileNotFoundError:
            return []

    def get(self, path: str) -> dict[str, Any] | None:
        """The record at `path`; None when absent, or corrupt, torn or of another format (logged)."""
        def read() -> bytes:
            with self.fs.open_input_stream(path) as f:
                return bytes(f.read())
        try:
            blob = self._retry(f"reading {path}", read)
        except FileNotFoundError:
            return None
        record = unsealed(blob, self.version)
        if record is None:
            log.warning("checkpoint file %s is corrupt, torn or of another format; ignoring it", path)
        return record
