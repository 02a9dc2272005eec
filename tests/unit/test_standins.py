"""The coordinator standing in for a dead member sidecar (sidecar/world/standins.py): when it may write a
rank's checkpoint at the drain step, and when a member counts as committed; and how a trainer
knows its sidecar is gone (trainer_client/transport/stranded.py: a lock the sidecar process holds)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from splitfeed.sidecar.world.agreement import Coordinator
from splitfeed.sidecar.world.standins import StandIns
from splitfeed.trainer_client.transport import stranded
from splitfeed.trainer_client.contract.messages import StandIn, Status

EPOCH, DRAIN = 3, 12


def committed_world(replicas: int = 3) -> Coordinator:
    """Every member joined, the world committed to drain at DRAIN."""
    c = Coordinator(replicas=replicas, total_steps=100, resume_step=0, world_epoch=EPOCH)
    for r in range(replicas):
        c.on_join(f"m{r}".encode(), r)
    c.on_request(b"operator", "rescale-w3", "rescale")
    for r in range(replicas):
        c.on_frozen(r, c.round, DRAIN - 2)
    assert c.step == DRAIN
    return c


def refusal(s: StandIns, c: Coordinator, request: StandIn, *, skipping: bool = False) -> str | None:
    return s.refusal(request, world_epoch=c.world_epoch, drain_step=c.step, skipping=skipping,
                     members=c.members, lost=c.lost is not None)


def ask(rank: int = 2, *, world_size: int = 6, epoch: int = EPOCH, step: int = DRAIN,
        commit: bool = False) -> StandIn:
    return StandIn(rank=rank, world_size=world_size, world_epoch=epoch, step=step, commit=commit)


def test_a_members_rank_is_written_at_its_worlds_committed_drain_step():
    c, s = committed_world(), StandIns(world_size=6, replicas=3)
    assert refusal(s, c, ask(rank=2)) is None  # replica 1's first rank (2 ranks per replica)
    assert refusal(s, c, ask(rank=5)) is None


@pytest.mark.parametrize("request_, why", [
    pytest.param(ask(epoch=EPOCH - 1), "for world 2", id="another-world"),
    pytest.param(ask(step=DRAIN - 1), "not world 3's drain step 12", id="not-the-drain-step"),
    pytest.param(ask(step=DRAIN + 1), "not world 3's drain step 12", id="past-the-drain-step"),
    pytest.param(ask(rank=0), "replica 0's", id="the-coordinators-own-rank"),
    pytest.param(ask(rank=1), "replica 0's", id="the-coordinators-own-second-rank"),
    pytest.param(ask(rank=6), "not in this world", id="a-rank-past-the-world"),
    pytest.param(ask(world_size=4), "not in this world", id="another-world-size"),
    pytest.param(ask(commit=True), "checkpoint before commit", id="a-commit-before-its-record"),
], )
def test_anything_else_is_refused_with_its_reason(request_, why):
    c, s = committed_world(), StandIns(world_size=6, replicas=3)
    found = refusal(s, c, request_)
    assert found is not None and why in found, found


def test_a_skip_jobs_ranks_are_refused_their_positions_are_their_own_sidecars():
    c, s = committed_world(), StandIns(world_size=6, replicas=3)
    found = refusal(s, c, ask(), skipping=True)
    assert found is not None and "drops rows" in found


def test_nothing_is_written_before_the_world_committed_a_drain_step():
    c = Coordinator(replicas=3, total_steps=100, resume_step=0, world_epoch=EPOCH)
    for r in range(3):
        c.on_join(f"m{r}".encode(), r)
    c.on_request(b"operator", "rescale-w3", "rescale")  # freezing: no step yet
    found = refusal(StandIns(world_size=6, replicas=3), c, ask())
    assert found is not None and "no committed drain step" in found


def test_a_replica_that_never_joined_is_refused():
    c = Coordinator(replicas=3, total_steps=100, resume_step=0, world_epoch=EPOCH)
    c.on_join(b"m0", 0)
    c.on_join(b"m1", 1)
    c.on_join(b"m2", 2, drain_step=DRAIN)  # a member that acts on a step makes it the world's
    del c.members[1]
    found = refusal(StandIns(world_size=6, replicas=3), c, ask(rank=2))
    assert found is not None and "has not joined" in found


def test_a_world_that_lost_members_is_refused():
    c = committed_world()
    c.on_lost(b"operator", "replace-w3-r2", [2], 3)
    found = refusal(StandIns(world_size=6, replicas=3), c, ask())
    assert found is not None and "lost member pods" in found


def test_a_member_counts_as_committed_once_every_rank_of_it_is_and_then_the_step_is_complete():
    c, s = committed_world(), StandIns(world_size=6, replicas=3)
    c.on_committed(0, DRAIN)
    c.on_committed(2, DRAIN)
    for rank in (2, 3):
        assert refusal(s, c, ask(rank=rank)) is None
        assert s.wrote(ask(rank=rank)) is None
    assert refusal(s, c, ask(rank=2, commit=True)) is None
    assert s.wrote(ask(rank=2, commit=True)) is None  # rank 3 of replica 1 not yet
    assert s.wrote(ask(rank=3, commit=True)) == 1
    assert c.complete_step is None
    c.on_committed(1, DRAIN)
    assert c.complete_step == DRAIN


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from splitfeed.trainer_client.transport import stranded
    fd = stranded.hold(Path(sys.argv[1]))
    print("held" if fd is not None else "not held", flush=True)
    time.sleep(60)
""")


def test_a_trainer_sees_its_sidecar_gone_once_the_process_holding_the_lock_is_killed(tmp_path):
    assert not stranded.gone(tmp_path)  # no sidecar ever locked it: not "gone"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert not stranded.gone(tmp_path)
        assert not stranded.gone(tmp_path)  # looking does not take it
        holder.kill()  # SIGKILL: no cleanup runs
        holder.wait(10)
        assert stranded.gone(tmp_path)
    finally:
        holder.kill()
        holder.wait(10)
        holder.stdout.close()


def test_the_coordinators_address_is_read_only_for_its_own_world(tmp_path):
    assert stranded.coordinator(tmp_path, EPOCH) is None
    stranded.write_coordinator(tmp_path, EPOCH, "tcp://job-w3-0.job:29501")
    assert stranded.coordinator(tmp_path, EPOCH) == "tcp://job-w3-0.job:29501"
    assert stranded.coordinator(tmp_path, EPOCH + 1) is None


def test_the_replicas_stood_in_for_at_a_step_are_those_every_rank_of_which_was_committed_here():
    s = StandIns(world_size=6, replicas=3)
    for rank in (2, 3, 4):
        s.wrote(ask(rank=rank))
        s.wrote(ask(rank=rank, commit=True))
    assert s.replicas_at(DRAIN) == [1]  # replica 2's rank 5 committed through its own sidecar, or not at all
    assert s.replicas_at(DRAIN + 1) == []
    s.wrote(ask(rank=5))
    s.wrote(ask(rank=5, commit=True))
    assert s.replicas_at(DRAIN) == [1, 2]


def test_the_next_worlds_coordinator_names_them_in_its_status_answer():
    """What the operator reads when it adopts the next world in place (messages.Status.stood_in)."""
    c = Coordinator(replicas=1, total_steps=100, resume_step=DRAIN, world_epoch=EPOCH + 1, stood_in=[1])
    (out,) = c.on_status_request(b"operator")
    answer = Status.decode(out.message.encode())
    assert (answer.world_epoch, answer.resume_step, answer.stood_in) == (EPOCH + 1, DRAIN, [1])
    (plain,) = Coordinator(replicas=1, total_steps=100, resume_step=DRAIN).on_status_request(b"operator")
    assert plain.message.stood_in is None and b"stood_in" not in plain.message.encode()
