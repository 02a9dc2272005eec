"""The Hugging Face Trainer (Accelerate underneath) on splitfeed, through the real framework:
DDP over gloo on CPU, ranks run by `splitfeed local` as pods would be. The trainer
(hf_trainer.py) logs the batches the Trainer trained; the exactness rule compares them with
lancedb's StreamingDataset order. The plain Trainer read an iterable on rank 0 alone and
dispatched it (rank 1's splits never trained), and skipped `resume_step` batches on resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations import jobs


def test_a_live_rescale_under_the_hf_trainer_trains_every_step_once(table_uri, tmp_path):
    jobs.rescale_2_to_3_at_6(Path(__file__).with_name("hf_trainer.py"), table_uri, tmp_path)
    ends = jobs.exits(tmp_path / "logs")
    assert {e["globalStep"] for name, e in ends.items() if name.startswith("w1")} == {20}


def test_max_steps_then_a_resume_on_three_ranks_skips_no_batch(table_uri, tmp_path):
    jobs.stop_at_5_then_resume_on_3(Path(__file__).with_name("hf_trainer.py"), table_uri, tmp_path)


def test_the_trainer_refuses_a_train_dataset_of_its_own():
    from splitfeed.trainer_client.integrations.hf import SplitfeedTrainer

    with pytest.raises(ValueError, match="pass no train_dataset"):
        SplitfeedTrainer(object(), train_dataset=[1])  # type: ignore[arg-type]
