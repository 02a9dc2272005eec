"""From one world to the next in place: the settings of the world a sidecar serves next
(docs/agreement.md, "Changing the world in place"), after a drain, after lost members, or
after a restart into the world its pod moved to meanwhile. Pure, but for the wait on the
coordinator's commits (`committed_replicas`).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from splitfeed.trainer_client.contract import wellknown, layout, membership, messages

from . import agreement
from .settings import SidecarSettings, replica_of, replicas_of

log = logging.getLogger(__name__)

IN_PLACE_WAIT_S = 60.0
"""How long replica 0's sidecar waits, after its own ranks drained, for every member to
commit the drain step before the next world starts in place (then it ends instead)."""


def next_world(settings: SidecarSettings, report: wellknown.Report, stopping: bool, *,
               lost: messages.WorldLost | None, next_replicas: int, total_steps: int,
               coordinator: agreement.Coordinator | None, table_version: int | None) -> SidecarSettings | None:
    """The settings of the world this sidecar serves next when its world changes in place;
    None when it ends here.

    Replica 0 (the one with the world's `coordinator`) decides the next world's size: the
    newest count its coordinator was asked for, once every member committed the drain step
    (the next world loads that step). A member learns the size when the next world's
    coordinator answers its `join`. A world that `lost` member pods goes on at once with the
    size it was told, from the newest complete checkpoint (`lost_world_next`).
    """
    if lost is not None:
        return None if stopping else lost_world_next(settings, lost, table_version)
    step = None if stopping else in_place_step(report, next_replicas, total_steps)
    if step is None:
        return None
    replicas: int | None = 0
    if coordinator is not None:
        replicas = committed_replicas(coordinator, step)
    return None if replicas is None else drained_world_next(settings, step, replicas, table_version)


def in_place_step(report: wellknown.Report, next_replicas: int, total_steps: int) -> int | None:
    """The drain step a next world in place resumes at: this pod's ranks drained at the agreed
    step, before the end, in a world asked for a next one. None: the world ends here."""
    step = report["agreedStep"]
    if not report["drained"] or step is None or next_replicas <= 0 or step >= total_steps:
        return None
    return step


def committed_replicas(coordinator: agreement.Coordinator, step: int) -> int | None:
    """Wait (at most IN_PLACE_WAIT_S) until every member committed drain step `step`; then the
    replicas the next world was asked for. None: one did not, and the world ends here."""
    deadline = time.monotonic() + IN_PLACE_WAIT_S
    while (coordinator.complete_step or -1) < step:
        if time.monotonic() > deadline:
            log.error("not every member committed global step %d within %.0f s: the world ends "
                      "here and is replaced", step, IN_PLACE_WAIT_S)
            return None
        time.sleep(0.01)
    return coordinator.next_replicas


def drained_world_next(settings: SidecarSettings, step: int, replicas: int,
                       table_version: int | None) -> SidecarSettings:
    """The world after a drain at `step`: `replicas` replicas (0: as many as now), resuming there."""
    epoch = settings.world_epoch
    log.info("world %d drained at global step %d; world %d follows in place%s", epoch, step, epoch + 1,
             f" with {replicas} replicas" if replicas else "")
    return dataclasses.replace(
        _following(settings), resume_step=step, after_loss=False,
        world_size=(replicas or replicas_of(settings)) * settings.local_world_size,
        table_version=table_version)


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


def layout_of(settings: SidecarSettings) -> layout.WorldLayout:
    """The in-place world `settings` serve: where its rendezvous and coordinator are."""
    host, port = layout.parse_coordinator(settings.coordinator or "")
    return layout.WorldLayout(
        epoch=settings.world_epoch, replicas=replicas_of(settings), gpus_per_replica=settings.local_world_size,
        in_place=True, master_addr=settings.master_addr, master_port=settings.master_port,
        coordinator_port=port, coordinator_host=None if host == settings.master_addr else host)


def _following(settings: SidecarSettings) -> SidecarSettings:
    """`settings` moved to the next world's epoch and the other port of the pair (WorldLayout.next)."""
    assert settings.coordinator is not None or replicas_of(settings) == 1
    following = layout_of(settings).next(replicas_of(settings))
    return dataclasses.replace(settings, world_epoch=following.epoch, coordinator=following.coordinator or None,
                               master_port=following.master_port)


def adopt_world(settings: SidecarSettings, world: membership.World | None) -> SidecarSettings:
    """The settings of the later world `world` names, when it is this pod's and still runs
    (a sidecar restarted after its pod changed world in place); else `settings` as they are."""
    if (world is None or world.epoch <= settings.world_epoch or world.rank != settings.rank
            or world.state not in (membership.SERVING, membership.CHANGING)):
        return settings
    address = layout_of(settings).later(world.epoch, replicas_of(settings)).coordinator or None
    log.info("this pod runs world %d (its world file), not world %d (its environment): joining world %d",
             world.epoch, settings.world_epoch, world.epoch)
    return dataclasses.replace(
        settings, world_epoch=world.epoch, world_size=world.world_size, coordinator=address,
        master_port=world.master_port, resume_step=None, resume=wellknown.RESUME_LATEST)
