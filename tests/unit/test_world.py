"""A world of a job as one value (trainer_client/contract/layout.py): the next world, the
environment it gives a pod, and the environment read back."""

from __future__ import annotations

import dataclasses

import pytest

from splitfeed.trainer_client.contract import errors, layout, wellknown
from splitfeed.trainer_client.contract.layout import WorldLayout

IN_PLACE = WorldLayout.at(0, replicas=2, gpus_per_replica=2, in_place=True, master_addr="resnet-r0.resnet")
RECREATED = WorldLayout.at(0, replicas=2, gpus_per_replica=2, master_addr="resnet-w0-0.resnet")


def test_in_place_the_next_world_flips_both_ports_and_keeps_replica_0s_address():
    worlds = [IN_PLACE]
    for replicas in (3, 1, 4):
        worlds.append(worlds[-1].next(replicas))
    assert [(w.epoch, w.replicas, w.master_port, w.coordinator_port) for w in worlds] == [
        (0, 2, 29500, 29501), (1, 3, 29510, 29511), (2, 1, 29500, 29501), (3, 4, 29510, 29511)]
    assert {w.master_addr for w in worlds} == {"resnet-r0.resnet"} and all(w.in_place for w in worlds)
    assert [w.coordinator for w in worlds[:2]] == ["tcp://resnet-r0.resnet:29501", "tcp://resnet-r0.resnet:29511"]


def test_a_recreated_world_keeps_its_ports():
    following = RECREATED.next(3)
    assert (following.epoch, following.replicas, following.master_port, following.coordinator_port) == (
        1, 3, 29500, 29501)
    assert RECREATED.alternating() == (RECREATED,)
    assert IN_PLACE.alternating() == (IN_PLACE, IN_PLACE.next(2))


def test_a_later_world_is_the_next_one_until_there():
    assert IN_PLACE.later(3, 4) == IN_PLACE.next(1).next(1).next(4)
    assert (IN_PLACE.later(3, 4).master_port, IN_PLACE.later(4, 4).master_port) == (29510, 29500)
    assert IN_PLACE.later(0, 4) == dataclasses.replace(IN_PLACE, replicas=4)


def test_at_places_an_odd_world_in_place_on_the_other_pair():
    assert WorldLayout.at(5, in_place=True) == WorldLayout.at(4, in_place=True).next(1)
    assert (WorldLayout.at(5, in_place=True).master_port, WorldLayout.at(5).master_port) == (29510, 29500)
    odd = WorldLayout.at(3, in_place=True, ports=(4000, 5000))
    assert (odd.master_port, odd.coordinator_port) == (4010, 5010)


def test_a_world_without_a_coordinator_keeps_none():
    lone = dataclasses.replace(IN_PLACE, coordinator_port=None)
    assert lone.next(1).coordinator_port is None and lone.coordinator == "" and lone.coordinator_at("h") == ""


def test_the_coordinator_by_a_pod_ip_brackets_ipv6():
    assert IN_PLACE.coordinator_at("10.0.0.7") == "tcp://10.0.0.7:29501"
    assert IN_PLACE.next(2).coordinator_at("fd00::7") == "tcp://[fd00::7]:29511"


def test_env_is_the_pods_rank_environment_written_out():
    """What operator/objects/planning.py gives replica 1 of an odd world in place, longhand."""
    world = WorldLayout.at(3, replicas=3, gpus_per_replica=2, in_place=True, master_addr="resnet-r0.resnet")
    assert world.env(1) == {
        "WORLD_SIZE": "6", "NODE_RANK": "1", "RANK": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "resnet-r0.resnet", "MASTER_PORT": "29510",
        "SPLITFEED_SOCKET_DIR": "/var/run/splitfeed", "SPLITFEED_WORLD_EPOCH": "3"}
    assert world.torchrun_env(1) == {
        "PET_NNODES": "3", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "resnet-r0.resnet", "PET_MASTER_PORT": "29510"}
    assert world.coordinator == "tcp://resnet-r0.resnet:29511"
    assert WorldLayout.at(0, replicas=4).torchrun_env(2) == {}
    assert WorldLayout.at(2, replicas=4).env(3, local_rank=0, socket_dir="/tmp/s") == {
        "WORLD_SIZE": "4", "NODE_RANK": "3", "RANK": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "SPLITFEED_SOCKET_DIR": "/tmp/s",
        "SPLITFEED_WORLD_EPOCH": "2"}


@pytest.mark.parametrize("world", [IN_PLACE, IN_PLACE.next(3), RECREATED.next(1),
                                   WorldLayout.at(7, replicas=5, in_place=True, ports=(4000, 5000)),
                                   dataclasses.replace(RECREATED, coordinator_port=None),
                                   dataclasses.replace(RECREATED, coordinator_host="fd00::1")])
@pytest.mark.parametrize("replica", [0, 1])
def test_from_env_reads_back_what_env_and_the_coordinator_variable_wrote(world, replica):
    env = {**world.env(replica, local_rank=1), **world.torchrun_env(replica),
           wellknown.COORDINATOR_ENV: world.coordinator, "UNRELATED": "x"}
    assert WorldLayout.from_env(env, in_place=world.in_place) == world


def test_from_env_of_an_empty_environment_is_one_process_on_this_machine():
    assert WorldLayout.from_env({}) == WorldLayout(epoch=0, replicas=1, coordinator_port=None)


@pytest.mark.parametrize("address", ["127.0.0.1:29501", "tcp://host", "tcp://host:port", "tcp://:29501"])
def test_from_env_refuses_a_coordinator_that_is_not_tcp_host_port(address):
    with pytest.raises(errors.UserError, match="SPLITFEED_COORDINATOR"):
        WorldLayout.from_env({wellknown.COORDINATOR_ENV: address})


def test_the_port_steps_undo_each_other():
    for epoch in range(4):
        port = layout.world_port(29500, epoch)
        assert layout.base_port(port, epoch) == 29500
        assert layout.next_port(port, epoch) == layout.world_port(29500, epoch + 1)
