"""What a rescale costs: from the request to the new world's first batch, in place and not.

    python -m tests.bench.rescale [--repeats N]

`splitfeed local` runs a job of real DDP (gloo) trainers (tests/e2e/trainer.py) on 4
replicas; once they trained a few steps the bench asks for 2 replicas (the run's
`replicas` file, as a user would), then for 3. For each way a world can change
(`recreate`: new processes for every replica; `agent`: in place, the README's script
started again by `splitfeed run`; `in-process`: in place, the script follows with
`client.rejoin()`), it times each change from the request to the moment every rank of
the new world trained its first batch, from the trainers' own logs.

Beside them, in the same run: the restart floor, a bare `python -c "import torch;
init_process_group('gloo')"` (what any restart of a trainer process costs at least), and
one step of the job (the median gap between two batches). Goals (issue #22): with the
agent <= floor + 1 s + one step; in-process <= 1 s + one step; a scale-up no slower than
the scale-down of the same job; 0 steps redone. Printed as met or missed, worst and best
of the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from tests.support import manifests, tables

TRAINER = Path(__file__).parents[1] / "e2e" / "trainer.py"
ROWS = 24_000
SLEEP_S = 0.05
STEPS_BEFORE = 200
"""Steps a world trains before the next request: past the agent's spare interpreter's start
(at the script's first hello, trainer_client.agent.SPARE_AFTER_S) and its imports (2-3 s here,
beside the world that trains). At 100 steps (6 s) a request fell inside those imports, and on this one machine the
new replica's start then shared 2 CPUs with them (on a cluster they are on other nodes)."""
MODES = ("recreate", "agent", "in-process")


def floor_s(port: int) -> float:
    """A trainer process's bare restart: start Python, import torch, make a gloo group."""
    return _python_s("import torch, torch.distributed as d; "
                     f"d.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=0, world_size=1); "
                     "d.destroy_process_group()")


def ddp_start_s(port: int) -> float:
    """What a new replica's trainer costs at least before it can join (beside the floor): the
    floor, plus torch._dynamo (DistributedDataParallel's constructor imports it) and the
    wrapper. A scale-up's time from the request includes it: the new pod starts first."""
    return _python_s("import torch, torch._dynamo, torch.distributed as d; "
                     f"d.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=0, world_size=1); "
                     "torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2)); d.destroy_process_group()")


def _python_s(code: str) -> float:
    """Seconds a fresh `python -c CODE` takes, start to exit."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.monotonic() - started


def _events(logs: Path) -> list[dict[str, Any]]:
    """Every event of every rank's log, with the world its file names."""
    out = []
    for path in logs.glob("w*-r*.jsonl"):
        world = int(re.findall(r"\d+", path.name)[0])
        for line in path.read_text().splitlines():
            try:
                out.append({**json.loads(line), "world": world})
            except ValueError:
                pass  # a line being written
    return out


def _world_batches(logs: Path) -> dict[int, dict[int, list[dict[str, Any]]]]:
    """world -> rank -> its batch events, in order."""
    worlds: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for path in logs.glob("w*-r*.jsonl"):
        world, rank = (int(v) for v in re.findall(r"\d+", path.name)[:2])
        rows = []
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "batch":
                rows.append(event)
        worlds.setdefault(world, {})[rank] = rows
    return worlds


class NotMeasured(RuntimeError):
    """The run could not happen as planned (a world ended before its change was asked or
    served, as on a loaded machine where a new process outlasts the steps left): no figure."""


def one_run(mode: str, uri: str, work: Path, attempt: int = 0, epochs: int = 1) -> dict[str, Any]:
    """One job: 4 replicas, then 2, then 3. The two changes' times and the step time."""
    logs, store = work / f"{mode}-{attempt}-{epochs}-logs", work / f"{mode}-{attempt}-{epochs}-ckpt"
    job = manifests.data_manifest(uri, str(store), epochs=epochs)
    path = work / f"{mode}-{attempt}-{epochs}.yaml"
    path.write_text(yaml.safe_dump(job))
    args = ["--rescale", "recreate" if mode == "recreate" else "inPlace"]
    extra = ["--in-place"] if mode == "in-process" else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitfeed.trainer_client.cli", "local", "-f", str(path), "--replicas", "4",
         "--resume", "none", *args, "--", sys.executable, str(TRAINER), str(logs), "--sleep-s", str(SLEEP_S),
         *extra],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True)
    assert proc.stderr is not None
    control = None
    for line in proc.stderr:
        found = re.search(r"echo N > (\S+)", line)
        if found:
            control = Path(found.group(1))
            break
    assert control is not None, "no control file announced"
    output: list[str] = []
    import threading

    reader = threading.Thread(target=lambda: output.extend(proc.stderr or []), daemon=True)
    reader.start()
    requests: list[float] = []
    try:
        for world, replicas in ((0, 2), (1, 3)):
            deadline = time.monotonic() + 300
            while True:
                batches = _world_batches(logs).get(world, {})
                if batches and min((len(b) for b in batches.values()), default=0) >= STEPS_BEFORE:
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise NotMeasured(f"{mode}: world {world} never trained {STEPS_BEFORE} steps:\n"
                                       + "".join(output[-20:]))
                time.sleep(0.05)
            requests.append(time.time())
            control.write_text(f"{replicas}\n")
        deadline = time.monotonic() + 300
        while min((len(b) for b in _world_batches(logs).get(2, {0: []}).values()), default=0) < 3:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise NotMeasured(f"{mode}: the third world never trained:\n" + "".join(output[-20:]))
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
        reader.join(5)
        (work / f"{mode}-{attempt}-launcher.log").write_text("".join(output))  # kept for a look at a slow change
    worlds = _world_batches(logs)
    drained = {}  # world -> when its last rank checkpointed the drain step
    for event in _events(logs):
        if event.get("event") == "checkpoint" and event.get("drained"):
            world = int(event.get("world", -1))
            drained[world] = max(drained.get(world, 0.0), event["t"])
    def began(event: dict[str, Any]) -> float:  # when a rank's script (or its rejoin) began
        return float(event["t"] - sum(event["startup"].values()))

    starts = {}  # world -> the start event of the rank that began last (the others wait for it)
    for event in _events(logs):
        if event.get("event") == "start" and began(event) > began(starts.get(event["world"], {"t": 0, "startup": {}})):
            starts[event["world"]] = event
    changes = []
    for (world, sizes), asked in zip(((1, "4 -> 2"), (2, "2 -> 3")), requests):
        firsts = [rows[0]["t"] for rows in worlds[world].values() if rows]
        at_drain = drained.get(world - 1, asked)
        start = starts.get(world, {"t": at_drain, "startup": {}})
        changes.append({"change": sizes, "seconds": max(firsts) - asked, "after_drain_s": max(firsts) - at_drain,
                        # where the time after the drain goes, for the rank that began last
                        "phases": {"to_script": began(start) - at_drain, **start["startup"],
                                   "to_batch": max(firsts) - start["t"]}})
    gaps = [b["t"] - a["t"] for rows in worlds[0].values() for a, b in zip(rows, rows[1:])]
    redone = []  # batches a world trained at or past the step its successor started at
    for world in (0, 1):
        start = min(rows[0]["step"] for rows in worlds[world + 1].values() if rows)
        redone.append(sum(1 for rows in worlds[world].values() for b in rows if b["step"] >= start))
    return {"changes": changes, "step_s": statistics.median(gaps), "redone": redone,
            "load_average": round(os.getloadavg()[0], 2)}


RETRY_EPOCHS = (1, 3)
"""A run that could not happen as planned is tried again with this many epochs: more room."""


def measured_run(mode: str, uri: str, work: Path, attempt: int) -> dict[str, Any]:
    """`one_run`, again with more epochs if it could not happen as planned; else a record of why."""
    reason = ""
    for epochs in RETRY_EPOCHS:
        try:
            return one_run(mode, uri, work, attempt, epochs)
        except NotMeasured as exc:
            reason = str(exc).splitlines()[0]
            print(f"  {mode}: not as planned with {epochs} epoch(s) ({reason}); load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    return {"not_measured": reason, "load_average": round(os.getloadavg()[0], 2)}


def bench(repeats: int, modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="splitfeed-bench-rescale-"))
    uri = str(work / "db")
    tables.write_training_table(uri, rows=ROWS)
    out: dict[str, Any] = {"floor_s": [], "ddp_start_s": [], "runs": {m: [] for m in modes}}
    for attempt in range(repeats):
        for mode in modes:  # interleaved: each mode sees the same load
            out["floor_s"].append(floor_s(29_700))
            out["ddp_start_s"].append(ddp_start_s(29_701))
            run = measured_run(mode, uri, work, attempt)
            out["runs"][mode].append(run)
            if "not_measured" in run:
                continue
            print(f"  {mode:10s} " + ", ".join(f"{c['change']}: {c['seconds']:.2f} s "
                                               f"({c['after_drain_s']:.2f} s after the drain)"
                                               for c in run["changes"])
                  + "\n    after the drain: " + "; ".join(
                      c["change"] + " " + ", ".join(f"{k} {v:.2f}" for k, v in c["phases"].items())
                      for c in run["changes"])
                  + f"  (one step {run['step_s'] * 1000:.0f} ms, steps redone {run['redone']}, "
                  f"floor {out['floor_s'][-1]:.2f} s, load average {run['load_average']})", flush=True)
    return out


def verdicts(result: dict[str, Any]) -> list[str]:
    floor = statistics.median(result["floor_s"])
    lines = []
    for mode, all_runs in result["runs"].items():
        runs = [r for r in all_runs if "not_measured" not in r]
        if not runs:
            lines.append(f"{mode}: not measured ({all_runs[-1]['not_measured']})")
            continue
        step = statistics.median(r["step_s"] for r in runs)
        times = [c["seconds"] for r in runs for c in r["changes"]]
        downs = [r["changes"][0]["seconds"] for r in runs]
        ups = [r["changes"][1]["seconds"] for r in runs]
        downs_after = [r["changes"][0]["after_drain_s"] for r in runs]
        ups_after = [r["changes"][1]["after_drain_s"] for r in runs]
        goal = {"agent": floor + 1.0 + step, "in-process": 1.0 + step}.get(mode)
        after = [c["after_drain_s"] for r in runs for c in r["changes"]]
        line = (f"{mode}: request to first batch worst {max(times):.2f} s, best {min(times):.2f} s "
                f"(down {min(downs):.2f}..{max(downs):.2f}, up {min(ups):.2f}..{max(ups):.2f}); "
                f"drain to first batch {min(after):.2f}..{max(after):.2f} s")
        if goal is not None:
            line += (f"; goal <= {goal:.2f} s: scale-down {'met' if max(downs) <= goal else 'MISSED'}, "
                     f"scale-up {'met' if max(ups) <= goal else 'MISSED'}")
            # A scale-up's new pod starts (imports, connects) before the old world is asked to
            # drain: from the drain on it must cost no more than a scale-down.
            line += (f"; scale-up no slower than scale-down after the drain: "
                     f"{'met' if max(ups_after) <= max(downs_after) + step else 'MISSED'}")
        redone = [n for r in runs for n in r["redone"]]
        line += f"; steps redone {sorted(set(redone))}"
        if len(runs) < len(all_runs):
            line += f" ({len(all_runs) - len(runs)} of {len(all_runs)} runs not measured)"
        lines.append(line)
    lines.append(f"restart floor (python + import torch + gloo group): median {floor:.2f} s")
    lines.append(f"a new DDP trainer's own start (the floor + torch._dynamo + the DDP wrapper), which a "
                 f"scale-up from the request includes: median {statistics.median(result['ddp_start_s']):.2f} s")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    result = bench(args.repeats, tuple(args.modes))
    for line in verdicts(result):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
