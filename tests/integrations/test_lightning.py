"""PyTorch Lightning on splitfeed, through the real framework: `Trainer(strategy="ddp")` with
its default prefetching fetcher, gloo on CPU, ranks run by `splitfeed local` as pods would be.

The trainer (lightning_trainer.py) logs the batches Lightning trained, in `training_step`; the
exactness rule (tests/support/exactness.py) compares them with lancedb's StreamingDataset order.
Lightning reads one batch ahead of the one it trains: a checkpoint of what was handed out, not
trained, leaves a step untrained at every drain, which that rule fails on (a gap)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.integrations import jobs
from tests.support import exactness

TRAINER = Path(__file__).with_name("lightning_trainer.py")
run = functools.partial(jobs.run, TRAINER)
exits = jobs.exits


@pytest.mark.parametrize("data", ["sized", "unsized"])
def test_a_live_rescale_under_lightning_trains_every_step_once(table_uri, tmp_path, data):
    """`unsized`: a DataLoader without len(), over which Lightning's fetcher reads one ahead."""
    err, summary = jobs.rescale_2_to_3_at_6(TRAINER, table_uri, tmp_path,
                                            *(["--unsized"] if data == "unsized" else []))
    assert summary.replayed == 0
    assert "never trained" not in err, err
    # Lightning's own step count went on across the worlds: restored from its checkpoint at 6.
    assert {e["globalStep"] for name, e in exits(tmp_path / "logs").items() if name.startswith("w1")} == {20}


def test_a_sigterm_to_one_lightning_rank_drains_the_world_and_it_exits_0(table_uri, tmp_path):
    """Lightning's own SIGTERM handler broadcasts inside the signal handler: the ranks deadlocked.
    The callback gives SIGTERM back to the client, which asks the world to drain at one step."""
    (tmp_path / "logs").mkdir()
    run(table_uri, tmp_path, "--replicas", "2", "--resume", "none", trainer_args=("--sigterm-at", "4"))
    worlds = exactness.read_worlds(tmp_path / "logs")
    assert len(worlds) == 1
    ended, step = worlds[0].ended()
    assert ended == exactness.DRAINED and step is not None and 4 < step < 20, (ended, step)
    assert step in exactness.complete_checkpoints(tmp_path / "ckpt" / "test" / "job")


def test_max_steps_then_a_resume_on_three_ranks_continues_at_the_saved_step(table_uri, tmp_path):
    jobs.stop_at_5_then_resume_on_3(Path(__file__).with_name("lightning_trainer.py"), table_uri, tmp_path)
