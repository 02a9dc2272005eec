"""`splitfeed sidecar`: load the job, open the table, resume, serve until done.

The edge where configuration, environment, storage and signals meet; the
logic lives in `serving`, `reading`, `checkpoints` and `positions`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from splitfeed.trainer_client import errors, specs

from . import checkpoints, positions, reading, serving, workers

log = logging.getLogger(__name__)

DRAIN_ANNOTATION = "splitfeed.io/drain"
CHECKPOINT_ANNOTATION = "splitfeed.io/checkpoint"
FAILURE_GRACE_S = 10.0


@dataclasses.dataclass(frozen=True)
class SidecarSettings:
    config: Path
    socket_dir: Path
    rank: int = 0
    """Global rank of this pod's first local rank."""
    world_size: int = 1
    local_world_size: int = 1
    resume: str = "latest"
    checksum: str | None = None
    podinfo_dir: Path | None = None
    storage_options_dir: Path | None = None
    termination_log: Path | None = None

    @classmethod
    def from_env(cls, **overrides: Any) -> SidecarSettings:
        env = os.environ
        values: dict[str, Any] = {
            "socket_dir": Path(env.get("SPLITFEED_SOCKET_DIR", "/var/run/splitfeed")),
            "rank": int(env.get("RANK", "0")),
            "world_size": int(env.get("WORLD_SIZE", "1")),
            "local_world_size": int(env.get("LOCAL_WORLD_SIZE", "1")),
            "resume": env.get("SPLITFEED_RESUME", "latest"),
            "checksum": env.get("SPLITFEED_CONFIG_CHECKSUM") or None,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def load_job(settings: SidecarSettings) -> specs.JobSpec:
    try:
        config = json.loads(settings.config.read_text())
    except (OSError, ValueError) as exc:
        raise errors.UserError(f"cannot read the job config {settings.config}: {exc}") from exc
    if settings.checksum and specs.data_config_checksum(config) != settings.checksum:
        raise errors.UserError(
            f"job config {settings.config} does not match SPLITFEED_CONFIG_CHECKSUM; "
            "the ConfigMap changed under a running world: restart the world")
    try:
        job = specs.parse_data_config(config)
    except ValueError as exc:
        raise errors.UserError(str(exc)) from exc
    job = dataclasses.replace(job, replicas=settings.world_size // job.gpus_per_replica or 1)
    try:
        job.check_topology()
    except ValueError as exc:
        raise errors.UserError(str(exc)) from exc
    return job


def read_storage_options(directory: Path | None) -> dict[str, str]:
    """One option per file, as a Secret volume lays them out."""
    if directory is None or not directory.is_dir():
        return {}
    return {p.name: p.read_text().strip() for p in sorted(directory.iterdir())
            if p.is_file() and not p.name.startswith(".")}


def read_annotations(podinfo_dir: Path | None) -> dict[str, str]:
    """The downward-API annotations file: key="value" per line."""
    if podinfo_dir is None:
        return {}
    try:
        text = (podinfo_dir / "annotations").read_text()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            try:
                found[key.strip()] = json.loads(value)
            except ValueError:
                found[key.strip()] = value.strip().strip('"')
    return found


class RequestWatcher:
    """Turns new drain / checkpoint annotation tokens into requests to the server."""

    def __init__(self, server: serving.Server, podinfo_dir: Path | None) -> None:
        self._server = server
        self._dir = podinfo_dir
        self._seen = read_annotations(podinfo_dir)  # tokens present at start are old
        self._next_check = 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if self._dir is None or now < self._next_check:
            return
        self._next_check = now + 0.5
        current = read_annotations(self._dir)
        for key, drain in ((DRAIN_ANNOTATION, True), (CHECKPOINT_ANNOTATION, False)):
            token = current.get(key)
            if token and token != self._seen.get(key):
                log.info("%s requested (token %s)", "drain" if drain else "checkpoint", token)
                self._server.request_checkpoint(drain=drain)
        self._seen = current


def resume_position(job: specs.JobSpec, settings: SidecarSettings,
                    storage_options: Mapping[str, str]) -> tuple[int, int | None]:
    """(first global step, world size that wrote it) from the newest complete checkpoint."""
    if settings.resume == "none" or not job.checkpoint.uri:
        return 0, None
    store = checkpoints.Store(job.checkpoint.uri, job.namespace, job.name, storage_options)
    found = store.latest_complete(reading.merge_states,
                                  accept=lambda s: positions.position_from_state(job.data, s))
    if found is None:
        log.info("no complete checkpoint under %s: starting at step 0", job.checkpoint.uri)
        return 0, None
    step, merged, world = found
    log.info("resuming at global step %d from a checkpoint written by %d ranks", step, world)
    return step, world


@dataclasses.dataclass
class Sidecar:
    """A prepared sidecar: its server, and why it cannot serve (if it cannot)."""

    server: serving.Server
    settings: SidecarSettings
    steps_per_epoch: int
    failure: str | None
    permanent: bool = False
    """The failure is a DataError: the same data fails the same way in any world."""


def prepare(settings: SidecarSettings) -> Sidecar:
    """Load, open, resume and bind. Bad input becomes `failure`, reported to trainers."""
    ranks = [settings.rank + i for i in range(settings.local_world_size)]
    failure: str | None = None
    permanent = False
    job: specs.JobSpec | None = None
    storage_options = read_storage_options(settings.storage_options_dir)
    steps_per_epoch, total_steps, start_step = 1, 0, 0
    try:
        job = load_job(settings)
        table = reading.open_table(job.data, storage_options)
        steps_per_epoch = reading.layout_epoch(table, job.data, 0).steps_per_epoch
        total_steps = steps_per_epoch * job.data.epochs
        start_step, _ = resume_position(job, settings, storage_options)
        del table
    except errors.UserError as exc:
        failure, permanent = str(exc), isinstance(exc, errors.DataError)
        log.error("%s", failure)

    def factory(rank: int, first_step: int):  # type: ignore[no-untyped-def]
        assert job is not None
        return workers.iter_rank_batches(job.data, storage_options, rank=rank,
                                         world_size=settings.world_size,
                                         start_global_step=first_step)

    checkpoint = None
    if job is not None and job.checkpoint.uri:
        store = checkpoints.Store(job.checkpoint.uri, job.namespace, job.name, storage_options)
        data, world, spe = job.data, settings.world_size, steps_per_epoch

        def checkpoint(rank: int, step: int) -> str:
            state = positions.state_dict(data, positions.position_of(step, spe))
            return store.write(global_step=step, rank=rank, world_size=world, state=state)

    server = serving.Server(
        directory=settings.socket_dir, ranks=ranks, world_size=settings.world_size,
        factory=factory, steps_per_epoch=steps_per_epoch, total_steps=total_steps,
        start_step=start_step, resume_step=start_step,
        prefetch=job.sidecar.prefetch_batches if job else 1, checkpoint=checkpoint)
    return Sidecar(server, settings, steps_per_epoch, failure, permanent)


def serve(sidecar: Sidecar) -> int:
    """Serve until done, drained or stopped; write the exit report. Exit code."""
    server, settings, failure = sidecar.server, sidecar.settings, sidecar.failure
    try:
        if failure is not None:
            server.fail_all(failure, grace_s=FAILURE_GRACE_S)
        else:
            log.info("serving ranks %s of %d at %s from global step %d of %d",
                     [f.rank for f in server.feeds], settings.world_size, settings.socket_dir,
                     server.resume_step, server.total_steps)
            server.run(tick=RequestWatcher(server, settings.podinfo_dir))
            failure = next((f.failure for f in server.feeds if f.failure), None)
    finally:
        global_step = min((f.control.acked + 1 for f in server.feeds), default=0)
        epoch, step = divmod(global_step, max(1, sidecar.steps_per_epoch))
        report = {
            "globalStep": global_step, "epoch": epoch, "step": step,
            "stepsPerEpoch": sidecar.steps_per_epoch,
            "lastCheckpoint": server.last_checkpoint,
            "drained": bool(server.feeds) and all(f.drained for f in server.feeds),
            "error": failure,
            "permanent": bool(failure) and sidecar.permanent and failure == sidecar.failure,
        }
        server.close()
        if settings.termination_log is not None:
            try:
                settings.termination_log.write_text(json.dumps(report))
            except OSError as exc:
                log.warning("cannot write the termination log: %s", exc)
    return 2 if failure else 0


def run(settings: SidecarSettings) -> int:
    """The `splitfeed sidecar` process: SIGTERM / SIGINT stop it cleanly."""
    serving.tune_interpreter()
    sidecar = prepare(settings)
    stop = lambda *_: sidecar.server.stopping.set()  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return serve(sidecar)
