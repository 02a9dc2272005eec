"""The chaos soak at CI size, and the seeds that found bugs (python -m tests.soak replays any).

Each runs `python -m tests.soak` as its own process: it becomes the subreaper of what its
`splitfeed local` runs leave, and fails (exit 1, the seed and its schedule printed) on any
invariant broken: steps lost or committed twice against lancedb, an event that did not
settle within 60 s, a process, port or shared-memory file left behind, a forged message answered.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def soak(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.soak", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("seed", [29, 248])
def test_a_seeded_soak_of_5_events_keeps_every_invariant(seed):
    done = soak("--seed", str(seed), "--events", "5", timeout=380)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert f"soak: seed {seed} passed" in done.stdout and "1 seeds, 5 events, 0 failing seeds" in done.stdout


@pytest.mark.timeout(300)
def test_seed_2_an_in_place_scale_up_asked_in_the_last_steps_ends_with_the_job():
    """Found by the soak: the new pod was still starting when the world trained its last step;
    `splitfeed local` waited for it (READY_WAIT_S, 120 s), asked a world that had ended to
    drain, and failed with exit 1 minutes after the job ended with every step trained."""
    done = soak("--seed", "2", "--events", "1", "--mode", "inPlace", "--epochs", "1", "--sleep-s", "0.02",
                timeout=280)
    assert "seed 2: --rescale inPlace, 1 replicas, 1 events\n   0. scale -> 2" in done.stdout, done.stdout
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]


@pytest.mark.timeout(300)
def test_seed_425_a_killed_agents_trainer_does_not_outlive_the_run():
    """Found by the soak: an in-place pod's agent SIGKILLed after a scale-down to one replica;
    `splitfeed local` signalled a process group only while its leader lived, so the agent's
    trainer script trained on, orphaned, listening on the world's MASTER_PORT."""
    done = soak("--seed", "425", "--events", "2", "--mode", "inPlace", timeout=280)
    assert "   0. scale -> 1 (+2 steps)\n   1. kill-agent rank 0 (+1 steps)" in done.stdout, done.stdout
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]


@pytest.mark.timeout(300)
def test_seed_64_an_in_place_rescale_after_a_scale_down_reaches_the_coordinator():
    """Found by the soak: the world an in-place scale-down left had no keypair of the run, so
    the next rescale's drain request fell back to SPLITFEED_KEYS_DIR, unset in a user's shell:
    `splitfeed local` failed with exit 1 (the test suite sets it, which hid this)."""
    done = soak("--seed", "64", "--events", "2", "--mode", "inPlace", timeout=280)
    assert "   0. scale -> 1 (+3 steps)\n   1. scale -> 2 (+2 steps)" in done.stdout, done.stdout
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
