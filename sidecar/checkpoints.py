"""Data checkpoints: one small JSON file per rank per global step.

Layout (docs/pod-contract.md):
    <uri>/<namespace>/<job>/step-<global_step:012d>/rank-<rank:05d>-of-<world:05d>.json
A step is complete when every rank of one world size has a valid file there.
Files are written whole (temp file + rename locally; S3 puts are atomic) and
carry a sha256 of their state, so a torn or corrupted file is detected and the
previous complete step is used instead.

Storage goes through pyarrow.fs, which speaks local paths and s3:// alike.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import uuid
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlparse

import pyarrow.fs as pafs

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{12})$")
_RANK_FILE = re.compile(r"^rank-(\d{5})-of-(\d{5})\.json$")


def filesystem(uri: str, storage_options: Mapping[str, str] | None = None) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path inside it, from lancedb-style options."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        path = os.path.abspath(parsed.path if parsed.scheme else uri)
        return pafs.LocalFileSystem(), path
    if parsed.scheme == "s3":
        opts = {k.lower(): v for k, v in (storage_options or {}).items()}
        kwargs: dict[str, Any] = {}
        for ours, theirs in (("access_key", ("aws_access_key_id", "access_key_id")),
                             ("secret_key", ("aws_secret_access_key", "secret_access_key")),
                             ("session_token", ("aws_session_token", "session_token")),
                             ("region", ("aws_region", "region"))):
            for key in theirs:
                if key in opts:
                    kwargs[ours] = opts[key]
        endpoint = opts.get("aws_endpoint") or opts.get("endpoint")
        if endpoint:
            ep = urlparse(endpoint)
            kwargs["endpoint_override"] = ep.netloc or endpoint
            kwargs["scheme"] = ep.scheme or "https"
        return pafs.S3FileSystem(**kwargs), f"{parsed.netloc}{parsed.path}".rstrip("/")
    raise ValueError(f"checkpoint uri {uri!r}: only local paths and s3:// are supported")


def _digest(state: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


class Store:
    """The checkpoints of one job."""

    def __init__(self, uri: str, namespace: str, job: str,
                 storage_options: Mapping[str, str] | None = None) -> None:
        self.fs, root = filesystem(uri, storage_options)
        self.root = f"{root}/{namespace}/{job}"
        self.uri = uri

    def _step_dir(self, global_step: int) -> str:
        return f"{self.root}/step-{global_step:012d}"

    def write(self, *, global_step: int, rank: int, world_size: int, state: Mapping[str, Any]) -> str:
        directory = self._step_dir(global_step)
        self.fs.create_dir(directory, recursive=True)
        path = f"{directory}/rank-{rank:05d}-of-{world_size:05d}.json"
        record = {"version": FORMAT_VERSION, "globalStep": global_step, "rank": rank,
                  "worldSize": world_size, "state": dict(state), "sha256": _digest(state)}
        blob = json.dumps(record).encode()
        if isinstance(self.fs, pafs.LocalFileSystem):
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:
            with self.fs.open_output_stream(path) as f:
                f.write(blob)
        return path

    def steps(self) -> list[int]:
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except FileNotFoundError:
            return []
        found = [_STEP_DIR.match(i.base_name) for i in infos if i.type == pafs.FileType.Directory]
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    def _read_step(self, global_step: int) -> dict[int, list[dict[str, Any]]]:
        """Valid rank states of one step, grouped by world size."""
        by_world: dict[int, dict[int, dict[str, Any]]] = {}
        infos = self.fs.get_file_info(pafs.FileSelector(self._step_dir(global_step)))
        for info in infos:
            m = _RANK_FILE.match(info.base_name)
            if not m:
                continue
            rank, world = int(m.group(1)), int(m.group(2))
            try:
                with self.fs.open_input_stream(info.path) as f:
                    record = json.loads(f.read())
                ok = (record.get("version") == FORMAT_VERSION and record.get("rank") == rank
                      and record.get("worldSize") == world and record.get("globalStep") == global_step
                      and record.get("sha256") == _digest(record.get("state")))
            except (OSError, ValueError, TypeError, AttributeError) as exc:
                ok, record = False, {"error": str(exc)}
            if not ok:
                log.warning("checkpoint file %s is corrupt or incomplete; ignoring it", info.path)
                continue
            by_world.setdefault(world, {})[rank] = record["state"]
        return {w: [ranks[r] for r in range(w)] for w, ranks in by_world.items()
                if sorted(ranks) == list(range(w))}

    def latest_complete(
        self, merge: Callable[[list[dict[str, Any]]], dict[str, Any]],
        accept: Callable[[dict[str, Any]], Any] | None = None,
    ) -> tuple[int, dict[str, Any], int] | None:
        """(global_step, merged state, world size) of the newest complete step.

        `merge` is StreamingDataset.merge_state_dicts; `accept` may raise
        ValueError for a state this job cannot use, which skips that step too.
        """
        for step in self.steps():
            complete = self._read_step(step)
            if not complete:
                log.warning("checkpoint step %d is incomplete; trying an older one", step)
                continue
            world = max(complete)
            try:
                merged = merge(complete[world])
                if accept is not None:
                    accept(merged)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("checkpoint step %d cannot be used (%s); trying an older one", step, exc)
                continue
            return step, merged, world
        return None
