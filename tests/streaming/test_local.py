"""`splitfeed local`: the ranks of a StreamingJob as processes, as pods would run them."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.streaming.harness import manifest, reference_batches
from tests.support import guards
from tests.support.tables import check_exact
from tests.support.waiting import running, wait_for

SCRIPT = Path(__file__).with_name("trainer_script.py")


def splitfeed(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splitfeed.trainer_client.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def job_file(tmp_path: Path, job: dict) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def test_local_runs_every_rank_with_the_pod_environment(table_uri, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    job = manifest(table_uri)
    # The trainer command comes from the template, as in a pod.
    job["spec"]["trainer"] = {"template": {"spec": {"containers": [{
        "name": "trainer", "command": [sys.executable, "-c",
            "import os, runpy, sys; sys.argv=['t', os.path.join(sys.argv[1], 'rank' + os.environ['RANK'] + '.jsonl')];"
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')", str(logs)]}]}}}
    done = splitfeed("local", "-f", job_file(tmp_path, job), "--replicas", "2", "--quiet")
    assert done.returncode == 0, done.stderr
    assert "global steps" in done.stderr and "rows/s" in done.stderr and "data stall" in done.stderr
    # docs/observability.md: the summary gives the data-ready percentiles of all ranks.
    assert re.search(r"data-ready latency p50 [0-9.]+ ms, p95 [0-9.]+ ms, p99 [0-9.]+ ms", done.stderr), done.stderr
    for rank in range(2):
        got = [json.loads(line)["ids"] for line in (logs / f"rank{rank}.jsonl").read_text().splitlines()]
        assert got == reference_batches(table_uri, {}, 2, rank)


@pytest.mark.parametrize("close", [True, False], ids=["close", "no-close"])
def test_trainers_that_return_early_end_the_run_cleanly(table_uri, tmp_path, close):
    """A max_steps loop: every trainer returns after 3 steps, with or without close()."""
    args = ["--stop-after", "3"] + ([] if close else ["--no-close"])
    started = time.monotonic()
    done = splitfeed("local", "-f", job_file(tmp_path, manifest(table_uri)), "--replicas", "2", "--quiet",
                     "--", sys.executable, str(SCRIPT), str(tmp_path / "ids.jsonl"), *args, timeout=120)
    assert done.returncode == 0, done.stderr
    found = re.search(r"trainers stopped at global step 3 of (\d+)", done.stderr)
    assert found and int(found.group(1)) > 3, done.stderr
    assert time.monotonic() - started < 60


def test_a_rank_that_returns_while_its_peers_wait_fails_the_run_naming_them(table_uri, tmp_path):
    job = manifest(table_uri)
    job["spec"]["checkpoint"] = {"uri": str(tmp_path / "ckpt"), "timeoutSeconds": 3}
    done = splitfeed("local", "-f", job_file(tmp_path, job), "--replicas", "2", "--quiet",
                     "--", sys.executable, str(SCRIPT), str(tmp_path / "ids.jsonl"), "--stop-after", "3",
                     "--stop-rank", "1", timeout=120)
    assert done.returncode == 1, done.stderr
    assert "w0-trainer-1 returned but w0-trainer-0 still ran 3 s later" in done.stderr, done.stderr


def test_a_failed_rank_stops_the_run_with_its_error(table_uri, tmp_path):
    done = splitfeed("local", "-f", job_file(tmp_path, manifest(table_uri)), "--replicas", "2", "--quiet",
                     "--", sys.executable, str(SCRIPT), str(tmp_path / "ids.jsonl"), "--fail-at", "3")
    assert done.returncode == 1
    assert "trainer failed on purpose at step 3" in done.stderr


@pytest.mark.parametrize("change,args,words", [
    pytest.param({}, ["--replicas", "5"], "Valid replica counts for this job: [1, 2, 3, 4, 6, 8, 12, 24]",
                 id="invalid-replicas"),
    pytest.param({"numSplit": 24}, [], "spec.data.numSplit: unknown field; did you mean 'numSplits'?",
                 id="unknown-field"),
    pytest.param({"globalBatchSize": 50}, [], "globalBatchSize=50 is not divisible by numSplits=24",
                 id="indivisible-batch"),
])
def test_bad_manifests_are_rejected_before_anything_starts(table_uri, tmp_path, change, args, words):
    job = manifest(table_uri)
    job["spec"]["data"].update(change)
    done = splitfeed("local", "-f", job_file(tmp_path, job), *args, "--", "true")
    assert done.returncode == 2
    assert words in done.stderr


def test_a_missing_table_fails_the_run_with_the_sidecars_reason(table_uri, tmp_path):
    job = manifest(table_uri, table="nope")
    done = splitfeed("local", "-f", job_file(tmp_path, job), "--quiet",
                     "--", sys.executable, str(SCRIPT), str(tmp_path / "ids.jsonl"))
    assert done.returncode == 1
    assert "table spec.data.table='nope' does not exist" in done.stderr


def descendants(pid: int) -> list[str]:
    """Every process below `pid`: sidecars are children of `splitfeed local`'s fork server."""
    found: list[str] = []
    todo = [str(pid)]
    while todo:
        out = subprocess.run(["pgrep", "-P", todo.pop()], capture_output=True, text=True).stdout.split()
        found += out
        todo += out
    return found


def sigint(disposition: signal.Handlers):
    """A Popen preexec_fn: the launcher starts with SIGINT as a shell leaves it, whatever this test
    process has (a suite started in the background inherits SIGINT ignored): SIG_DFL from a
    terminal, SIG_IGN for a command a shell ran in the background (`&`, nohup)."""
    return lambda: signal.signal(signal.SIGINT, disposition)


def test_ctrl_c_stops_every_process(table_uri, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitfeed.trainer_client.cli", "local", "-f",
         job_file(tmp_path, manifest(table_uri)), "--replicas", "2", "--quiet",
         "--", sys.executable, str(SCRIPT), str(tmp_path / "ids.jsonl"), "--pause-after", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=sigint(signal.SIG_DFL))  # Ctrl-C at a terminal
    try:
        ids = tmp_path / "ids.jsonl"
        wait_for(lambda: running(proc) and ids.exists() and len(ids.read_text().splitlines()) >= 4, 120,
                 "4 batches taken")
        children = descendants(proc.pid)
        assert len(children) == 5, children  # 2 trainers; the sidecar fork server and its 2 sidecars
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "interrupted" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


@pytest.mark.parametrize("started", ["at-a-terminal", "in-the-background"])
def test_a_killed_launcher_takes_its_processes_with_it(table_uri, tmp_path, started):
    # A SIGKILLed launcher cannot remove its work directory either: give it a directory of
    # its own (short: it holds ipc sockets), removed here, not the session's shared memory.
    # In the background its SIGINT is ignored, which its children would inherit through exec.
    shm = tempfile.mkdtemp(prefix="sf-killed-")
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitfeed.trainer_client.cli", "local", "-f",
         job_file(tmp_path, manifest(table_uri)), "--quiet",
         "--", sys.executable, str(SCRIPT), str(tmp_path / "ids.jsonl"), "--pause-after", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "SPLITFEED_SHM_ROOT": shm},
        preexec_fn=sigint(signal.SIG_DFL if started == "at-a-terminal" else signal.SIG_IGN))
    try:
        wait_for(lambda: running(proc) and (tmp_path / "ids.jsonl").exists(), 120, "a batch taken")
        children = descendants(proc.pid)
        assert len(children) == 3, children  # the trainer; the sidecar fork server and its sidecar
        proc.kill()  # SIGKILL: the launcher cannot clean up
        proc.wait()
        wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), 30,
                 "the children to die with their launcher")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(shm, ignore_errors=True)


def test_plan_shows_valid_counts_splits_per_rank_and_steps_per_epoch(table_uri, tmp_path):
    done = splitfeed("plan", "-f", job_file(tmp_path, manifest(table_uri, filter="label >= 2")),
                     "--replicas", "3", "--read-table")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "world size 3" in out
    assert "valid replica counts: [1, 2, 3, 4, 6, 8, 12, 24]" in out
    assert "rank 2: splits 16..23" in out
    assert "16 per rank" in out  # 48 rows per step / 3 ranks
    # 800 rows pass the filter: 33 per split, 2 rows per split per step -> 16 steps
    reference_steps = len(reference_batches(table_uri, {"filter": "label >= 2"}, 3, 0))
    assert f"{reference_steps} steps per epoch" in out
    # 24 splits of 33 rows: a plan of 792 x 8 B; a rank of 8 splits holds 264 ids
    assert "plan: 6.2 KiB per epoch (8 B a row)" in out and "each rank holds 2.1 KiB of row ids" in out
    # per-row shuffle: a request per row per column read (id, label, vec)
    assert "reads: ~2,376 requests" in out and "one request per row per column" in out


def test_plan_prints_what_clumps_save_in_requests(table_uri, tmp_path):
    done = splitfeed("plan", "-f", job_file(tmp_path, manifest(table_uri, shuffleClumpSize=8,
                                                               columns=["id"])), "--read-table")
    assert done.returncode == 0, done.stderr
    # 24 splits of 41 rows = 984 rows, clumps of 8: 123 requests of the one column
    assert "reads: ~123 requests and ~7.7 KiB per epoch (shuffleClumpSize 8" in done.stdout, done.stdout


def test_plan_warns_of_a_field_that_changes_nothing_and_still_plans(table_uri, tmp_path):
    done = splitfeed("plan", "-f", job_file(tmp_path, manifest(table_uri, transformParallelism=4)))
    assert done.returncode == 0, done.stderr
    assert "warning:" in done.stderr and "spec.data.transformParallelism does nothing" in done.stderr
    assert "valid replica counts" in done.stdout


def test_plan_rejects_an_invalid_replica_count_with_the_valid_ones(table_uri, tmp_path):
    done = splitfeed("plan", "-f", job_file(tmp_path, manifest(table_uri)), "--replicas", "7")
    assert done.returncode == 2
    assert "Valid replica counts for this job: [1, 2, 3, 4, 6, 8, 12, 24]" in done.stderr


E2E_TRAINER = Path(__file__).parents[1] / "e2e" / "trainer.py"


def exact_2_4_3(logs: Path, store: Path, table_uri: str):  # type: ignore[no-untyped-def]
    """The trainers' logs against lancedb's reference: worlds of 2, 4 and 3 ranks, cut at 8 and 14."""
    summary = check_exact(logs, store / "test" / "job", table_uri)
    assert [w.size for w in summary.worlds] == [2, 4, 3], summary
    assert [w.resume_step for w in summary.worlds[1:]] == [8, 14], summary
    return summary


def test_a_live_rescale_2_to_4_to_3_with_ddp_trainers_is_exact_and_redoes_no_step(table_uri, tmp_path):
    """`--scale-at` drains each world exactly at the step it names and starts the next one there.

    The trainers are real DDP trainers (gloo, a backward pass every step) that follow
    the README's loop; output goes to a pipe, so progress comes as plain lines.
    """
    from tests.support import exactness

    logs = tmp_path / "logs"
    store = tmp_path / "ckpt"
    job = manifest(table_uri, str(store))
    done = splitfeed("local", "-f", job_file(tmp_path, job), "--replicas", "2", "--resume", "none",
                     "--scale-at", "8:4", "--scale-at", "14:3",
                     "--", sys.executable, str(E2E_TRAINER), str(logs), "--sleep-s", "0.25", timeout=400)
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert "\r" not in err  # no bar when the output is not a terminal
    assert "splitfeed local: world 0 (2 ranks): global step" in err
    assert "rescale 2 -> 4 replicas at global step" in err and "rescale 4 -> 3 replicas" in err
    assert err.count("; 0 steps redone") == 2, err
    # Asked ahead, each world drained at the step --scale-at named (the trainers were still
    # importing or several steps short of it when the coordinator got the request).
    summary = exact_2_4_3(logs, store, table_uri)
    assert "world 0 drained at global step 8;" in err and "world 1 drained at global step 14;" in err
    assert [w.ended for w in summary.worlds] == [exactness.DRAINED, exactness.DRAINED, exactness.END], summary
    assert summary.replayed == 0, summary


@pytest.mark.parametrize("how", ["agent", "in-process"])
def test_an_in_place_rescale_2_to_4_to_3_keeps_the_processes_that_stay_and_is_exact(table_uri, tmp_path, how):
    """`--rescale inPlace`: the sidecars and trainer containers of the replicas that stay keep
    running; real DDP trainers follow each world either restarted by `splitfeed run` (the
    README's loop unchanged) or in their own process (`client.rejoin()`)."""
    from tests.support import exactness

    logs = tmp_path / "logs"
    store = tmp_path / "ckpt"
    job = manifest(table_uri, str(store))
    extra = ["--in-place"] if how == "in-process" else []
    done = splitfeed("local", "-f", job_file(tmp_path, job), "--replicas", "2", "--resume", "none",
                     "--rescale", "inPlace", "--scale-at", "8:4", "--scale-at", "14:3",
                     "--", sys.executable, str(E2E_TRAINER), str(logs), "--sleep-s", "0.25", *extra,
                     timeout=400)
    assert done.returncode == 0, done.stderr
    err = done.stderr
    # Each change is timed, from the drain on too: its first batch was seen before the next began.
    assert re.search(r"rescale 2 -> 4 replicas in place at global step 8: .* first batch after "
                     r"[0-9.]+ s \([0-9.-]+ s after the drain\)", err), err
    assert re.search(r"rescale 4 -> 3 replicas in place at global step 14: .* first batch after [0-9.]+ s", err), err
    assert err.count("; 0 steps redone") == 2, err
    summary = exact_2_4_3(logs, store, table_uri)
    assert summary.replayed == 0, summary
    starts = {}
    for path in sorted(logs.glob("w*-r*.jsonl")):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "start":
                starts[(event["world"], event["rank"])] = event["pid"]
    # The sidecars of ranks 0 and 1 served all three worlds in one process each: their
    # trainer containers (the agent, or the trainer itself) were never started again.
    if how == "in-process":
        assert starts[(0, 0)] == starts[(1, 0)] == starts[(2, 0)], starts
        assert starts[(1, 3)] != starts[(0, 1)] and starts[(1, 2)] == starts[(2, 2)], starts
    else:
        assert len({starts[(w, 0)] for w in range(3)}) == 3, starts  # the agent started it again
    assert "world 0 drained at global step 8; world 1 goes on there in place" in err, err


def test_the_demo_check_fails_on_a_single_wrong_batch(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo", Path(__file__).parents[2] / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    one = {s: [s * 10 + i for i in range(4)] for s in range(8)}
    assert demo.compare(one, {s: list(v) for s, v in one.items()}, [3, 6]) == 0
    wrong = {s: list(v) for s, v in one.items()}
    wrong[5][0] += 1  # one row of one global step
    assert demo.compare(one, wrong, [3, 6]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT" in out and "7/8 global steps identical" in out


def test_sigterm_to_one_trainer_drains_the_world_at_one_step_and_the_next_run_resumes_there(
        table_uri, tmp_path):
    """Preemption: the pod's trainer gets SIGTERM; every rank checkpoints at one agreed step."""
    from tests.support import exactness

    store = tmp_path / "ckpt"
    path = job_file(tmp_path, manifest(table_uri, str(store)))
    first, second = tmp_path / "first", tmp_path / "second"
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitfeed.trainer_client.cli", "local", "-f", path, "--replicas", "2",
         "--resume", "none", "--quiet", "--", sys.executable, str(E2E_TRAINER), str(first), "--sleep-s", "0.3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log = first / "w0-r1.jsonl"
        wait_for(lambda: running(proc) and log.exists() and '"step": 3' in log.read_text(), 120,
                 "the trainers to reach step 3", interval=0.1)
        start = json.loads((first / "w0-r1.jsonl").read_text().splitlines()[0])
        os.kill(start["pid"], signal.SIGTERM)  # rank 1's trainer, as the kubelet would
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    (world,) = exactness.read_worlds(first)
    saved = {e["rank"]: e["step"] for e in world.events if e["event"] == "checkpoint"}
    assert len(saved) == 2 and len(set(saved.values())) == 1, world.events
    (step,) = set(saved.values())
    assert 3 < step < 20
    for rank in range(2):
        assert sorted(world.batches[rank]) == list(range(step)), f"rank {rank} went past the agreed step"

    shutil.copytree(first / "models", second / "models")  # the model store the job keeps
    done = splitfeed("local", "-f", path, "--replicas", "3", "--quiet",
                     "--", sys.executable, str(E2E_TRAINER), str(second), timeout=300)
    assert done.returncode == 0, done.stderr
    (resumed,) = exactness.read_worlds(second)
    assert resumed.resume_step == step
    for rank in range(3):
        expected = reference_batches(table_uri, {}, 3, rank)
        assert {s: ids[0] for s, ids in resumed.batches[rank].items()} == {
            s: expected[s] for s in range(step, len(expected))}


def test_a_4m_row_job_delivers_its_first_steps_as_lancedb_orders_them(tmp_path, monkeypatch):
    """lancedb's own builder fails on this table at its 100 MiB default ("Not enough memory
    to continue external sort"): the job's plan is built with the memory the sidecar has."""
    import contextlib
    import itertools

    import lancedb
    import numpy as np
    import pyarrow as pa

    from splitfeed.sidecar.data import reading, streaming
    from splitfeed.sidecar.table import planning
    from splitfeed.trainer_client.contract import specs

    uri, rows = str(tmp_path / "db"), 4_000_000
    schema = pa.schema([("id", pa.int64()), ("label", pa.int32())])
    chunks = (pa.record_batch([pa.array(np.arange(s, s + 1_000_000)), pa.array(np.zeros(1_000_000, np.int32))],
                              schema=schema) for s in range(0, rows, 1_000_000))
    lancedb.connect(uri).create_table("frames", pa.RecordBatchReader.from_batches(schema, chunks))
    job = manifest(uri, numSplits=4, globalBatchSize=400, columns=["id", "label"])
    done = splitfeed("local", "-f", job_file(tmp_path, job), "--replicas", "2", "--quiet", "--",
                     sys.executable, str(SCRIPT), str(tmp_path / "ids.jsonl"), "--stop-after", "3", timeout=300)
    assert done.returncode == 0, done.stderr
    assert "trainers stopped at global step 3 of 10000" in done.stderr, done.stderr
    monkeypatch.setenv(planning.MEMORY_ENV, str(1 << 30))  # the reference's builder needs it too
    data = specs.parse_job(job, check_replicas=False).data
    table = reading.open_table(data)
    expected: dict[int, list[list[int]]] = {0: [], 1: [], 2: []}  # step -> both ranks' batches
    for rank in range(2):
        dataset = streaming.reference_dataset(table, data, epoch=0, rank=rank, world_size=2)
        with contextlib.closing(iter(dataset)) as it:
            ids = [r["id"] for r in itertools.islice(it, 600)]
        for k in range(3):
            expected[k].append(ids[k * 200:(k + 1) * 200])
    got: dict[int, list[list[int]]] = {0: [], 1: [], 2: []}
    for line in (tmp_path / "ids.jsonl").read_text().splitlines():  # both trainers log here
        record = json.loads(line)
        got[record["step"]].append(record["ids"])
    assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in expected.items()}


def test_plan_shows_which_ranks_share_a_batch(table_uri, tmp_path):
    done = splitfeed("plan", "-f", job_file(tmp_path, manifest(table_uri, ranksPerBatch=2)), "--replicas", "6")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "ranksPerBatch 2 (pipelineStages 1): 3 data-parallel ranks, each batch taken by 2 ranks" in out
    assert "valid replica counts: [2, 4, 6, 8, 12, 16, 24, 48]" in out
    assert "8 splits per data-parallel rank" in out and "16 per data-parallel rank" in out
    assert "rank 4: splits 16..23 (data-parallel rank 2)" in out and "rank 5: splits 16..23 (data-parallel rank 2)" in out
    refused = splitfeed("plan", "-f", job_file(tmp_path, manifest(table_uri, ranksPerBatch=2)), "--replicas", "3")
    assert refused.returncode != 0 and "is not divisible by ranksPerBatch=2" in refused.stderr


def test_ctrl_c_during_an_in_place_scale_up_stops_the_new_pods_too(table_uri, tmp_path):
    """Found by tests/soak: the new pod's sidecar waits to join the world and does not end on
    SIGINT; `splitfeed local` sent it one and exited, and the sidecar ran on, orphaned."""
    job = manifest(table_uri, str(tmp_path / "ckpt"))
    work_glob = str(guards.shm_root() / f"splitfeed-{job['metadata']['name']}-*")
    logs = tmp_path / "logs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitfeed.trainer_client.cli", "local", "-f", job_file(tmp_path, job),
         "--replicas", "1", "--resume", "none", "--rescale", "inPlace", "--quiet",
         "--", sys.executable, str(E2E_TRAINER), str(logs), "--sleep-s", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=sigint(signal.SIG_DFL))
    try:
        wait_for(lambda: running(proc) and (logs / "w0-r0.jsonl").exists()
                 and '"batch"' in (logs / "w0-r0.jsonl").read_text(), 120, "a batch trained")
        (work,) = [Path(p) for p in glob.glob(work_glob)]
        (work / "replicas").write_text("2\n")
        wait_for(lambda: running(proc) and (work / "w1-replica-1" / "sidecar.lock").exists(), 60,
                 "the new pod's sidecar")
        children = descendants(proc.pid)
        assert len(children) >= 5, children  # the fork server, two sidecars, two trainer agents
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    alive = lambda: [p for p in children if Path(f"/proc/{p}").exists()  # noqa: E731
                     and "zombie" not in Path(f"/proc/{p}/status").read_text()]
    try:
        wait_for(lambda: not alive(), 20, "every process of the run to end")
    finally:
        for pid in alive():
            os.kill(int(pid), signal.SIGKILL)
