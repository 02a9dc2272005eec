"""`splitfeed sidecar`: load the job, open the table, resume, serve until done.

The edge where configuration, environment, storage and signals meet; the
logic lives in `serving`, `reading`, `checkpoints` and `positions`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import resource
import signal
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from splitfeed.trainer_client.contract import wellknown, errors, membership, messages, specs, topology
from splitfeed.trainer_client.transport import keys, stranded

from .world import agreement, checkpoints, commitments, identity
from .data import cgroups, planning, positions, reading, skipping, streaming
from .serving import ending, metrics, service
from .forks import forking, planner, workers
from .data.storage_options import read_storage_options as read_storage_options

log = logging.getLogger(__name__)

DRAIN_ANNOTATION = wellknown.ANNOTATION_DRAIN
FAILURE_GRACE_S = 10.0
JOIN_TIMEOUT_S = 300.0
"""How long a sidecar waits for its world's coordinator (replica 0's sidecar) to answer."""


@dataclasses.dataclass(frozen=True)
class SidecarSettings:
    config: Path
    socket_dir: Path
    rank: int = 0
    """Global rank of this pod's first local rank."""
    world_size: int = 1
    local_world_size: int = 1
    resume: str = wellknown.RESUME_LATEST
    resume_step: int | None = None
    """The world's resume step, chosen by the operator (SPLITFEED_RESUME_STEP); None: the coordinator chooses."""
    replica: int | None = None
    """This pod's replica index (NODE_RANK); default rank // local_world_size."""
    coordinator: str | None = None
    """tcp://HOST:PORT of replica 0's coordinator (SPLITFEED_COORDINATOR); replica 0 binds its port."""
    job_uid: str = ""
    """The StreamingJob's metadata.uid (SPLITFEED_JOB_UID): its checkpoints are its own."""
    world_epoch: int = 0
    """The world this sidecar belongs to (SPLITFEED_WORLD_EPOCH): fences older worlds' checkpoints."""
    table_version: int | None = None
    """The table version the job pinned, once the operator recorded it (SPLITFEED_TABLE_VERSION)."""
    checksum: str | None = None
    podinfo_dir: Path | None = None
    storage_options_dir: Path | None = None
    termination_log: Path | None = None
    metrics_port: int | None = None
    """Where /metrics is served (SPLITFEED_METRICS_PORT; 0: any free port); None: not at all."""
    master_addr: str = wellknown.LOOPBACK
    master_port: int = wellknown.MASTER_PORT
    """The trainers' rendezvous (MASTER_ADDR, MASTER_PORT): told to them again in a world changed in place."""
    after_loss: bool = False
    """This world follows in place one that lost member pods (no drain): trainers still in an
    earlier world are stopped (membership.World.after_loss)."""
    keys_dir: Path | None = None
    """The job's CURVE keypair (SPLITFEED_KEYS_DIR): without it no coordinator or member starts."""

    @classmethod
    def from_env(cls, **overrides: Any) -> SidecarSettings:
        env = os.environ
        who = identity.from_env(env, need_uid=False)
        values: dict[str, Any] = {
            "job_uid": who.uid, "world_epoch": who.world_epoch, "table_version": who.table_version,
            "socket_dir": Path(env.get(wellknown.SOCKET_DIR_ENV, wellknown.SOCKET_DIR)),
            "rank": int(env.get(wellknown.RANK, "0")),
            "world_size": int(env.get(wellknown.WORLD_SIZE, "1")),
            "local_world_size": int(env.get(wellknown.LOCAL_WORLD_SIZE, "1")),
            "resume": env.get(wellknown.RESUME_ENV, wellknown.RESUME_LATEST),
            "resume_step": int(env[wellknown.RESUME_STEP_ENV]) if env.get(wellknown.RESUME_STEP_ENV) else None,
            "replica": int(env[wellknown.NODE_RANK]) if env.get(wellknown.NODE_RANK) else None,
            "coordinator": env.get(wellknown.COORDINATOR_ENV) or None,
            "checksum": env.get(wellknown.CONFIG_CHECKSUM_ENV) or None,
            "metrics_port": metrics.metrics_port(env) or None,
            "master_addr": env.get(wellknown.MASTER_ADDR) or None,
            "master_port": int(env[wellknown.MASTER_PORT_ENV]) if env.get(wellknown.MASTER_PORT_ENV) else None,
            "keys_dir": Path(env[wellknown.KEYS_DIR_ENV]) if env.get(wellknown.KEYS_DIR_ENV) else None,
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


def read_annotations(podinfo_dir: Path | None) -> dict[str, str]:
    """The downward-API annotations file: key="value" per line."""
    if podinfo_dir is None:
        return {}
    try:
        text = (podinfo_dir / wellknown.PODINFO_ANNOTATIONS).read_text()
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
    """Turns a drain annotation token into a drain request to the world's coordinator.

    The slow, sure path (a kubelet refreshes the file on its sync period); the
    operator also asks the coordinator directly. A token present when the
    sidecar starts belongs to its world (tokens name the world epoch) and counts (one that
    names another world does not: a pod kept in place keeps its last world's annotation);
    the coordinator ignores a token it has seen.
    """

    def __init__(self, server: service.Server, podinfo_dir: Path | None, world_epoch: int = 0) -> None:
        self._server = server
        self._dir = podinfo_dir
        self._epoch = world_epoch
        self._seen: tuple[str, int] | None = None
        self._next_check = 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if self._dir is None or now < self._next_check:
            return
        self._next_check = now + 0.5
        found = read_annotations(self._dir)
        token = found.get(DRAIN_ANNOTATION)
        replicas = _count(found.get(wellknown.ANNOTATION_DRAIN_REPLICAS))
        if token and (token, replicas) != self._seen and _token_world(token) in (None, self._epoch):
            self._seen = (token, replicas)
            self._server.request_drain(token, token.split("-")[0] or "drain", replicas)


def _token_world(token: str) -> int | None:
    """The world a drain token names (`rescale-w3`: 3); None for a token that names none.
    A pod kept through an in-place change still carries its last world's token: it asked
    that world, not this one."""
    _, sep, epoch = token.rpartition("-w")
    return int(epoch) if sep and epoch.isdigit() else None


def _count(value: object) -> int:
    """A replica count from an annotation; 0 when absent or not a positive number."""
    try:
        return max(0, int(str(value)))
    except ValueError:
        return 0


def replicas_of(settings: SidecarSettings) -> int:
    return max(1, settings.world_size // max(1, settings.local_world_size))


def replica_of(settings: SidecarSettings) -> int:
    if settings.replica is not None:
        return settings.replica
    return settings.rank // max(1, settings.local_world_size)


def coordinator_addresses(settings: SidecarSettings) -> tuple[str, str]:
    """(what replica 0 binds, what members connect to); a lone sidecar picks a free port."""
    if settings.coordinator is None:
        if replicas_of(settings) > 1:
            raise errors.UserError(
                "SPLITFEED_COORDINATOR is not set: a world of several replicas needs replica 0's "
                "coordinator address (the operator and `splitfeed local` set it)")
        return f"tcp://{wellknown.LOOPBACK}:*", ""
    host, sep, port = settings.coordinator.rpartition(":")
    if not settings.coordinator.startswith("tcp://") or not sep or not port.isdigit():
        raise errors.UserError(f"SPLITFEED_COORDINATOR={settings.coordinator!r} is not tcp://HOST:PORT")
    return f"tcp://*:{port}", settings.coordinator


def job_stores(job: specs.JobSpec, settings: SidecarSettings, storage_options: Mapping[str, str],
               provenance: Mapping[str, Any] | None = None) -> list[checkpoints.Store]:
    """Where this job's checkpoints go (its UID's), then what spec.checkpoint.resumeFrom names."""
    if not job.checkpoint.uri:
        return []
    identity.required(identity.Identity(settings.job_uid, settings.world_epoch, settings.table_version))
    return checkpoints.stores(job, uid=settings.job_uid, storage_options=storage_options,
                              provenance=provenance)


def choose_version(settings: SidecarSettings, stores: list[checkpoints.Store]) -> int | None:
    """The table version the job reads start to end, if an earlier world already fixed it."""
    if settings.table_version is not None:
        return settings.table_version  # the operator recorded it (status.data.tableVersion)
    for store in stores:
        version = store.pinned_version()
        if version is not None:
            return version
    return None


def choose_resume_step(job: specs.JobSpec, data: specs.DataSpec, settings: SidecarSettings,
                       stores: list[checkpoints.Store], expect: Mapping[str, Any]) -> int:
    """The world's resume step, decided once by its coordinator (docs/agreement.md)."""
    if settings.resume_step is not None:
        log.info("resuming at global step %d, as the operator recorded", settings.resume_step)
        return settings.resume_step
    if settings.resume == wellknown.RESUME_NONE or not stores:
        return 0
    found = checkpoints.newest(stores, streaming.merge_states, expect=expect,
                               accept=lambda s: positions.position_from_state(data, s))
    if found is None:
        log.info("no complete checkpoint under %s: starting at step 0", job.checkpoint.uri)
        return 0
    log.info("the world resumes at global step %d, the newest complete checkpoint (%d ranks)",
             found.step, found.world_size)
    return found.step


def check_resume_step(data: specs.DataSpec, stores: list[checkpoints.Store], step: int,
                      steps_per_epoch: int, expect: Mapping[str, Any]) -> dict[str, Any] | None:
    """Load exactly the world's resume step (its merged state); a store that disagrees is an
    error, never a guess."""
    if step == 0:
        return None
    if not stores:
        raise errors.UserError(
            f"the world resumes at global step {step} but the job has no spec.checkpoint.uri")
    merged = checkpoints.load(stores, step, streaming.merge_states, expect=expect)
    position = positions.position_from_state(data, merged)
    if position.epoch * steps_per_epoch + position.step != step:
        raise errors.UserError(
            f"checkpoint step {step} holds the position of epoch {position.epoch} step "
            f"{position.step}, not global step {step}")
    return merged


class Ledger(dict[int, skipping.Passed]):
    """global step -> what it passed (split positions after it), for one rank.

    Kept: the newest `keep` steps published, and every step read past the newest
    published (the read-ahead). A step read but never published (past an epoch's end
    the world agreed on) is dropped once a later step is published: bounding by steps
    *read* would let a long run of such steps evict the one a checkpoint needs.
    """

    def __init__(self, keep: int) -> None:
        super().__init__()
        self.keep = keep
        self._published: collections.deque[int] = collections.deque(maxlen=keep)

    def published(self, step: int) -> None:
        self._published.append(step)
        if len(self) > 2 * self.keep:  # amortised: one pass per `keep` steps
            kept = set(self._published)
            for old in [k for k in self if k < step and k not in kept]:
                del self[old]


class SkipLedgers:
    """Each local rank's split positions after each step it read (skip jobs), for its
    checkpoints and for a reader that restarts mid-epoch: under skip a step no longer
    fixes the positions (docs/preprocessing.md). Other jobs: positions from the step."""

    KEEP = 4096
    """Published steps remembered per rank: a checkpoint is of a step the trainer just took."""
    ANCHORS = 4
    """Checkpoint states remembered per rank: a reader rewound past the ledger starts at one."""

    def __init__(self, data: specs.DataSpec | None, steps_per_epoch: int, start_step: int,
                 resume_state: dict[str, Any] | None) -> None:
        self.data = data
        self.spe = max(1, steps_per_epoch)
        self.start_step = start_step
        self.merged = resume_state
        self._ledgers: dict[int, Ledger] = {}
        self._anchors: dict[int, dict[int, dict[str, Any]]] = {}

    def ledger(self, rank: int) -> Ledger | None:
        if self.data is None or not self.data.drops_rows:
            return None
        return self._ledgers.setdefault(rank, Ledger(self.KEEP))

    def state(self, rank: int, step: int) -> dict[str, Any]:
        """The rank's checkpoint state once `step` steps are taken."""
        assert self.data is not None
        position = positions.position_of(step, self.spe)
        if not self.data.drops_rows or position.step == 0:
            return positions.state_dict(self.data, position)
        known = self._known(rank, step)
        if known is None:
            raise errors.SidecarFailed(f"rank {rank} holds no split positions for global step {step - 1}")
        anchors = self._anchors.setdefault(rank, {})
        anchors[step] = known
        while len(anchors) > self.ANCHORS:
            del anchors[min(anchors)]
        return dict(known)

    def _known(self, rank: int, step: int) -> dict[str, Any] | None:
        """The state at `step` if this sidecar knows it without reading: the ledger, a
        checkpoint it wrote, or the world's resume state."""
        assert self.data is not None
        ledger = self._ledgers.get(rank)
        passed = None if ledger is None else ledger.get(step - 1)
        if passed is not None:
            return positions.state_after(self.data, positions.position_of(step, self.spe), passed.at)
        anchor = self._anchors.get(rank, {}).get(step)
        if anchor is not None:
            return dict(anchor)
        if step == self.start_step and self.merged is not None:
            return dict(self.merged)  # nothing read yet: the world's resume state
        return None

    def published(self, rank: int, step: int) -> None:
        """Count the rows a published step dropped (the report's skippedRows)."""
        ledger = self._ledgers.get(rank)
        passed = None if ledger is None else ledger.get(step)
        if passed is not None:
            skipping.SKIPPED_ROWS[0] += passed.skipped
        if ledger is not None:
            ledger.published(step)

    def resume_from(self, rank: int, step: int) -> tuple[int, dict[str, Any] | None]:
        """Where a reader that must yield from `step` starts, and with what state (skip
        jobs, mid-epoch). A step the ledger has forgotten (a trainer restarted in place and
        rewound to the world's checkpoint, a sidecar restarted under a running trainer)
        starts at the newest state it knows at or before it in the same epoch — a checkpoint
        it wrote, the world's resume state, or else the epoch's start, which needs none —
        and the steps between are read again and passed over (iter_from)."""
        if self.data is None or not self.data.drops_rows or step % self.spe == 0:
            return step, None
        known = self._known(rank, step)
        if known is not None:
            return step, known
        epoch_start = step - step % self.spe
        anchors: dict[int, dict[str, Any] | None] = {epoch_start: None}
        if self.merged is not None:
            anchors[self.start_step] = self.merged
        anchors.update(self._anchors.get(rank, {}))
        start = max(a for a in anchors if epoch_start <= a <= step)
        state = anchors[start]
        return start, None if state is None else dict(state)


def iter_from(batches: Iterator[tuple[int, Any]], first_step: int) -> Iterator[tuple[int, Any]]:
    """The steps of `batches` from `first_step` on (a reader started earlier), closing it."""
    try:
        for step, batch in batches:
            if step >= first_step:
                yield step, batch
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


@dataclasses.dataclass
class Sidecar:
    """A prepared sidecar: its server, and why it cannot serve (if it cannot)."""

    server: service.Server
    settings: SidecarSettings
    steps_per_epoch: int
    failure: str | None
    permanent: bool = False
    """The failure is a DataError: the same data fails the same way in any world."""
    coordinator: agreement.CoordinatorThread | None = None
    """Replica 0's: the world's coordinator, alive as long as this sidecar."""
    table_version: int | None = None
    """The table version every worker of this world reads."""
    metrics: metrics.SidecarMetrics | None = None
    builder: planner.Planner | None = None
    """Builds this job's epoch plans (replica 0's, or every sidecar's without a store)."""
    plan: planning.Source | None = None
    data: specs.DataSpec | None = None
    """The job's data at the pinned table version (None when it could not be opened)."""
    rows: int = 0
    """The rows the job reads per epoch (its filter applied)."""
    stores: list[checkpoints.Store] = dataclasses.field(default_factory=list)
    """The job's checkpoint stores (none without spec.checkpoint.uri)."""


@dataclasses.dataclass
class Carried:
    """What a sidecar keeps from one world to the next when its world changes in place: the
    plans (built once per epoch, never again), the metrics endpoint, the table's pinned
    version, and the old world's coordinator until the new one is bound."""

    builder: planner.Planner | None
    plan: planning.Source | None
    metrics: metrics.SidecarMetrics | None
    coordinator: agreement.CoordinatorThread | None
    data: specs.DataSpec | None
    rows: int
    steps_per_epoch: int
    report: wellknown.Report
    trainers: frozenset[bytes] = frozenset()
    """The trainers' socket identities: one that says hello to continue the world before is
    told that world ended (answering.Answers.hello)."""


class NotInWorld(errors.SplitfeedError):
    """This pod is not in the world its coordinator now runs (an in-place scale-down)."""


def provenance(data: specs.DataSpec, settings: SidecarSettings) -> dict[str, Any]:
    """What this world's checkpoint records say they belong to (and what a resume must match)."""
    assert data.version is not None
    return checkpoints.provenance(data, table_version=int(data.version), job_uid=settings.job_uid,
                                  world_epoch=settings.world_epoch)


@dataclasses.dataclass
class _Opening:
    """What `prepare` has opened so far. A failure part way keeps it: the coordinator goes on
    answering its members, the member is closed, the trainers hear why."""

    settings: SidecarSettings
    storage_options: Mapping[str, str]
    carried: Carried | None
    job: specs.JobSpec | None = None
    data: specs.DataSpec | None = None
    rows: int = 0
    steps_per_epoch: int = 1
    stores: list[checkpoints.Store] = dataclasses.field(default_factory=list)
    expect: dict[str, Any] = dataclasses.field(default_factory=dict)
    coordinator: agreement.CoordinatorThread | None = None
    member: agreement.Member | None = None
    start_step: int = 0
    member_version: int | None = None
    """The table version the coordinator told this member to read."""
    resume_state: dict[str, Any] | None = None
    builder: planner.Planner | None = None
    plan: planning.Source | None = None
    keypair: keys.Keypair | None = None
    """The job's CURVE keypair, for the coordinator (replica 0) and the member alike."""

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.data.epochs if self.data is not None else 0


def prepare(settings: SidecarSettings, carried: Carried | None = None) -> Sidecar:
    """Load, open, agree on the resume step and bind. Bad input becomes `failure`, reported to trainers.

    `carried`: this sidecar served the world before, which changed in place; its plans and
    metrics go on. NotInWorld: a member whose replica the world no longer has.
    """
    o = _Opening(settings, read_storage_options(settings.storage_options_dir), carried)
    instance = uuid.uuid4().hex[:12]
    failure: str | None = None
    permanent = False
    try:
        _open_world(o, instance)
    except errors.UserError as exc:
        failure, permanent = str(exc), isinstance(exc, errors.DataError)
        log.error("%s", failure)
    sidecar = _sidecar(o, instance, failure, permanent)
    _drained_before(sidecar)
    return sidecar


def _drained_before(sidecar: Sidecar) -> None:
    """Ranks that committed the drain step this pod's sidecar was committed to before it
    restarted (sidecar.commitments) are drained: their trainers saved, committed and ended,
    and never say hello again. Without this the restarted sidecar waited for them, and its pod
    held the world's replacement until checkpoint.timeoutSeconds."""
    settings = sidecar.settings
    kept = commitments.load(settings.socket_dir, settings.world_epoch)
    if kept is None or not sidecar.stores or sidecar.failure is not None:
        return
    step = kept[0]
    committed = _committed_ranks(sidecar.stores[0], settings, step)
    for feed in sidecar.server.feeds:
        session = feed.session
        if session.rank in committed:
            log.info("rank %d committed drain step %d before this sidecar restarted: it is drained",
                     session.rank, step)
            session.drained, session.committed = True, step
            feed.control.acked = step - 1
            feed.publisher.halt()


def _committed_ranks(store: checkpoints.Store, settings: SidecarSettings, step: int) -> set[int]:
    """This pod's ranks whose commit marker of `step` in this world the store holds; a flaky
    read counts as none (the rank is then served as usual)."""
    ranks = range(settings.rank, settings.rank + settings.local_world_size)
    try:
        return {r for r in ranks if store.committed(global_step=step, rank=r, world_size=settings.world_size,
                                                   world_epoch=settings.world_epoch)}
    except Exception as exc:  # noqa: BLE001 - the sidecar serves them as usual and finds out
        log.warning("cannot tell whether this pod's ranks committed drain step %d: %s", step, exc)
        return set()


def _open_world(o: _Opening, instance: str) -> None:
    o.job = load_job(o.settings)
    o.keypair = job_keys(o.settings)
    bind, address = coordinator_addresses(o.settings)
    replica = replica_of(o.settings)
    if replica == 0:
        bound = _start_coordinator(o, bind)
        address = address or bound  # a lone sidecar's coordinator: the port it was given
    _join(o, address, replica, instance)
    if replica != 0:
        _tell_coordinator(o.settings, address)
        o.data, o.rows, o.steps_per_epoch = _open(o.job, o.storage_options, o.member_version, o.carried)
        o.expect = provenance(o.data, o.settings)
        o.stores = job_stores(o.job, o.settings, o.storage_options, o.expect)
    assert o.data is not None
    o.resume_state = check_resume_step(o.data, o.stores, o.start_step, o.steps_per_epoch, o.expect)
    if reading.reads_plans(o.data):
        _start_plans(o, builds=replica == 0 or not o.stores)  # the world's builder, or a sidecar on its own


def job_keys(settings: SidecarSettings) -> keys.Keypair:
    """The job's keypair; no sidecar talks to its world unauthenticated (a UserError naming
    SPLITFEED_KEYS_DIR instead)."""
    where = {wellknown.KEYS_DIR_ENV: str(settings.keys_dir)} if settings.keys_dir else {}
    return keys.from_env(where, who="the sidecar (its world's coordinator or a member of it)")


def _start_coordinator(o: _Opening, bind: str) -> str:
    """Replica 0 fixes, once for the world, the table version and the resume step, and
    coordinates the world's drains; the address its members join."""
    assert o.job is not None
    o.stores = job_stores(o.job, o.settings, o.storage_options)
    o.data, o.rows, o.steps_per_epoch = _open(o.job, o.storage_options, choose_version(o.settings, o.stores),
                                              o.carried)
    assert o.data.version is not None  # pin() sets the number
    o.expect = provenance(o.data, o.settings)
    o.stores = job_stores(o.job, o.settings, o.storage_options, o.expect)
    resume_step = choose_resume_step(o.job, o.data, o.settings, o.stores, o.expect)
    if o.stores:
        o.stores[0].start_world(resume_step=resume_step)  # fences every older world
    watermark = (agreement.Watermark(ranks=o.settings.world_size, steps_per_epoch=o.steps_per_epoch)
                 if o.data.drops_rows else None)
    before = o.carried.coordinator if o.carried is not None else None
    assert o.keypair is not None
    o.coordinator = agreement.CoordinatorThread(
        agreement.Coordinator(replicas=replicas_of(o.settings), total_steps=o.total_steps,
                              resume_step=resume_step, table_version=int(o.data.version),
                              watermark=watermark, world_epoch=o.settings.world_epoch,
                              stood_in=before.stand_ins.replicas_at(resume_step) if before else ()),
        bind, keys=o.keypair, stand_in=_standing_in(o), world_size=o.settings.world_size)
    if o.carried is not None and o.carried.coordinator is not None:
        o.carried.coordinator.close()  # the world before: every member committed its drain step
        o.carried.coordinator = None
    return str(o.coordinator.address)


def _join(o: _Opening, address: str, replica: int, instance: str) -> None:
    """Join the world's coordinator: its resume step, table version and size win."""
    assert o.keypair is not None
    o.member = agreement.Member(address, replica, instance, keys=o.keypair)
    kept = commitments.load(o.settings.socket_dir, o.settings.world_epoch)
    if kept is not None:  # this pod's sidecar restarted during a drain it had committed to
        log.info("rejoining world %d committed to drain step %d", o.settings.world_epoch, kept[0])
        o.member.commitment = kept
    joined = o.member.join(published=-1, timeout_s=JOIN_TIMEOUT_S)
    o.start_step, o.member_version = joined.resume_step, joined.table_version
    local = o.settings.local_world_size
    if joined.replicas and joined.replicas * local != o.settings.world_size:
        if replica >= joined.replicas:
            o.member.close()
            raise NotInWorld(f"replica {replica} is not in world {o.settings.world_epoch} "
                             f"of {joined.replicas} replicas")
        # Created for another count than the world's coordinator now runs: its count wins.
        o.settings = dataclasses.replace(o.settings, world_size=joined.replicas * local)
        o.job = load_job(o.settings)


def _tell_coordinator(settings: SidecarSettings, address: str) -> None:
    """Where this pod's trainers find the world's coordinator should this sidecar die
    (trainer_client.stranded): it then writes their checkpoints at the drain step instead."""
    try:
        stranded.write_coordinator(settings.socket_dir, settings.world_epoch, address)
    except OSError as exc:
        log.warning("cannot write the coordinator's address into %s: %s", settings.socket_dir, exc)


def _standing_in(o: _Opening) -> Any:
    """The coordinator's write of a rank's record or marker at the drain step in the stead of its
    dead sidecar (sidecar.standins); None without a store. A plain job's position at a step is
    the same for every rank (positions.state_dict), which is why only such jobs are accepted."""
    if not o.stores or o.data is None or o.data.drops_rows:
        return None
    store, data, spe = o.stores[0], o.data, o.steps_per_epoch

    def write(request: messages.StandIn) -> str:
        step, rank, world = request.step, request.rank, request.world_size
        if request.commit:
            store.commit(global_step=step, rank=rank, world_size=world)
            return ""
        state = positions.state_dict(data, positions.position_of(step, spe))
        return store.write(global_step=step, rank=rank, world_size=world, state=state)

    return write


def _start_plans(o: _Opening, builds: bool) -> None:
    """The epoch plans this sidecar reads (kept from the world before when they are the same),
    and, where it builds them, the builder."""
    assert o.job is not None and o.data is not None
    where = planner.location(o.data, o.stores[0].where if o.stores else None,
                             checkpoints.store_options(o.job, o.storage_options))
    kept = o.carried.plan if o.carried is not None else None
    o.plan = kept if kept is not None and kept.location.uri == where.uri else planning.Source(where)
    if not builds:
        return
    epoch = min(o.start_step // o.steps_per_epoch, o.data.epochs - 1)
    if o.carried is not None and o.carried.builder is not None and o.carried.builder.data == o.data:
        o.builder, o.carried.builder = o.carried.builder, None
        o.builder.ensure(epoch)
        o.builder.reached(epoch)
    else:
        o.builder = planner.Planner(o.data, o.storage_options, where, rows=o.rows, private=not o.stores)
        o.builder.start(epoch)


def _sidecar(o: _Opening, instance: str, failure: str | None, permanent: bool) -> Sidecar:
    """The server over what was opened (or over the failure, which it reports to trainers)."""
    settings, data, job, stores = o.settings, o.data, o.job, o.stores
    observed = metrics.SidecarMetrics(metrics.Labels(
        job=job.name if job else "", namespace=job.namespace if job else "",
        world=settings.world_epoch, replica=replica_of(settings)),
        rejected=lambda: o.coordinator.rejected if o.coordinator is not None else None,
        traffic=lambda: o.coordinator.traffic.snapshot() if o.coordinator is not None else None)
    ledgers = SkipLedgers(data, o.steps_per_epoch, o.start_step, o.resume_state)

    def factory(rank: int, first_step: int):  # type: ignore[no-untyped-def]
        assert data is not None  # every worker opens the pinned version
        start, state = ledgers.resume_from(rank, first_step)
        # A model-parallel group's ranks read the same splits: those of their data-parallel rank.
        batches = workers.iter_rank_batches(
            data, o.storage_options, rank=data.groups.rank(rank, settings.world_size),
            world_size=data.groups.size(settings.world_size),
            start_global_step=start, resume_state=state, ledger=ledgers.ledger(rank), plan=o.plan)
        return observed.timed_batches(batches if start == first_step else iter_from(batches, first_step))

    def on_published(rank: int, step: int) -> None:
        ledgers.published(rank, step)
        if o.builder is not None:
            o.builder.reached(step // max(1, o.steps_per_epoch))  # the next epoch's plan is wanted

    def on_drain(step: int, reason: str, next_replicas: int) -> None:
        commitments.save(settings.socket_dir, settings.world_epoch, step, reason, next_replicas)
        if next_replicas > 0:  # trainers that stop at this drain get a next world (membership)
            write_world(settings, membership.CHANGING, o.start_step)

    checkpoint, commit = _checkpointing(settings, stores if data is not None else [], ledgers, observed)
    server = service.Server(
        directory=settings.socket_dir, ranks=[settings.rank + i for i in range(settings.local_world_size)],
        world_size=settings.world_size, factory=factory, steps_per_epoch=o.steps_per_epoch,
        total_steps=o.total_steps, start_step=o.start_step, resume_step=o.start_step,
        prefetch=job.sidecar.prefetch_batches if job else 1, checkpoint=checkpoint, commit=commit,
        member=o.member if failure is None else None, instance=instance,
        skipping=data is not None and data.drops_rows, on_published=on_published, on_drain=on_drain,
        earlier=o.carried.trainers if o.carried is not None else (),
        groups=data.groups if data is not None else topology.Groups())
    if failure is not None and o.member is not None:
        o.member.close()
    observed.feeds = lambda: server.feeds
    if o.carried is not None and o.carried.metrics is not None:
        observed.take_over(o.carried.metrics)  # the endpoint goes on, now with this world's series
    elif settings.metrics_port is not None:
        observed.port = observed.serve(settings.metrics_port)
    return Sidecar(server, settings, o.steps_per_epoch, failure, permanent, o.coordinator,
                   int(data.version) if data is not None and data.version is not None else None,
                   observed, o.builder, o.plan, data, o.rows, stores)


def _checkpointing(settings: SidecarSettings, stores: list[checkpoints.Store], ledgers: SkipLedgers,
                   observed: metrics.SidecarMetrics) -> tuple[Any, Any]:
    """The server's checkpoint and commit calls into the job's store; (None, None) without one."""
    if not stores:
        return None, None
    world, store = settings.world_size, stores[0]

    def write_checkpoint(rank: int, step: int) -> str:
        return store.write(global_step=step, rank=rank, world_size=world, state=ledgers.state(rank, step))

    def commit(rank: int, step: int) -> None:
        store.commit(global_step=step, rank=rank, world_size=world)

    return observed.timed_checkpoint(write_checkpoint), commit


def _open(job: specs.JobSpec, storage_options: Mapping[str, str], pinned: int | None,
          carried: Carried | None) -> tuple[specs.DataSpec, int, int]:
    """The job's data at its pinned version, the rows it reads and its steps per epoch:
    counted once (a filter's count reads the table), kept when the world changes in place."""
    if carried is not None and carried.data is not None and carried.data.version == pinned:
        return carried.data, carried.rows, carried.steps_per_epoch
    table, data = reading.pin(job.data, storage_options, pinned=pinned)
    sized = reading.job_layout(table, data)
    return data, sized.rows, sized.steps_per_epoch


def serve(sidecar: Sidecar) -> int:
    """Serve until done, drained or stopped; write the exit report. Exit code."""
    code, report = serve_world(sidecar)
    finish(sidecar, report)
    return code


def serve_world(sidecar: Sidecar) -> tuple[int, wellknown.Report]:
    """Serve one world until it is done, drained or stopped, and close its server; (exit
    code, the report of this world). The plans, coordinator and metrics stay up: `finish`
    ends them, or the next world in place takes them over."""
    server, settings, failure = sidecar.server, sidecar.settings, sidecar.failure
    try:
        if failure is not None:
            server.fail_all(failure, grace_s=FAILURE_GRACE_S)
        else:
            log.info("serving ranks %s of %d at %s from global step %d of %d (world %d)",
                     [f.rank for f in server.feeds], settings.world_size, settings.socket_dir,
                     server.resume_step, server.total_steps, settings.world_epoch)
            tell_world(sidecar, membership.SERVING)
            watcher = RequestWatcher(server, settings.podinfo_dir, settings.world_epoch)
            reporter = metrics.ProgressReporter(
                server, sidecar.steps_per_epoch,
                row_counts=lambda: {"filled_rows": reading.FILLED_ROWS[0],
                                    "skipped_rows": skipping.SKIPPED_ROWS[0]})

            def tick() -> None:
                watcher()
                reporter()

            server.run(tick=tick)
            if server.world_lost is not None:  # before the next world: the trainers stop at once
                tell_world(sidecar, membership.LOST)
            failure = next((f.session.failure for f in server.feeds if f.session.failure), None)
    except Exception as exc:  # a bug or a broken environment: still say why, in the report
        log.exception("the sidecar failed")
        failure = f"{type(exc).__name__}: {exc}"
    finally:
        global_step = min((f.control.acked + 1 for f in server.feeds), default=0)
        drained = bool(server.feeds) and all(f.session.drained for f in server.feeds)
        epoch, step = divmod(global_step, max(1, sidecar.steps_per_epoch))
        report: wellknown.Report = {
            "globalStep": global_step, "epoch": epoch, "step": step,
            "stepsPerEpoch": sidecar.steps_per_epoch,
            "lastCheckpoint": server.last_checkpoint,
            "drained": drained,
            "agreedStep": server.drain_step if drained else None,
            "drainReason": server.drain_reason,
            "resumeStep": server.resume_step,
            "tableVersion": sidecar.table_version,
            "error": failure,
            "permanent": bool(failure) and (
                (sidecar.permanent and failure == sidecar.failure)
                or any(f.session.permanent and f.session.failure == failure for f in server.feeds)),
            "filledRows": reading.FILLED_ROWS[0],
            "skippedRows": skipping.SKIPPED_ROWS[0],
        }
        server.close()
    return (2 if failure else 0), report


def finish(sidecar: Sidecar, report: wellknown.Report) -> None:
    """The sidecar ends: its plans, coordinator and world file say so; the report is written."""
    log.info("peak RSS %.0f MiB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if sidecar.builder is not None:
        sidecar.builder.close()
    if sidecar.coordinator is not None:
        sidecar.coordinator.close()
    tell_world(sidecar, membership.ENDED)
    write_report(sidecar.settings.termination_log, report)


def tell_world(sidecar: Sidecar, state: str) -> None:
    """Write the world file the trainer's side reads (trainer_client.membership)."""
    write_world(sidecar.settings, state, sidecar.server.resume_step)


def write_world(settings: SidecarSettings, state: str, resume_step: int = 0) -> None:
    try:
        membership.write(settings.socket_dir, membership.World(
            epoch=settings.world_epoch, state=state, rank=settings.rank, world_size=settings.world_size,
            replicas=replicas_of(settings), master_addr=settings.master_addr,
            master_port=settings.master_port, resume_step=resume_step, after_loss=settings.after_loss))
    except OSError as exc:
        log.warning("cannot write the world file in %s: %s", settings.socket_dir, exc)


IN_PLACE_WAIT_S = 60.0
"""How long replica 0's sidecar waits, after its own ranks drained, for every member to
commit the drain step before the next world starts in place (then it ends instead)."""


def next_world(sidecar: Sidecar, report: wellknown.Report, stopping: bool) -> SidecarSettings | None:
    """The settings of the world this sidecar serves next when its world changes in place
    (docs/agreement.md, "Changing the world in place"); None when it ends here.

    Replica 0 decides the next world's size: the newest count its coordinator was asked
    for, once every member committed the drain step (the next world loads that step). A
    member learns the size when the next world's coordinator answers its `join`. A world
    that lost member pods (`world_lost`) goes on at once with the size it was told, from the
    newest complete checkpoint (`lost_world_next`).
    """
    server, settings = sidecar.server, sidecar.settings
    if server.world_lost is not None:
        return None if stopping else lost_world_next(settings, server.world_lost, sidecar.table_version)
    step = report["agreedStep"]
    if stopping or not report["drained"] or step is None or server.next_replicas <= 0 or step >= server.total_steps:
        return None
    replicas = 0
    if sidecar.coordinator is not None:
        coordinator = sidecar.coordinator.coordinator
        deadline = time.monotonic() + IN_PLACE_WAIT_S
        while (coordinator.complete_step or -1) < step:
            if time.monotonic() > deadline:
                log.error("not every member committed global step %d within %.0f s: the world ends "
                          "here and is replaced", step, IN_PLACE_WAIT_S)
                return None
            time.sleep(0.01)
        replicas = coordinator.next_replicas
    epoch = settings.world_epoch
    log.info("world %d drained at global step %d; world %d follows in place%s", epoch, step, epoch + 1,
             f" with {replicas} replicas" if replicas else "")
    return dataclasses.replace(
        _following(settings), resume_step=step, after_loss=False,
        world_size=(replicas or replicas_of(settings)) * settings.local_world_size,
        table_version=sidecar.table_version)


STAND_IN_WAIT_S = 60.0
"""How long replica 0's sidecar, its own ranks drained, keeps the world's coordinator up until
every member committed the drain step: a member whose sidecar died commits through it
(sidecar.standins). Members that commit as usual take milliseconds."""


STORE_LOOK_S = 0.5
"""How often replica 0, waiting for its members, also looks whether the store holds the step
complete: a coordinator restarted during the drain was not told of commits made before."""


def wait_for_members(sidecar: Sidecar, report: wellknown.Report, signals: Signals) -> None:
    """Replica 0, after a drain that ends it: wait (at most STAND_IN_WAIT_S, or until a SIGTERM
    comes meanwhile: the pod is being deleted) until every member committed the drain step, so
    that a trainer whose own sidecar died can still commit that step through this coordinator
    (docs/agreement.md)."""
    step = report.get("agreedStep")
    if sidecar.coordinator is None or not report.get("drained") or step is None:
        return
    coordinator, termed = sidecar.coordinator.coordinator, len(signals.times)
    deadline, looked = time.monotonic() + STAND_IN_WAIT_S, time.monotonic()
    while (coordinator.complete_step or -1) < step:
        if sidecar.stores and time.monotonic() - looked > STORE_LOOK_S:
            looked = time.monotonic()  # members that committed before this coordinator (re)started
            with contextlib.suppress(Exception):  # a flaky read: the next look, or the deadline
                if sidecar.stores[0].complete(step):
                    return
        if time.monotonic() > deadline or len(signals.times) > termed:
            log.error("not every member committed drain step %d within %.0f s: the next world resumes "
                      "from the newest complete checkpoint", step, STAND_IN_WAIT_S)
            return
        time.sleep(0.01)


def lost_world_next(settings: SidecarSettings, lost: messages.WorldLost,
                    table_version: int | None) -> SidecarSettings | None:
    """After members `lost.lost` failed: this pod's next world, or None for a lost member (a
    pod the operator replaces). Same as a fresh world's start (SPLITFEED_RESUME=latest): its
    coordinator picks the newest complete checkpoint once and tells every member."""
    if replica_of(settings) in lost.lost:
        log.info("this replica is among the lost ones (%s): it ends here", lost.lost)
        return None
    log.info("world %d lost replicas %s; world %d follows in place with %d replicas from the newest "
             "complete checkpoint", settings.world_epoch, lost.lost, settings.world_epoch + 1, lost.replicas)
    return dataclasses.replace(
        _following(settings), resume_step=None, resume=wellknown.RESUME_LATEST, after_loss=True,
        world_size=lost.replicas * settings.local_world_size, table_version=table_version)


def _following(settings: SidecarSettings) -> SidecarSettings:
    """`settings` moved to the next world's epoch and the other port of the pair (membership.next_port)."""
    epoch = settings.world_epoch
    assert settings.coordinator is not None or replicas_of(settings) == 1
    address = settings.coordinator
    if address is not None:
        host, _, port = address.rpartition(":")
        address = f"{host}:{membership.next_port(int(port), epoch)}"
    return dataclasses.replace(settings, world_epoch=epoch + 1, coordinator=address,
                               master_port=membership.next_port(settings.master_port, epoch))


def carry(sidecar: Sidecar, report: wellknown.Report) -> Carried:
    """What the next world in place takes over from this one."""
    return Carried(builder=sidecar.builder, plan=sidecar.plan, metrics=sidecar.metrics,
                   coordinator=sidecar.coordinator, data=sidecar.data, rows=sidecar.rows,
                   steps_per_epoch=sidecar.steps_per_epoch, report=report,
                   trainers=frozenset(f.session.peer for f in sidecar.server.feeds if f.session.peer is not None))


def write_report(path: Path | None, report: wellknown.Report) -> None:
    """The termination report the operator reads (docs/pod-contract.md)."""
    if path is None:
        return
    try:
        path.write_text(json.dumps(report))
    except OSError as exc:
        log.warning("cannot write the termination log: %s", exc)


def adopt_world(settings: SidecarSettings, world: membership.World | None) -> SidecarSettings:
    """The settings of the later world `world` names, when it is this pod's and still runs
    (a sidecar restarted after its pod changed world in place); else `settings` as they are."""
    if (world is None or world.epoch <= settings.world_epoch or world.rank != settings.rank
            or world.state not in (membership.SERVING, membership.CHANGING)):
        return settings
    address = settings.coordinator
    if address is not None:
        host, _, port = address.rpartition(":")
        address = f"{host}:{membership.world_port(membership.base_port(int(port), settings.world_epoch), world.epoch)}"
    log.info("this pod runs world %d (its world file), not world %d (its environment): joining world %d",
             world.epoch, settings.world_epoch, world.epoch)
    return dataclasses.replace(
        settings, world_epoch=world.epoch, world_size=world.world_size, coordinator=address,
        master_port=world.master_port, resume_step=None, resume=wellknown.RESUME_LATEST)


def run(settings: SidecarSettings) -> int:
    """The `splitfeed sidecar` process: one world, or several when its world changes in place.

    SIGTERM (pod deletion, eviction, preemption) asks the world to drain at one
    agreed step and keeps serving until this pod's ranks have checkpointed; a
    second SIGTERM, or SIGINT, stops at once. A sidecar that got SIGTERM ends after
    the drain, even where the world goes on in place without it.
    """
    forking.start()  # first: before any lancedb call or thread (sidecar/forks/forking.py)
    settings = _set_up_process(settings)
    _hold_lock(settings)
    done = _drained_before_restart(settings)
    if done is not None:
        write_report(settings.termination_log, done)
        return 0
    carried: Carried | None = None
    signals = Signals()
    signals.install()
    while True:
        try:
            sidecar = prepare(settings, carried)
        except NotInWorld as exc:
            log.info("%s: this pod ends here", exc)
            _leave(settings, carried)
            return 0
        except Exception as exc:  # not bad input (prepare reports that): a bug or a broken host
            log.exception("the sidecar cannot start")
            write_report(settings.termination_log,
                         _worldless_report(f"the sidecar cannot start: {type(exc).__name__}: {exc}"))
            return 2
        if carried is None and not planner.builds_in_child(sidecar.builder):
            forking.stop()  # this sidecar builds no plan in a child: its helper has nothing to do
        signals.serving(sidecar)
        try:
            code, report = serve_world(sidecar)
            following = next_world(sidecar, report, stopping=signals.termed()) if code == 0 else None
        except BaseException:
            service.flush(sidecar.server.context)
            raise
        if following is None:
            wait_for_members(sidecar, report, signals)
            if sidecar.coordinator is not None:  # what the operator trusts for a member that left no report
                report["completeStep"] = sidecar.coordinator.coordinator.complete_step
            try:
                finish(sidecar, report)
            finally:
                service.flush(sidecar.server.context)  # the last replies go out: the process exits next
            return code
        carried, settings = carry(sidecar, report), following  # the world file says CHANGING (on_drain)


_LOCKS: list[int] = []
"""The descriptor of the socket directory's lock, open as long as this process lives."""


def _hold_lock(settings: SidecarSettings) -> None:
    """Lock the socket directory's `sidecar.lock` for this process's life: when it dies, its
    trainers see the lock free (trainer_client.stranded.gone) and checkpoint a drain step
    through the world's coordinator instead."""
    try:
        fd = stranded.hold(settings.socket_dir)
    except OSError as exc:  # a broken directory: prepare says so
        log.warning("cannot lock %s: %s", settings.socket_dir, exc)
        return
    if fd is not None:
        _LOCKS.append(fd)


def _set_up_process(settings: SidecarSettings) -> SidecarSettings:
    """Once per process, before its first world: the interpreter and lancedb's pool tuned,
    and the settings of the world this pod is in now (its world file's, not a predecessor's)."""
    service.tune_interpreter()
    # lancedb's permutation builder, sized once before any thread reads the environment
    # (builds in this process are of at most planner.IN_PROCESS_ROWS rows).
    planning.size_pool(planner.IN_PROCESS_ROWS, cgroups.free_memory()[0])
    # A sidecar the kubelet restarted in a pod kept through in-place changes has the environment
    # of the world the pod was created for; the world file (in the pod's emptyDir) says which
    # world the pod is in now. Otherwise a predecessor's word is not ours.
    settings = adopt_world(settings, membership.read(settings.socket_dir))
    with contextlib.suppress(OSError):  # (a broken directory: prepare says)
        (settings.socket_dir / membership.FILE).unlink(missing_ok=True)
    return settings


class Signals:
    """What SIGTERM and SIGINT ask of the world this process serves now (`run` installs them).

    The first SIGTERM asks the world to drain (once it serves); a second one, or SIGINT,
    stops at once, as does a SIGTERM that finds nothing to drain.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        """When each SIGTERM came (SIGINT counts twice)."""
        self.current: Sidecar | None = None

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self.on_term)
        signal.signal(signal.SIGINT, self.on_int)

    def termed(self) -> bool:
        """Whether this process was asked to end: it then ends after the world it serves."""
        return bool(self.times)

    def serving(self, sidecar: Sidecar) -> None:
        """`sidecar` serves now: a SIGTERM while it prepared asks its world to drain as soon as it serves."""
        self.current = sidecar
        self.act()

    def act(self) -> None:
        """What the SIGTERMs so far ask of the world now served (none yet: once it serves)."""
        sidecar = self.current
        if not self.times or sidecar is None:
            return
        if (len(self.times) > 1 or sidecar.failure is not None or sidecar.server.member is None
                or ending.trainers_gone(sidecar.server)):  # no trainer is left to drain (issue 21)
            sidecar.server.stopping.set()
        else:
            sidecar.server.preempt_requested = True

    def on_term(self, *_: object) -> None:
        self.times.append(time.monotonic())
        self.act()

    def on_int(self, *_: object) -> None:
        self.times.extend([time.monotonic()] * 2)
        if self.current is not None:
            self.current.server.stopping.set()


def _drained_before_restart(settings: SidecarSettings) -> wellknown.Report | None:
    """A member's sidecar the kubelet restarted after every rank of it committed the drain step
    it was committed to (sidecar.commitments): its trainers saved, committed and ended, and the
    world's coordinator may have ended too. Nothing is left to serve or to agree: the report
    says drained at that step, as the sidecar before it would have said. None otherwise."""
    kept = commitments.load(settings.socket_dir, settings.world_epoch)
    if kept is None or replica_of(settings) == 0:  # replica 0's coordinator may still be needed
        return None
    step, reason, _ = kept
    try:
        stores = job_stores(load_job(settings), settings, read_storage_options(settings.storage_options_dir))
    except Exception as exc:  # noqa: BLE001 - then the sidecar starts as usual and finds out
        log.warning("cannot tell whether this pod's ranks drained before the restart: %s", exc)
        return None
    if not stores or len(_committed_ranks(stores[0], settings, step)) < settings.local_world_size:
        return None
    log.info("every rank of this pod committed drain step %d before this sidecar restarted: it ends "
             "drained there", step)
    return {**_worldless_report(None), "globalStep": step, "drained": True, "agreedStep": step,
            "drainReason": reason}


def _worldless_report(error: str | None) -> wellknown.Report:
    """The report of a sidecar that served no world here: nothing served, nothing drained."""
    return {"globalStep": 0, "lastCheckpoint": None, "drained": False, "agreedStep": None,
            "error": error, "permanent": False}


def _leave(settings: SidecarSettings, carried: Carried | None) -> None:
    """A pod that is not in its world any more ends cleanly: its last world's report (it
    drained there), its plans closed, and the world file tells its trainer to stop."""
    if carried is not None:
        if carried.builder is not None:
            carried.builder.close()
        if carried.coordinator is not None:
            carried.coordinator.close()
    write_world(settings, membership.LEFT)
    report = carried.report if carried is not None else _worldless_report(None)
    write_report(settings.termination_log, report)


def serve_to_exit(sidecar: Sidecar) -> int:
    """`serve`, then wait for ZeroMQ to send the last replies: the process exits next."""
    try:
        return serve(sidecar)
    finally:
        service.flush(sidecar.server.context)
