"""Data checkpoints: per rank per global step, two-phase, fenced by world, tied to one job.

Layout (docs/pod-contract.md), under `<uri>/<namespace>/<job>/<job uid>/`:
    worlds/world-<epoch:06d>.json                     written once when world <epoch> starts
    step-<step:012d>/w<epoch:06d>-rank-<rank:05d>-of-<world:05d>.json    the rank's record
    step-<step:012d>/w<epoch:06d>-rank-<rank:05d>-of-<world:05d>.commit  its commit marker

Why each part:
- The job's UID is in the path, so a deleted and re-created job (same name, new
  UID) starts at step 0 instead of resuming what another job wrote; reading
  another job's checkpoints takes `spec.checkpoint.resumeFrom`.
- A record carries its provenance (table URI, table, version, columns, filter,
  splits, shuffle, seed, clump size, batch size, epochs, job UID, world epoch)
  and a resume refuses one that does not match the job, naming each field.
- Two phases (docs/agreement.md): a record is the rank's data position; its
  commit marker says the trainer also saved its model for that step. A step is
  complete when every rank of one world has a valid record and a marker.
- Fencing: each world writes its marker, holding the step it resumed from,
  before any of its ranks gets a batch. A record of world e at step s is used
  only if s <= the resume step of every newer world that has started: a stale
  pod of an old world (a partitioned node, a slow deletion) may still write, but
  what it writes after a newer world took over is never resumed. A pod can only
  write under its own world epoch, and the world epoch is part of every file
  name, so it cannot overwrite or outrank a newer world's files either.

Files are written whole and carry a sha256 (sidecar/world/blobs.py), so a torn or
corrupted file makes its step incomplete and an older complete step is used
instead. Reads retry transient storage errors with back-off and then fail
(blobs.StoreUnavailable): a flaky read must never make one rank fall back to an
older step than its peers. Storage goes through pyarrow.fs (local paths, s3://).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

import pyarrow.fs as pafs

from splitfeed.trainer_client.contract import errors, specs

from . import blobs

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
_STEP_DIR = re.compile(r"^step-(\d{12})$")
_RANK_FILE = re.compile(r"^w(\d{6,})-rank-(\d{5})-of-(\d{5})\.(json|commit)$")
_WORLD_FILE = re.compile(r"^world-(\d{6,})\.json$")

Merge = Callable[[list[dict[str, Any]]], dict[str, Any]]

# Provenance key -> the spec field a user would change, for messages. These must
# match for a checkpoint to resume; `epochs` and `worldEpoch` are recorded only.
CHECKED: dict[str, str] = {
    "dataUri": "spec.data.uri",
    "table": "spec.data.table",
    "tableVersion": "the table version (spec.data.version; status.data.tableVersion)",
    "columns": "spec.data.columns",
    "filter": "spec.data.filter",
    "preprocessing": "spec.data.transform, transformArgs, onTransformError, packSequences",
    "numSplits": "spec.data.numSplits",
    "shuffle": "spec.data.shuffle",
    "shuffleSeed": "spec.data.shuffleSeed",
    "shuffleClumpSize": "spec.data.shuffleClumpSize",
    "globalBatchSize": "spec.data.globalBatchSize",
}


class ProvenanceMismatch(errors.DataError):
    """Checkpoints written for other data or another order: resuming them would be wrong."""

    def __init__(self, where: str, differences: list[tuple[str, Any, Any]]) -> None:
        self.fields = [key for key, _, _ in differences]
        listed = "; ".join(
            f"{CHECKED.get(key, key)}: the checkpoint has {found!r}, this job has {ours!r}"
            for key, found, ours in differences
        )
        super().__init__(
            f"the checkpoints at {where} were written for other data or another row order, "
            f"so this job cannot resume them ({listed}). Set those fields back to the "
            "checkpoint's values to resume it, or start at step 0: create a new StreamingJob "
            "(a job only resumes its own checkpoints) or drop spec.checkpoint.resumeFrom"
        )


class StaleWorld(errors.UserError):
    """This pod belongs to a world that a newer world has replaced; it must not serve."""


def provenance(
    job_data: specs.DataSpec, *, table_version: int, job_uid: str, world_epoch: int
) -> dict[str, Any]:
    """What a checkpoint record says it belongs to (see CHECKED for what is compared)."""
    return {
        "dataUri": job_data.uri,
        "table": job_data.table,
        "tableVersion": int(table_version),
        "columns": list(job_data.columns) if job_data.columns else None,
        "filter": job_data.filter,
        "preprocessing": _preprocessing(job_data),
        "numSplits": job_data.num_splits,
        "shuffle": job_data.shuffle,
        "shuffleSeed": job_data.shuffle_seed,
        "shuffleClumpSize": job_data.shuffle_clump_size,
        "globalBatchSize": job_data.global_batch_size,
        "epochs": job_data.epochs,
        "jobUid": job_uid,
        "worldEpoch": int(world_epoch),
    }


def _preprocessing(job_data: specs.DataSpec) -> dict[str, Any] | None:
    """The preprocessing fields, None without any (so older records still compare equal)."""
    if not job_data.transform and job_data.pack_sequences is None:
        return None
    fields = specs.order_fields(job_data)
    return {k: fields[k] for k in ("transform", "transformArgs", "onTransformError", "packSequences")}


def check_provenance(expected: Mapping[str, Any], found: Mapping[str, Any], where: str = "the store") -> None:
    """Raise ProvenanceMismatch naming every order-defining field that differs."""
    differences = [
        (key, found.get(key), expected.get(key)) for key in CHECKED if found.get(key) != expected.get(key)
    ]
    if differences:
        raise ProvenanceMismatch(where, differences)


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


def _rank_name(world_epoch: int, rank: int, world_size: int, ext: str) -> str:
    return f"w{world_epoch:06d}-rank-{rank:05d}-of-{world_size:05d}.{ext}"


@dataclasses.dataclass(frozen=True)
class Found:
    """A complete step: its merged state, and the world that wrote it."""

    step: int
    state: dict[str, Any]
    world_size: int
    world_epoch: int
    provenance: dict[str, Any] | None


class Store:
    """The checkpoints of one job (one UID); `provenance` is what this process writes.

    Without `uid` the pre-UID layout `<uri>/<namespace>/<job>/` is used; that is
    only for callers not yet passing SPLITFEED_JOB_UID and will go.
    """

    def __init__(self, uri: str, namespace: str, job: str,
                 storage_options: Mapping[str, str] | None = None, *,
                 uid: str | None = None, provenance: Mapping[str, Any] | None = None) -> None:
        fs, root = filesystem(uri, storage_options)
        self.root = f"{root}/{namespace}/{job}" + (f"/{uid}" if uid else "")
        self.uri = uri
        self.where = f"{uri.rstrip('/')}/{namespace}/{job}" + (f"/{uid}" if uid else "")
        self.blobs = blobs.Blobs(fs, self.where, FORMAT_VERSION)
        """The store's files: written whole with a checksum, read with retries."""
        self.uid = uid
        self.provenance = dict(provenance) if provenance is not None else None
        self.world_epoch = int(self.provenance["worldEpoch"]) if self.provenance else 0

    # --- writing ---------------------------------------------------------------

    def _step_dir(self, global_step: int) -> str:
        return f"{self.root}/step-{global_step:012d}"

    def record_path(self, global_step: int, rank: int, world_size: int, *, commit: bool = False,
                    world_epoch: int | None = None) -> str:
        """Where a rank's record (or commit marker) lives; default: this store's world."""
        epoch = self.world_epoch if world_epoch is None else world_epoch
        name = _rank_name(epoch, rank, world_size, "commit" if commit else "json")
        return f"{self._step_dir(global_step)}/{name}"

    def write(self, *, global_step: int, rank: int, world_size: int, state: Mapping[str, Any]) -> str:
        """Phase one: the rank's data position for `global_step` (not resumable until committed)."""
        path = self.record_path(global_step, rank, world_size)
        record = {"version": FORMAT_VERSION, "globalStep": global_step, "rank": rank,
                  "worldSize": world_size, "worldEpoch": self.world_epoch,
                  "provenance": self.provenance, "state": dict(state)}
        self.blobs.put(path, record)
        return path

    def commit(self, *, global_step: int, rank: int, world_size: int) -> None:
        """Phase two: the rank's trainer saved its model for `global_step` (docs/agreement.md)."""
        path = self.record_path(global_step, rank, world_size, commit=True)
        self.blobs.put(path, {"version": FORMAT_VERSION, "globalStep": global_step, "rank": rank,
                              "worldSize": world_size, "worldEpoch": self.world_epoch})

    def start_world(self, *, resume_step: int) -> None:
        """Record that this store's world starts from `resume_step`; once per world, by its
        coordinator, before any rank gets a batch. Refuses a world older than one that
        started (StaleWorld); a marker already there (a restarted coordinator) is kept."""
        worlds = self.worlds()
        newer = sorted(e for e in worlds if e > self.world_epoch)
        if newer:
            raise StaleWorld(
                f"world {newer[-1]} of this job has started; this pod belongs to world "
                f"{self.world_epoch}, which it replaced, and must not serve")
        if self.world_epoch in worlds:
            log.info("world %d already started at step %d", self.world_epoch,
                     worlds[self.world_epoch]["resumeStep"])
            return
        self.blobs.put(f"{self.root}/worlds/world-{self.world_epoch:06d}.json",
                       {"version": FORMAT_VERSION, "worldEpoch": self.world_epoch, "resumeStep": resume_step,
                        "provenance": self.provenance})

    # --- reading ---------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps with a directory, newest first (complete or not)."""
        found = [_STEP_DIR.match(i.base_name) for i in self.blobs.list(self.root)
                 if i.type == pafs.FileType.Directory]
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    def worlds(self) -> dict[int, dict[str, Any]]:
        """The world markers: world epoch -> {resumeStep, provenance, ...}."""
        out: dict[int, dict[str, Any]] = {}
        for info in self.blobs.list(f"{self.root}/worlds"):
            m = _WORLD_FILE.match(info.base_name)
            if m is None:
                continue
            marker = self.blobs.get(info.path)
            if marker is not None and marker.get("worldEpoch") == int(m.group(1)):
                out[int(m.group(1))] = marker
        return out

    def newest_world(self) -> int | None:
        """The newest world epoch that started; a fresh run of the same job (`splitfeed
        local` again) must number its worlds after it, or start_world refuses it."""
        return max(self.worlds(), default=None)

    def pinned_version(self) -> int | None:
        """The table version the job's newest started world read; None before any world."""
        worlds = self.worlds()
        for epoch in sorted(worlds, reverse=True):
            version = (worlds[epoch].get("provenance") or {}).get("tableVersion")
            if version is not None:
                return int(version)
        return None

    def _complete(self, global_step: int, resume_steps: Mapping[int, int]) -> list[tuple[int, list[dict[str, Any]]]]:
        """(world epoch, its records by rank) for each world that completed the step and is
        not fenced off by a newer world's resume step; newest world first."""
        files: dict[tuple[int, int, int], dict[str, str]] = {}
        for info in self.blobs.list(self._step_dir(global_step)):
            m = _RANK_FILE.match(info.base_name)
            if m:
                key = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
                files.setdefault(key, {})[m.group(4)] = info.path
        by_world: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
        for (epoch, rank, world), paths in sorted(files.items()):
            if any(global_step > step for e, step in resume_steps.items() if e > epoch):
                continue  # fenced: a newer world started before this step
            if set(paths) != {"json", "commit"}:
                continue  # prepared, never committed: the trainer's model may not exist
            record, marker = self.blobs.get(paths["json"]), self.blobs.get(paths["commit"])
            fields = {"globalStep": global_step, "rank": rank, "worldSize": world, "worldEpoch": epoch}
            if record is None or marker is None or any(
                record.get(k) != v or marker.get(k) != v for k, v in fields.items()
            ):
                log.warning("checkpoint step %d: rank %d of world %d is unusable; ignoring it",
                            global_step, rank, epoch)
                continue
            by_world.setdefault((epoch, world), {})[rank] = record
        complete = [(epoch, [ranks[r] for r in range(world)])
                    for (epoch, world), ranks in by_world.items() if sorted(ranks) == list(range(world))]
        return sorted(complete, key=lambda c: c[0], reverse=True)

    def _resume_steps(self) -> dict[int, int]:
        return {e: int(m.get("resumeStep", 0)) for e, m in self.worlds().items()}

    def _use(self, global_step: int, epoch: int, records: list[dict[str, Any]],
             expect: Mapping[str, Any] | None, merge: Merge) -> Found:
        """Check provenance (ProvenanceMismatch), then merge the ranks' states."""
        found = records[0].get("provenance")
        if expect is not None:
            for record in records:
                check_provenance(expect, record.get("provenance") or {}, self.where)
        if self.uid is not None:
            for record in records:
                uid = (record.get("provenance") or {}).get("jobUid")
                if uid != self.uid:
                    raise ProvenanceMismatch(self.where, [("jobUid", uid, self.uid)])
        merged = merge([r["state"] for r in records])
        return Found(global_step, merged, len(records), epoch, found)

    def committed(self, *, global_step: int, rank: int, world_size: int, world_epoch: int | None = None) -> bool:
        """World `world_epoch` (default: this store's) holds the rank's commit marker for `global_step`."""
        path = self.record_path(global_step, rank, world_size, commit=True, world_epoch=world_epoch)
        return self.blobs.get(path) is not None

    def complete(self, global_step: int) -> bool:
        """Some world not fenced off holds `global_step` complete (a record and a marker per rank)."""
        return bool(self._complete(global_step, self._resume_steps()))

    def find(self, global_step: int, merge: Merge, *, expect: Mapping[str, Any] | None = None) -> Found | None:
        """Exactly `global_step` if complete (newest eligible world), else None."""
        complete = self._complete(global_step, self._resume_steps())
        if not complete:
            return None
        epoch, records = complete[0]
        return self._use(global_step, epoch, records, expect, merge)

    def load(self, global_step: int, merge: Merge, *, expect: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The merged state of exactly `global_step`; an error, never an older step, if it is
        not complete. `expect` (this job's provenance) is checked: ProvenanceMismatch."""
        found = self.find(global_step, merge, expect=expect)
        if found is None:
            raise errors.UserError(
                f"checkpoint step {global_step} under {self.where} is not complete (a record and a "
                "commit marker from every rank of one world); the world was told to resume there")
        return found.state

    def newest(self, merge: Merge, *, expect: Mapping[str, Any] | None = None,
               accept: Callable[[dict[str, Any]], Any] | None = None) -> Found | None:
        """The newest complete step. Incomplete, corrupt or fenced steps are skipped (logged);
        a provenance mismatch is raised, not skipped; storage errors are retried, then raised.
        `accept` may raise ValueError for a state this job cannot use, which skips that step."""
        resume_steps = self._resume_steps()
        for step in self.steps():
            complete = self._complete(step, resume_steps)
            if not complete:
                log.warning("checkpoint step %d is incomplete; trying an older one", step)
                continue
            epoch, records = complete[0]
            try:
                found = self._use(step, epoch, records, expect, merge)
                if accept is not None:
                    accept(found.state)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("checkpoint step %d cannot be used (%s); trying an older one", step, exc)
                continue
            return found
        return None

def store_options(job: specs.JobSpec, secret: Mapping[str, str] | None) -> dict[str, str]:
    """The storage options of spec.checkpoint.uri: the Secret's, and spec.data.storageOptions
    (an endpoint, a region) when the checkpoints are on the same kind of store as the table,
    which they nearly always are (a MinIO or R2 endpoint given once must serve both)."""
    same = urlparse(job.checkpoint.uri or "").scheme == urlparse(job.data.uri).scheme
    return {**(dict(job.data.storage_options) if same else {}), **dict(secret or {})}


def stores(job: specs.JobSpec, *, uid: str, storage_options: Mapping[str, str] | None = None,
           provenance: Mapping[str, Any] | None = None) -> list[Store]:
    """Where a job may resume from, in order: its own checkpoints, then (when it has none)
    the ones `spec.checkpoint.resumeFrom` names. Empty without spec.checkpoint.uri."""
    uri = job.checkpoint.uri
    if not uri:
        return []
    storage_options = store_options(job, storage_options)
    own = Store(uri, job.namespace, job.name, storage_options, uid=uid, provenance=provenance)
    source = job.checkpoint.resume_from
    if source is None:
        return [own]
    return [own, Store(uri, job.namespace, source.name or job.name, storage_options, uid=source.uid)]


def newest(stores: Sequence[Store], merge: Merge, *, expect: Mapping[str, Any] | None = None,
           accept: Callable[[dict[str, Any]], Any] | None = None) -> Found | None:
    """The newest complete step of the first store that has one (see `stores`)."""
    for store in stores:
        found = store.newest(merge, expect=expect, accept=accept)
        if found is not None:
            return found
    return None


def load(stores: Sequence[Store], global_step: int, merge: Merge, *,
         expect: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Exactly `global_step` from the first store that holds it complete; an error otherwise."""
    for store in stores:
        found = store.find(global_step, merge, expect=expect)
        if found is not None:
            return found.state
    where = " or ".join(s.where for s in stores) or "nowhere (no spec.checkpoint.uri)"
    raise errors.UserError(
        f"checkpoint step {global_step} under {where} is not complete (a record and a commit "
        "marker from every rank of one world); the world was told to resume there")
