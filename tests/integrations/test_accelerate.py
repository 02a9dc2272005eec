"""A loop of its own on Hugging Face Accelerate, through the real framework: DDP over gloo on CPU,
ranks run by `splitfeed local` as pods would be, against lancedb's StreamingDataset order. The
loop prepares the model and optimizer, never the data (accelerate_trainer.py says why)."""

from __future__ import annotations

import functools
from pathlib import Path

from tests.integrations import jobs
from tests.support import exactness
from tests.support.tables import check_exact

run = functools.partial(jobs.run, Path(__file__).with_name("accelerate_trainer.py"))


def test_a_live_rescale_under_accelerate_trains_every_step_once_and_resumes_its_state(table_uri, tmp_path):
    (tmp_path / "logs").mkdir()
    err = run(table_uri, tmp_path, "--replicas", "2", "--resume", "none", "--scale-at", "6:3",
              trainer_args=("--sleep-s", "0.2"))
    summary = check_exact(tmp_path / "logs", tmp_path / "ckpt" / "test" / "job", table_uri)
    assert [(w.size, w.resume_step, w.ended) for w in summary.worlds] == [
        (2, 0, exactness.DRAINED), (3, 6, exactness.END)], summary
    assert "; 0 steps redone" in err, err
    assert (tmp_path / "logs" / "models" / "6" / "model.safetensors").exists()


def test_accelerate_leaves_the_client_unprepared():
    """What makes the loop safe: Accelerate prepares DataLoaders only, and the client is none."""
    from accelerate import Accelerator

    from splitfeed.trainer_client import StreamClient

    client = object.__new__(StreamClient)  # no sidecar needed: prepare only looks at its type
    assert Accelerator(cpu=True).prepare(client) is client
