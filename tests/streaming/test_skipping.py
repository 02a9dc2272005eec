"""onTransformError=skip through real sidecars, their coordinator and the ring.

Ranks whose splits lose different numbers of rows must all end each epoch at the
same global step: the trainers here step in lockstep (a barrier stands in for a
DDP all_reduce: a rank that ran out while the others wait breaks it, a rank that
is never given a batch the others got times it out). Expected rows come from
lancedb's StreamingDataset(on_transform_error="skip") in-process for each rank,
cut at the world's end E, which the test computes from each split's rows and the
failing ids (tests/reading/test_skipping.py covers the reader for more world sizes).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import yaml

import pytest

from splitfeed.trainer_client.contract import specs
from splitfeed.trainer_client.transport import worlds
from splitfeed.trainer_client.script.client import StreamClient
from splitfeed.trainer_client.transport.worlds import request_drain

from tests.streaming.harness import coordinator_address, manifest
from tests.support import exactness
from tests.support.skipping import EPOCHS, G, N, TRANSFORM, expected_steps, job, lancedb_ids, lockstep
from tests.support.waiting import wait_for

def to_the_end(client: StreamClient, barrier: threading.Barrier) -> dict[int, list[int]]:
    """A lockstep trainer: global step -> ids, a barrier at each step and one after the last."""
    got = {}
    for batch in client:
        barrier.wait()
        got[batch.global_step] = batch["id"].tolist()
    barrier.wait()
    return got


def test_ranks_with_unequal_skips_end_every_epoch_at_the_same_step(pods, table_uri, plan):
    world = 3
    manifest_ = job(table_uri, plan["bad"])
    coordinator = coordinator_address()
    started = [pods(f"pod{r}", manifest_, replicas=world, replica=r, coordinator=coordinator).start_thread()
               for r in range(world)]
    own_ends = [len(lancedb_ids(plan["data"], epoch=0, rank=r, world=world, bad=plan["bad"])) // (G // world)
                for r in range(world)]
    assert min(own_ends) == plan["ends"][0] < max(own_ends)  # lancedb alone would end them apart

    def train(client: StreamClient, barrier: threading.Barrier) -> dict[int, list[int]]:
        got = {}
        for batch in client:
            barrier.wait()  # the all_reduce: every rank is at this step
            assert (batch.epoch, batch.step) == divmod(batch.global_step, plan["spe"])
            got[batch.global_step] = batch["id"].tolist()
        barrier.wait()  # and every rank ended after the same step
        return got

    results = lockstep(world, [p.socket_dir for p in started], train)
    for rank, got in enumerate(results):
        assert got == expected_steps(plan, world, rank), f"rank {rank}"
    reports = []
    for pod in started:
        assert pod.wait() == 0
        reports.append(json.loads(pod.termination_log.read_text())["skippedRows"])
    # The pods are threads of this process and share its count, complete once all published.
    assert plan["dropped"] < len(plan["bad"]) * EPOCHS and reports == [plan["dropped"]] * world


def test_skipped_rows_reach_the_live_status_and_the_report(pods, table_uri, plan):
    """One sidecar process (its own count): once its trainer has every step, the coordinator's
    status (what the operator writes to status.progress.skippedRows) and the report give the
    rows dropped from the published steps, which the test counted from the splits' own rows."""
    address = coordinator_address()
    pod = pods("pod", job(table_uri, plan["bad"]), replicas=1, replica=0, coordinator=address).start_process()
    with StreamClient(pod.socket_dir, 0, timeout_s=60) as client:
        got = {batch.global_step: batch["id"].tolist() for batch in client}
        live = wait_for(lambda: getattr(worlds.request_status(address, timeout_s=5), "skipped_rows", None)
                        == plan["dropped"], timeout=30, what="the coordinator's status counting the skipped rows")
    assert live
    assert got == expected_steps(plan, 1, 0)
    assert pod.wait() == 0
    assert json.loads(pod.termination_log.read_text())["skippedRows"] == plan["dropped"]


@pytest.mark.parametrize("at,workers", [("mid-epoch", 1), ("mid-epoch", 2), ("first-missing", 1),
                                        ("first-missing", 2), ("last-present", 1)])
def test_a_checkpoint_after_skips_resumes_exactly_on_another_world_size(pods, table_uri, plan, tmp_path, at,
                                                                      workers):
    """World 2 checkpoints (from its checkpoint store, not a live drain) at step 12 of epoch 0
    (split 5 has skipped rows by then), at epoch 0's first missing step E, or right before
    it (E - 1), and stops; world 3 resumes there with numWorkers 1 or 2: every global step
    holds the reference rows exactly once."""
    store = str(tmp_path / "ckpt")
    manifest_ = job(table_uri, plan["bad"], store)
    cut = {"mid-epoch": 12, "first-missing": plan["ends"][0], "last-present": plan["ends"][0] - 1}[at]
    steps: dict[int, list[int]] = {}

    def first(client: StreamClient, barrier: threading.Barrier) -> dict[int, list[int]]:
        got = {}
        for batch in client:
            got[batch.global_step] = batch["id"].tolist()
            if batch.global_step == cut - 1:
                break
        barrier.wait()
        assert client.checkpoint() == cut
        client.commit()
        return got

    coordinator = coordinator_address()
    old = [pods(f"a{r}", manifest_, replicas=2, replica=r, coordinator=coordinator).start_thread()
           for r in range(2)]
    for got in lockstep(2, [p.socket_dir for p in old], first):
        for step, ids in got.items():
            steps.setdefault(step, []).extend(ids)
    for pod in old:
        pod.stop()

    coordinator = coordinator_address()
    resumed = job(table_uri, plan["bad"], store)
    resumed["spec"]["data"]["numWorkers"] = workers
    new = [pods(f"b{r}", resumed, replicas=3, replica=r, coordinator=coordinator, world_epoch=1).start_thread()
           for r in range(3)]
    results = lockstep(3, [p.socket_dir for p in new], to_the_end)
    # At E nothing of epoch 0 is left: the world goes on at epoch 1's first step.
    assert min(min(got) for got in results) == (plan["spe"] if at == "first-missing" else cut)
    for got in results:
        for step, ids in got.items():
            steps.setdefault(step, []).extend(ids)
    reference = expected_steps(plan, 1, 0)
    assert sorted(steps) == sorted(reference)
    assert all(sorted(steps[k]) == sorted(reference[k]) for k in reference)


E2E_TRAINER = Path(__file__).parents[1] / "e2e" / "trainer.py"


def test_splitfeed_local_with_ddp_trainers_rescaled_2_to_3_trains_exactly_on_the_skipped_rows(
    table_uri, plan, tmp_path
):
    """`splitfeed local` runs real sidecars (the same agreement) and real DDP trainers (gloo,
    an all_reduce every step): a world whose ranks lose unequal rows neither hangs nor
    diverges, and a live rescale mid-epoch 0 keeps every global step exact."""
    logs, store = tmp_path / "logs", tmp_path / "ckpt"
    job_ = manifest(table_uri, str(store), transform="tests.support.skipping_transforms:passthrough_fragile",
                    transformArgs=json.dumps({"bad": plan["bad"]}), onTransformError="skip", epochs=EPOCHS,
                    numWorkers=2)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_))
    done = subprocess.run(
        [sys.executable, "-m", "splitfeed.trainer_client.cli", "local", "-f", str(path), "--replicas", "2",
         "--resume", "none", "--scale-at", "6:3", "--", sys.executable, str(E2E_TRAINER), str(logs),
         "--sleep-s", "0.1"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    spe = plan["spe"]
    absent = frozenset(e * spe + k for e, end in enumerate(plan["ends"]) for k in range(end, spe))
    # The summary counts the steps trained (lancedb's, plus none redone) and says why the run
    # stopped short of the grid the progress line counted toward.
    assert f"splitfeed local: {sum(plan['ends'])} global steps," in done.stderr, done.stderr[-3000:]
    assert plan["ends"][-1] < spe  # the last epoch ends early too
    assert (f"ended at global step {(EPOCHS - 1) * spe + plan['ends'][-1]}/{EPOCHS * spe}: "
            "onTransformError=skip dropped rows") in done.stderr
    grid = [set(expected_steps(plan, 1, 0).get(s, [])) for s in range(EPOCHS * spe)]
    summary = exactness.check(logs, exactness.complete_checkpoints(store / "test" / "job"), grid,
                              lambda world, rank: expected_steps(plan, world, rank), absent)
    assert [w.size for w in summary.worlds] == [2, 3], summary
    assert summary.replayed == 0, summary


@pytest.fixture(scope="module")
def empty_plan(table_uri: str) -> dict[str, Any]:
    """Three epochs; split 8 of epoch 1 keeps one row (fewer than G/N), so the world's epoch 1
    holds no step at all (E = 0) while epochs 0 and 2 end early but hold steps."""
    epochs = 3
    data = specs.parse_job(manifest(table_uri, epochs=epochs), check_replicas=False).data
    splits = {e: [lancedb_ids(data, epoch=e, rank=s, world=N, bad=None) for s in range(N)] for e in range(epochs)}
    bad = splits[1][8][1:]
    spe = len(splits[0][0]) // (G // N)
    ends = [min(spe, *(sum(i not in bad for i in ids) // (G // N) for ids in splits[e])) for e in range(epochs)]
    assert ends[1] == 0 and 0 < ends[0] < spe and 0 < ends[2] < spe, ends
    manifest_ = manifest(table_uri, None, transform=TRANSFORM, transformArgs=json.dumps({"bad": bad}),
                         onTransformError="skip", epochs=epochs)
    return {"bad": bad, "ends": ends, "spe": spe, "epochs": epochs,
            "data": specs.parse_job(manifest_, check_replicas=False).data}


def empty_job(plan: dict[str, Any], uri: str, store: str | None, **data: Any) -> dict[str, Any]:
    return manifest(uri, store, transform=TRANSFORM, transformArgs=json.dumps({"bad": plan["bad"]}),
                    onTransformError="skip", epochs=plan["epochs"], **data)


@pytest.mark.parametrize("at,workers", [("last-step-before", 1), ("first-step-after", 1), ("last-step-before", 2)])
def test_a_drain_next_to_an_epoch_the_whole_world_lost_neither_hangs_nor_loses_a_step(
        pods, table_uri, empty_plan, tmp_path, at, workers):
    """Epoch 1 holds no step (E = 0). World 2 asks for a drain on the last step of epoch 0, or
    on the first step of epoch 2, and keeps stepping in lockstep: every rank drains at the same
    step (none hangs); world 3 resumes there and the union is lancedb's, every step once.
    numWorkers 2 splits each rank's reading between two loader processes."""
    plan = empty_plan
    spe, ends = plan["spe"], plan["ends"]
    trigger = ends[0] - 1 if at == "last-step-before" else 2 * spe
    store = str(tmp_path / "ckpt")
    manifest_ = empty_job(plan, table_uri, store, numWorkers=workers)
    coordinator = coordinator_address()
    steps: dict[int, list[int]] = {}

    def first(client: StreamClient, barrier: threading.Barrier) -> dict[str, Any]:
        got = {}
        for batch in client:
            barrier.wait()
            got[batch.global_step] = batch["id"].tolist()
            if batch.global_step == trigger and client.rank == 0:
                assert request_drain(coordinator, f"drain-{at}", "rescale", timeout_s=5) in ("freezing", "committed")
            if client.checkpoint_requested:
                client.checkpoint()
                client.commit()
        barrier.wait()
        return {"got": got, "drained": client.drained}

    old = [pods(f"a{r}", manifest_, replicas=2, replica=r, coordinator=coordinator).start_thread() for r in range(2)]
    results = lockstep(2, [p.socket_dir for p in old], first)
    assert all(r["drained"] for r in results), "the world did not drain"
    last = [max(r["got"]) for r in results]
    assert last[0] == last[1] and last[0] >= trigger, last
    for r in results:
        for step, ids in r["got"].items():
            steps.setdefault(step, []).extend(ids)
    for pod in old:
        pod.stop()

    coordinator = coordinator_address()
    new = [pods(f"b{r}", manifest_, replicas=3, replica=r, coordinator=coordinator, world_epoch=1).start_thread()
           for r in range(3)]
    later = lockstep(3, [p.socket_dir for p in new], to_the_end)
    for got in later:
        assert min(got) > last[0]
        for step, ids in got.items():
            steps.setdefault(step, []).extend(ids)
    reference = expected_steps(plan, 1, 0)
    assert sorted(steps) == sorted(reference)
    assert all(sorted(steps[k]) == sorted(reference[k]) for k in reference)


def test_a_job_whose_every_epoch_lost_every_step_ends_cleanly_and_says_why(pods, table_uri, caplog):
    """Every row fails: E = 0 in every epoch. Two trainers in lockstep get no batch and end
    (no hang), the sidecars exit 0, and the log says that no step was left and why."""
    data = specs.parse_job(manifest(table_uri), check_replicas=False).data
    every = sorted({i for s in range(N) for i in lancedb_ids(data, epoch=0, rank=s, world=N, bad=None)})
    manifest_ = manifest(table_uri, None, transform=TRANSFORM, transformArgs=json.dumps({"bad": every}),
                         onTransformError="skip", epochs=EPOCHS)
    coordinator = coordinator_address()
    started = [pods(f"pod{r}", manifest_, replicas=2, replica=r, coordinator=coordinator).start_thread()
               for r in range(2)]

    def train(client: StreamClient, barrier: threading.Barrier) -> list[int]:
        got = [batch.global_step for batch in client]
        barrier.wait()
        return got

    with caplog.at_level(logging.WARNING):
        assert lockstep(2, [p.socket_dir for p in started], train) == [[], []]
        assert [pod.wait() for pod in started] == [0, 0]
    said = sorted(r.getMessage() for r in caplog.records if "no step of global steps" in r.getMessage())
    assert len(said) == 2 and all("spec.data.onTransformError" in m and "spec.data.transform" in m
                                  for m in said), said


def test_a_drain_on_the_last_step_before_an_empty_last_epoch_ends_the_job_cleanly(pods, table_uri, empty_plan):
    """The same rows over two epochs: the last one holds no step (E = 0). A drain asked on the
    job's last existing step cannot land on an absent step: the world ends there, every rank
    after the same batch, and the sidecars exit 0 (nothing hangs waiting for epoch 1)."""
    plan = {**empty_plan, "epochs": 2, "ends": empty_plan["ends"][:2]}
    last = plan["ends"][0] - 1
    coordinator = coordinator_address()
    started = [pods(f"pod{r}", empty_job(plan, table_uri, None), replicas=2, replica=r,
                    coordinator=coordinator).start_thread() for r in range(2)]

    def train(client: StreamClient, barrier: threading.Barrier) -> dict[int, list[int]]:
        got = {}
        for batch in client:
            barrier.wait()
            got[batch.global_step] = batch["id"].tolist()
            if batch.global_step == last and client.rank == 0:
                assert request_drain(coordinator, "drain-at-end", "rescale", timeout_s=5) is not None
        barrier.wait()
        return got

    results = lockstep(2, [p.socket_dir for p in started], train)
    assert [max(got) for got in results] == [last, last]
    for rank, got in enumerate(results):
        assert got == expected_steps(plan, 2, rank), f"rank {rank}"
    assert [pod.wait() for pod in started] == [0, 0]
