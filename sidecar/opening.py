"""Opening one world for `splitfeed sidecar`: load the job, open the table at its pinned
version, join (or, on replica 0, start) the world's coordinator, agree on the resume step
and bind the server (`prepare`). What a world changed in place keeps is `Carried`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from splitfeed.trainer_client.contract import wellknown, errors, membership, messages, specs, topology
from splitfeed.trainer_client.transport import keys, stranded

from .world import agreement, checkpoints, commitments, identity, wire
from .world.settings import SidecarSettings, coordinator_addresses, local_ranks, replica_of, replicas_of
from .data import positions, reading, resuming
from .table import planning
from .data.ledgers import SkipLedgers, iter_from
from .table.storage_options import read_storage_options
from .serving import metrics, service
from .forks import planner, workers

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 300.0
"""How long a sidecar waits for its world's coordinator (replica 0's sidecar) to answer."""


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


def job_stores(job: specs.JobSpec, settings: SidecarSettings, storage_options: Mapping[str, str],
               provenance: Mapping[str, Any] | None = None) -> list[checkpoints.Store]:
    """Where this job's checkpoints go (its UID's), then what spec.checkpoint.resumeFrom names."""
    if not job.checkpoint.uri:
        return []
    identity.required(identity.Identity(settings.job_uid, settings.world_epoch, settings.table_version))
    return checkpoints.stores(job, uid=settings.job_uid, storage_options=storage_options,
                              provenance=provenance)


@dataclasses.dataclass
class Sidecar:
    """A prepared sidecar: its server, and why it cannot serve (if it cannot)."""

    server: service.Server
    settings: SidecarSettings
    steps_per_epoch: int
    failure: str | None
    permanent: bool = False
    """The failure is a DataError: the same data fails the same way in any world."""
    coordinator: wire.CoordinatorThread | None = None
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
    coordinator: wire.CoordinatorThread | None
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
    coordinator: wire.CoordinatorThread | None = None
    member: wire.Member | None = None
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
    committed = commitments.committed_ranks(sidecar.stores[0], local_ranks(settings), step,
                                            settings.world_size, settings.world_epoch)
    for feed in sidecar.server.feeds:
        session = feed.session
        if session.rank in committed:
            log.info("rank %d committed drain step %d before this sidecar restarted: it is drained",
                     session.rank, step)
            session.drained, session.committed = True, step
            feed.control.acked = step - 1
            feed.publisher.halt()


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
        _tell_coordinator(o.settings.socket_dir, o.settings.world_epoch, address)
        o.data, o.rows, o.steps_per_epoch = _open(o.job, o.storage_options, o.member_version, o.carried)
        o.expect = provenance(o.data, o.settings)
        o.stores = job_stores(o.job, o.settings, o.storage_options, o.expect)
    assert o.data is not None
    o.resume_state = resuming.check_resume_step(o.data, o.stores, o.start_step, o.steps_per_epoch, o.expect)
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
    pinned = resuming.choose_version(o.settings.table_version, o.stores)
    o.data, o.rows, o.steps_per_epoch = _open(o.job, o.storage_options, pinned, o.carried)
    assert o.data.version is not None  # pin() sets the number
    o.expect = provenance(o.data, o.settings)
    o.stores = job_stores(o.job, o.settings, o.storage_options, o.expect)
    resume_step = resuming.choose_resume_step(o.data, o.stores, o.expect, recorded=o.settings.resume_step,
                                              resume=o.settings.resume, uri=o.job.checkpoint.uri)
    if o.stores:
        o.stores[0].start_world(resume_step=resume_step)  # fences every older world
    watermark = (agreement.Watermark(ranks=o.settings.world_size, steps_per_epoch=o.steps_per_epoch)
                 if o.data.drops_rows else None)
    before = o.carried.coordinator if o.carried is not None else None
    assert o.keypair is not None
    o.coordinator = wire.CoordinatorThread(
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
    o.member = wire.Member(address, replica, instance, keys=o.keypair)
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


def _tell_coordinator(socket_dir: Path, world_epoch: int, address: str) -> None:
    """Where this pod's trainers find the world's coordinator should this sidecar die
    (trainer_client.stranded): it then writes their checkpoints at the drain step instead."""
    try:
        stranded.write_coordinator(socket_dir, world_epoch, address)
    except OSError as exc:
        log.warning("cannot write the coordinator's address into %s: %s", socket_dir, exc)


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

    checkpoint, commit = _checkpointing(settings.world_size, stores if data is not None else [], ledgers, observed)
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


def _checkpointing(world_size: int, stores: list[checkpoints.Store], ledgers: SkipLedgers,
                   observed: metrics.SidecarMetrics) -> tuple[Any, Any]:
    """The server's checkpoint and commit calls into the job's store; (None, None) without one."""
    if not stores:
        return None, None
    store = stores[0]

    def write_checkpoint(rank: int, step: int) -> str:
        return store.write(global_step=step, rank=rank, world_size=world_size, state=ledgers.state(rank, step))

    def commit(rank: int, step: int) -> None:
        store.commit(global_step=step, rank=rank, world_size=world_size)

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


def write_world(settings: SidecarSettings, state: str, resume_step: int = 0) -> None:
    try:
        membership.write(settings.socket_dir, membership.World(
            epoch=settings.world_epoch, state=state, rank=settings.rank, world_size=settings.world_size,
            replicas=replicas_of(settings), master_addr=settings.master_addr,
            master_port=settings.master_port, resume_step=resume_step, after_loss=settings.after_loss))
    except OSError as exc:
        log.warning("cannot write the world file in %s: %s", settings.socket_dir, exc)
