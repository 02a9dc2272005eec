"""Checkpoints, elastic resume and faults: the delivered global steps stay exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitfeed.sidecar.world import checkpoints
from splitfeed.trainer_client import SidecarFailed
from splitfeed.trainer_client.script.client import StreamClient

from tests.streaming.harness import JOB_UID, coordinator_address, manifest, reference_batches, reference_global_steps
from tests.support.waiting import wait_for

SCRIPT = Path(__file__).with_name("trainer_script.py")


def logged(path: Path) -> list[tuple[int, list[int]]]:
    return [(r["step"], r["ids"]) for r in map(json.loads, path.read_text().splitlines())]


def trainer(pod, log: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, **pod.env, "LOCAL_RANK": "0"}
    return subprocess.Popen([sys.executable, str(SCRIPT), str(log), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_trainer_killed_between_checkpoint_and_model_save_is_resumed_at_its_last_committed_step(
        pods, table_uri, tmp_path):
    job = manifest(table_uri, str(tmp_path / "ckpt"))
    pod = pods("pod", job, replicas=1, replica=0).start_thread()
    log = tmp_path / "ids.jsonl"
    first = trainer(pod, log, "--save-at", "2", "--die-after-checkpoint", "4")
    out, err = first.communicate(timeout=120)
    assert first.returncode == 1, err
    # In place: the next process of the same world is rewound to step 2, not 4.
    second = trainer(pod, log, "--pause-after", "1")
    assert second.stdout.readline().strip() == "resume 2"
    second.kill()
    second.communicate()
    pod.stop()
    # A new world chooses the newest complete step: 2 as well (step 4 has no commit).
    fresh = pods("fresh", job, replicas=1, replica=0, world_epoch=1).start_thread()
    with StreamClient(fresh.socket_dir, 0) as client:
        assert client.resume_step == 2
        assert next(iter(client)).global_step == 2


@pytest.mark.parametrize("save_at", [None, 3], ids=["no-checkpoint", "committed-at-3"])
def test_a_trainer_restarted_in_place_resumes_where_its_model_was_saved(pods, table_uri, tmp_path, save_at):
    """resume_step and the data agree: a new process rewinds to the last committed step."""
    job = manifest(table_uri, str(tmp_path / "ckpt")) if save_at else manifest(table_uri)
    pod = pods("pod", job, replicas=1, replica=0).start_thread()
    log = tmp_path / "ids.jsonl"
    args = ["--save-at", str(save_at)] if save_at else []
    first = trainer(pod, log, "--pause-after", "5", *args)
    try:
        assert first.stdout.readline().strip() == "resume 0"
        assert first.stdout.readline().strip() == "paused"
        first.kill()  # SIGKILL by PID, mid-epoch
        first.wait()
    finally:
        first.kill()
        first.communicate()
    second = trainer(pod, log)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    resume = save_at or 0
    assert out.splitlines()[0] == f"resume {resume}"
    expected = list(enumerate(reference_batches(table_uri, {}, 1, 0)))
    assert logged(log) == expected[:5] + expected[resume:]


def test_a_killed_sidecar_is_replaced_and_the_trainer_continues_exactly(pods, table_uri):
    pod = pods("pod", manifest(table_uri), replicas=1, replica=0).start_process()
    expected = reference_batches(table_uri, {}, 1, 0)
    got = []
    with StreamClient(pod.socket_dir, 0, timeout_s=120) as client:
        for batch in client:
            got.append(batch["id"].tolist())
            if len(got) == 6:
                pod.kill()  # SIGKILL by PID
                pod.start_process()
    assert got == expected


def run_world(pods, job, world: int, name: str, until: int | None, resume: str = "latest", epoch: int = 0,
              uid: str = JOB_UID):
    """Run `world` ranks (world epoch `epoch`) in lockstep until `until` steps are done; checkpoint there."""
    coordinator = coordinator_address()
    started = [pods(f"{name}-{r}", job, replicas=world, replica=r, resume=resume,
                    coordinator=coordinator, world_epoch=epoch, job_uid=uid).start_thread()
               for r in range(world)]
    clients = [StreamClient(p.socket_dir, 0) for p in started]
    steps: dict[int, set[int]] = {}
    try:
        resume_step = clients[0].resume_step
        assert all(c.resume_step == resume_step for c in clients)
        iterators = [iter(c) for c in clients]
        while True:
            try:
                batches = [next(it) for it in iterators]
            except StopIteration:
                break
            step = batches[0].global_step
            assert all(b.global_step == step for b in batches)
            assert step not in steps
            steps[step] = set().union(*(b["id"].tolist() for b in batches))
            if until is not None and step + 1 == until:
                assert [c.checkpoint() for c in clients] == [until] * world
                break
    finally:
        for c in clients:
            c.close()
        for p in started:
            p.stop()
    return resume_step, steps


def test_checkpoint_on_4_resume_on_2_then_on_3_equals_an_uninterrupted_run(pods, table_uri, tmp_path):
    job = manifest(table_uri, str(tmp_path / "ckpt"))
    reference = reference_global_steps(table_uri, {})
    r0, a = run_world(pods, job, 4, "w4", until=5, resume="none")
    r1, b = run_world(pods, job, 2, "w2", until=12, epoch=1)
    r2, c = run_world(pods, job, 3, "w3", until=None, epoch=2)
    assert (r0, r1, r2) == (0, 5, 12)
    delivered = {**a, **b, **c}
    assert sorted(delivered) == list(range(len(reference)))
    assert [delivered[k] for k in range(len(reference))] == reference
    assert len(a) + len(b) + len(c) == len(reference)  # none repeated


def test_a_re_created_job_starts_at_0_and_resumes_the_old_one_only_when_it_names_it(pods, table_uri, tmp_path):
    """Same name, new metadata.uid: its own checkpoints (none); spec.checkpoint.resumeFrom: the old job's."""
    job = manifest(table_uri, str(tmp_path / "ckpt"))
    run_world(pods, job, 2, "old", until=5, resume="none", uid="uid-old")
    fresh, _ = run_world(pods, job, 2, "new", until=1, uid="uid-new")
    assert fresh == 0
    named = manifest(table_uri, str(tmp_path / "ckpt"))
    named["spec"]["checkpoint"]["resumeFrom"] = {"uid": "uid-old"}
    resumed, steps = run_world(pods, named, 3, "named", until=None, uid="uid-named")
    assert resumed == 5
    reference = reference_global_steps(table_uri, {})
    assert [steps[k] for k in range(5, len(reference))] == reference[5:]


def corrupt(path: Path) -> None:
    path.write_text('{"version": 1, "state": ')


def wrong_hash(path: Path) -> None:
    record = json.loads(path.read_text())
    record["state"]["samples_consumed_per_split"][0] += 1
    path.write_text(json.dumps(record))


@pytest.mark.parametrize("damage", [
    pytest.param(corrupt, id="truncated"),
    pytest.param(wrong_hash, id="tampered"),
    pytest.param(Path.unlink, id="rank-missing"),
])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_complete_one(
        pods, table_uri, tmp_path, damage, caplog):
    job = manifest(table_uri, str(tmp_path / "ckpt"))
    run_world(pods, job, 2, "first", until=3, resume="none")
    run_world(pods, job, 2, "second", until=7, epoch=1)
    newest = Path(checkpoints.Store(str(tmp_path / "ckpt"), "test", "job", uid=JOB_UID)
                  .record_path(7, 1, 2, world_epoch=1))
    damage(newest)
    resume_step, steps = run_world(pods, job, 2, "third", until=None, epoch=2)
    assert resume_step == 3
    reference = reference_global_steps(table_uri, {})
    assert [steps[k] for k in range(3, len(reference))] == reference[3:]
    assert any("step 7" in r.getMessage() or "unusable" in r.getMessage() for r in caplog.records)


def test_a_drain_request_is_cut_at_an_unpublished_step_and_ends_iteration_after_the_commit(
        pods, table_uri, tmp_path):
    pod = pods("pod", manifest(table_uri, str(tmp_path / "ckpt")), replicas=1, replica=0).start_thread()
    with StreamClient(pod.socket_dir, 0) as client:
        it = iter(client)
        taken = [next(it).global_step for _ in range(3)]
        assert not client.checkpoint_requested
        pod.request("splitfeed.io/drain", "rescale-w0")
        control = client._control
        wait_for(lambda: control.checkpoint_at >= 0, what="the agreed drain step", interval=0.05)
        agreed = control.checkpoint_at
        # Batch agreed - 1 was published nowhere when the step was fixed, and at most
        # prefetchBatches (2) batches were waiting beyond the 3 taken.
        assert taken[-1] + 2 <= agreed <= taken[-1] + 2 + 2
        while not client.checkpoint_requested:
            taken.append(next(it).global_step)
        assert taken[-1] == agreed - 1
        step = client.checkpoint()
        assert step == agreed and client.drained and not client.checkpoint_requested
        client.commit(step)
        with pytest.raises(StopIteration):
            next(it)
    assert pod.wait() == 0
    report = json.loads(pod.termination_log.read_text())
    assert report["drained"] is True and report["agreedStep"] == agreed
    assert report["lastCheckpoint"]["step"] == agreed and report["drainReason"] == "rescale"
    assert report["error"] is None


def test_a_checkpoint_after_the_last_batch_is_still_answered(pods, table_uri, tmp_path):
    """Saving at the end is common: the sidecar must not be gone by then (found end to end)."""
    import time

    pod = pods("pod", manifest(table_uri, str(tmp_path / "ckpt")), replicas=1, replica=0).start_thread()
    client = StreamClient(pod.socket_dir, 0, timeout_s=10)
    try:
        steps = sum(1 for _ in client)
        time.sleep(0.5)  # the sidecar's loop has seen the last batch taken
        assert client.checkpoint() == steps
    finally:
        client.close()
    assert pod.wait() == 0


@pytest.mark.parametrize("data,words", [
    pytest.param({"table": "nope"}, "table spec.data.table='nope' does not exist", id="no-table"),
    pytest.param({"filter": "id < 10"}, "has 10 rows after spec.data.filter='id < 10', fewer than "
                 "spec.data.numSplits=24", id="filter-too-strict"),
    pytest.param({"columns": ["id", "nope"]}, "spec.data.columns names ['nope']", id="no-column"),
])
def test_bad_data_config_fails_the_trainer_with_a_clear_error(pods, table_uri, data, words):
    pod = pods("pod", manifest(table_uri, **data), replicas=1, replica=0).start_thread()
    with pytest.raises(SidecarFailed, match=words.replace("[", r"\[").replace("]", r"\]")):
        StreamClient(pod.socket_dir, 0, timeout_s=30)
    assert pod.wait() == 2
    report = json.loads(pod.termination_log.read_text())
    assert words in report["error"]
    assert report["permanent"] is True  # the operator fails the job instead of restarting it


@pytest.mark.parametrize("lazy", [pytest.param(False, id="at-start"), pytest.param(True, id="mid-stream")])
def test_a_reader_failure_reaches_the_trainer_and_stops_the_sidecar(socket_root, lazy):
    import threading

    import numpy as np
    import pyarrow as pa

    from splitfeed.sidecar.serving import service
    from splitfeed.trainer_client import UserError

    def factory(rank, first):
        if not lazy:
            raise UserError("bucket 'nope' does not exist")

        def batches():
            yield first, pa.record_batch({"id": pa.array(np.arange(4))})
            raise UserError("bucket 'nope' does not exist")

        return batches()

    box = {}

    def serve():
        server = service.Server(directory=socket_root, ranks=[0], world_size=1, factory=factory,
                                steps_per_epoch=10, total_steps=10, start_step=0, resume_step=0, prefetch=2)
        box["server"] = server
        try:
            server.run()
        finally:
            server.close()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with pytest.raises(SidecarFailed, match="bucket 'nope' does not exist"):
            with StreamClient(socket_root, 0, timeout_s=30) as client:
                for _ in client:
                    pass
        thread.join(30)
        assert not thread.is_alive()
        assert box["server"].feeds[0].session.failure == "bucket 'nope' does not exist"
    finally:
        if thread.is_alive():
            box["server"].stopping.set()
            thread.join(10)


def test_a_sidecar_that_cannot_start_for_an_unexpected_reason_still_reports_why(pods, table_uri, tmp_path):
    """Not bad input: a broken host (here the socket directory lies under a plain file)."""
    pod = pods("pod", manifest(table_uri), replicas=1, replica=0)
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    pod.env["SPLITFEED_SOCKET_DIR"] = str(blocker / "sock")
    pod.start_process()
    assert pod.wait(120) == 2
    report = json.loads(pod.termination_log.read_text())
    assert report["error"].startswith("the sidecar cannot start: ")
    assert "not-a-directory" in report["error"] and report["permanent"] is False
