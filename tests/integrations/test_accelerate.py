"""A loop of its own on Hugging Face Accelerate, through the real framework: DDP over gloo on CPU,
ranks run by `splitfeed local` as pods would be, against lancedb's StreamingDataset order. The
loop prepares the model and optimizer, never the data (accelerate_trainer.py says why)."""

from __future__ import annotations

from pathlib import Path

from tests.integrations import jobs

TRAINER = Path(__file__).with_name("accelerate_trainer.py")


def test_a_live_rescale_under_accelerate_trains_every_step_once_and_resumes_its_state(table_uri, tmp_path):
    jobs.rescale_2_to_3_at_6(TRAINER, table_uri, tmp_path)
    assert (tmp_path / "logs" / "models" / "6" / "model.safetensors").exists()


def test_accelerate_leaves_the_client_unprepared():
    """What makes the loop safe: Accelerate prepares DataLoaders only, and the client is none."""
    from accelerate import Accelerator

    from splitfeed.trainer_client import StreamClient

    client = object.__new__(StreamClient)  # no sidecar needed: prepare only looks at its type
    assert Accelerator(cpu=True).prepare(client) is client
