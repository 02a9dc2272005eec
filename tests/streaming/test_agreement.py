"""A world's ranks agree on one drain step (docs/agreement.md), in process.

Real sidecars (threads of this process, each with its coordinator or member),
real ZeroMQ over TCP between them, real LanceDB. The ranks are threads held in
step by a `threading.Barrier` after every batch: it plays the all-reduce of a
synchronous trainer and decides nothing. If the sidecars did not agree, one
rank would leave the loop while its peers wait at the barrier, and the test
fails with a broken barrier.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from splitfeed.trainer_client.script.client import StreamClient
from splitfeed.trainer_client.transport.worlds import request_drain

from tests.streaming.harness import coordinator_address, manifest, reference_batches


def run_ranks(started, gpus: int, *, request_at: int, request=None, slow_rank: int = 0,
              step_s: float = 0.0) -> dict[int, dict]:
    """`step_s`: each rank's compute per step once the request is made."""
    world = len(started) * gpus
    lockstep = threading.Barrier(world)
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def rank_loop(pod, local_rank: int) -> None:
        try:
            client = StreamClient(pod.socket_dir, local_rank, timeout_s=120)  # six loader workers start on 2 cores
            out = {"steps": [], "saved": None, "resume": client.resume_step}
            for batch in client:
                if client.rank == slow_rank:
                    time.sleep(0.03)  # this rank is behind its peers when the request lands
                out["steps"].append((batch.global_step, batch["id"].tolist()))
                del batch
                lockstep.wait(60)  # the step's all-reduce
                if out["steps"][-1][0] == request_at and client.rank == world - 1:
                    request()
                if step_s and out["steps"][-1][0] >= request_at:
                    time.sleep(step_s)
                if client.checkpoint_requested:
                    out["saved"] = client.checkpoint()
                    client.commit(out["saved"])
                    if client.drained:
                        break
            out["drained"] = client.drained
            client.close()
            results[client.rank] = out
        except BaseException as exc:  # noqa: BLE001 - reported below
            lockstep.abort()
            errors.append(exc)

    threads = [threading.Thread(target=rank_loop, args=(pod, lr)) for pod in started for lr in range(gpus)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not errors, errors
    return results


@pytest.mark.parametrize("gpus,workers,via", [(1, 1, "operator"), (2, 1, "operator"), (1, 2, "annotation")],
                         ids=["3x1", "2x2-ranks-per-sidecar", "3x1-two-workers-annotation"])
def test_every_rank_checkpoints_on_the_same_step_and_the_next_world_resumes_there(
        pods, table_uri, tmp_path, gpus, workers, via):
    replicas = 3 if gpus == 1 else 2
    world = replicas * gpus
    data = {"numWorkers": workers}
    step_s = 0.0
    if via == "annotation":
        # The sidecar reads the downward-API file every 0.5 s; a world that ran out of
        # steps before that has nothing left to drain. Give it a real trainer's pace and
        # steps to spare (3 epochs: 57 steps after the request, about 3 s).
        data["epochs"] = 3
        step_s = 0.05
    job = manifest(table_uri, str(tmp_path / "ckpt"), **data)
    coordinator = coordinator_address()
    started = [pods(f"a{r}", job, replicas=replicas, replica=r, gpus=gpus, coordinator=coordinator).start_thread()
               for r in range(replicas)]

    def request() -> None:
        if via == "operator":
            assert request_drain(coordinator, "rescale-w0", "rescale", timeout_s=5) == "freezing"
        else:  # the downward-API file of one pod only: the slow path, polled
            started[-1].request("splitfeed.io/drain", "rescale-w0")

    results = run_ranks(started, gpus, request_at=3, request=request, step_s=step_s)
    agreed = {r["saved"] for r in results.values()}
    assert len(agreed) == 1, results
    (step,) = agreed
    assert step > 3
    if via == "operator":  # at most prefetchBatches (2) batches wait beyond the taken ones
        assert step <= 3 + 1 + 2 + 2
    for rank, r in results.items():
        assert r["drained"] and r["resume"] == 0
        expected = reference_batches(table_uri, data, world, rank)
        assert r["steps"] == list(enumerate(expected))[:step], f"rank {rank} went past step {step - 1}"
    for pod in started:
        assert pod.wait() == 0
        report = json.loads(pod.termination_log.read_text())
        assert (report["drained"], report["agreedStep"], report["error"]) == (True, step, None)

    # The next world (another size) is told the step and resumes exactly there.
    coordinator = coordinator_address()
    nxt = [pods(f"b{r}", job, replicas=2, replica=r, coordinator=coordinator, resume_step=step,
                world_epoch=1).start_thread()
           for r in range(2)]
    results = run_ranks(nxt, 1, request_at=-1)
    for rank, r in results.items():
        assert r["resume"] == step
        expected = reference_batches(table_uri, data, 2, rank)
        assert r["steps"] == list(enumerate(expected))[step:]


def test_a_world_told_a_step_the_store_does_not_hold_fails_loudly(pods, table_uri, tmp_path):
    pod = pods("p", manifest(table_uri, str(tmp_path / "ckpt")), replicas=1, replica=0, resume_step=5).start_thread()
    with pytest.raises(Exception, match="checkpoint step 5 .* is not complete"):
        StreamClient(pod.socket_dir, 0, timeout_s=20)
