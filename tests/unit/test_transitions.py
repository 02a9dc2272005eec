"""A sidecar's next world in place (sidecar/world/transitions.py), as pure functions: the ports
and the coordinator's address each world uses, written out longhand (even worlds on the job's
pair, odd worlds 10 above), never computed by the code under test."""

from __future__ import annotations

from pathlib import Path

from splitfeed.sidecar.world import transitions
from splitfeed.sidecar.world.settings import SidecarSettings
from splitfeed.trainer_client.contract import membership, messages


def settings(epoch: int, master_port: int, coordinator: str | None, *, replicas: int = 2, rank: int = 0,
             gpus: int = 1) -> SidecarSettings:
    return SidecarSettings(config=Path("c.json"), socket_dir=Path("s"), rank=rank, world_size=replicas * gpus,
                           local_world_size=gpus, coordinator=coordinator, world_epoch=epoch,
                           master_addr="10.0.0.5", master_port=master_port)


def test_a_drained_world_moves_to_the_other_pair_of_ports_and_back():
    after_0 = transitions.drained_world_next(settings(0, 29500, "tcp://10.0.0.5:29501"), 40, 3, None)
    assert (after_0.world_epoch, after_0.master_port, after_0.coordinator) == (1, 29510, "tcp://10.0.0.5:29511")
    assert (after_0.resume_step, after_0.world_size) == (40, 3)
    after_1 = transitions.drained_world_next(after_0, 80, 0, 7)
    assert (after_1.world_epoch, after_1.master_port, after_1.coordinator) == (2, 29500, "tcp://10.0.0.5:29501")
    assert (after_1.world_size, after_1.table_version) == (3, 7)  # 0 replicas asked: as many as now


def test_the_coordinators_own_host_and_an_ipv6_host_are_kept():
    other = transitions.drained_world_next(settings(0, 29500, "tcp://sidecar-0.job:29501"), 1, 2, None)
    assert other.coordinator == "tcp://sidecar-0.job:29511"
    six = transitions.drained_world_next(settings(1, 29510, "tcp://[fd00::5]:29511"), 1, 2, None)
    assert (six.master_port, six.coordinator) == (29500, "tcp://[fd00::5]:29501")


def test_a_lone_sidecar_without_a_coordinator_address_keeps_none():
    lone = transitions.drained_world_next(settings(0, 29500, None, replicas=1), 5, 1, None)
    assert (lone.world_epoch, lone.master_port, lone.coordinator) == (1, 29510, None)


def test_after_a_loss_the_survivors_follow_on_the_other_ports_from_the_newest_checkpoint():
    lost = messages.WorldLost(replicas=2, lost=[1])
    survivor = transitions.lost_world_next(settings(0, 29500, "tcp://10.0.0.5:29501", replicas=3), lost, None)
    assert survivor is not None
    assert (survivor.world_epoch, survivor.master_port, survivor.coordinator) == (1, 29510, "tcp://10.0.0.5:29511")
    assert (survivor.world_size, survivor.resume_step, survivor.after_loss) == (2, None, True)
    gone = settings(0, 29500, "tcp://10.0.0.5:29501", replicas=3, rank=1)
    assert transitions.lost_world_next(gone, lost, None) is None


def world_file(epoch: int, master_port: int, rank: int = 0, state: str = membership.SERVING) -> membership.World:
    return membership.World(epoch=epoch, state=state, rank=rank, world_size=2, replicas=2,
                            master_addr="10.0.0.5", master_port=master_port)


def test_a_restarted_sidecar_joins_the_later_world_its_pod_moved_to():
    start = settings(0, 29500, "tcp://10.0.0.5:29501")
    for epoch, port, coordinator in ((1, 29510, "tcp://10.0.0.5:29511"), (2, 29500, "tcp://10.0.0.5:29501"),
                                     (3, 29510, "tcp://10.0.0.5:29511")):
        adopted = transitions.adopt_world(start, world_file(epoch, port))
        assert (adopted.world_epoch, adopted.master_port, adopted.coordinator) == (epoch, port, coordinator)
    odd = transitions.adopt_world(settings(1, 29510, "tcp://10.0.0.5:29511"), world_file(2, 29500))
    assert odd.coordinator == "tcp://10.0.0.5:29501"


def test_a_world_file_of_an_older_world_another_pod_or_an_ended_world_changes_nothing():
    start = settings(1, 29510, "tcp://10.0.0.5:29511")
    for world in (world_file(0, 29500), world_file(1, 29510), world_file(2, 29500, rank=1),
                  world_file(2, 29500, state=membership.ENDED), None):
        assert transitions.adopt_world(start, world) is start
