"""python -m tests.soak --seed S --events N [--seeds K] [--mode recreate|inPlace] [--json OUT]

Runs seeds S .. S + K - 1, each a fresh `splitfeed local` job driven through N random events
(tests/soak/schedule.py), then checks the invariants (tests/soak/invariants.py). A failing
seed is printed with its schedule and the command that replays it; the exit code is 1 then.
Last, the recovery time of each event kind over every seed (p50, p99).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from splitfeed.sidecar.forks import forking
from splitfeed.trainer_client.contract import topology
from tests.soak import invariants, probe, schedule as sched
from tests.soak.runner import SLEEP_S, Soak, Violation

MAX_REPLICAS = 3
"""Replica counts up to this many (a trainer and a sidecar each): what 2 shared cores carry."""


def allowed(max_replicas: int) -> list[int]:
    """The test job's valid replica counts (tests/support/manifests.data_manifest) up to `max_replicas`."""
    counts = topology.allowed_replicas(gpus_per_replica=1, num_splits=24, num_workers=1, global_batch_size=48)
    return [c for c in counts if c <= max_replicas]


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (q in 0..100) of `values`."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def recovery_table(outcomes: Sequence[tuple[str, float]]) -> dict[str, dict[str, float]]:
    """Per event kind: how many, p50 and p99 of the seconds to settle."""
    kinds: dict[str, list[float]] = {}
    for kind, seconds in outcomes:
        kinds.setdefault(kind, []).append(seconds)
    return {k: {"n": len(v), "p50_s": round(percentile(v, 50), 1), "p99_s": round(percentile(v, 99), 1)}
            for k, v in sorted(kinds.items())}


def replay(seed: int, events: int, args: argparse.Namespace) -> str:
    extra = (f" --mode {args.mode}" if args.mode else "") + (
        f" --max-replicas {args.max_replicas}" if args.max_replicas != MAX_REPLICAS else "") + (
        f" --epochs {args.epochs}" if args.epochs else "") + (
        f" --sleep-s {args.sleep_s:g}" if args.sleep_s != SLEEP_S else "")
    return f"python -m tests.soak --seed {seed} --events {events}{extra}"


def run_seed(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One seed, start to invariants; what it found (violations empty: it passed)."""
    plan = sched.generate(seed, args.events, allowed(args.max_replicas), args.mode)
    print(plan.describe(), flush=True)
    root = Path(tempfile.mkdtemp(prefix=f"sf-soak-{seed}-"))
    soak = Soak(plan, root, args.epochs, args.sleep_s)
    began, violations, summary = time.monotonic(), [], ""
    try:
        soak.run()
    except Violation as exc:
        violations.append(str(exc))
    except Exception:  # the soak's own failure: still a failing seed, with its trace
        violations.append(traceback.format_exc())
    finally:
        soak.stop()
    violations += invariants.leftovers(soak.shm, soak.ports) + invariants.unanswered(soak.forged)
    if not violations:
        try:
            summary = str(invariants.exact(soak.logs, soak.store, soak.uri, soak.overrides))
        except AssertionError as exc:
            violations.append(f"not exact against lancedb: {exc}")
    result = {"seed": seed, "mode": plan.mode, "events": len(plan.events), "wall_s": round(time.monotonic() - began, 1),
              "violations": violations, "exactness": summary,
              "outcomes": [(o.kind, round(o.recovery_s, 2)) for o in soak.outcomes],
              "forged": soak.forged}
    if violations:
        print(f"soak: FAILED seed {seed}; replay: {replay(seed, args.events, args)}\n{plan.describe()}\n"
              + "\n".join(f"  violation: {v}" for v in violations) + f"\n  files kept in {root}", flush=True)
    else:
        print(f"soak: seed {seed} passed in {result['wall_s']} s: {summary}", flush=True)
        shutil.rmtree(root, ignore_errors=True)
    return result


def _interrupted(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--events", type=int, default=25)
    parser.add_argument("--seeds", type=int, default=1, help="run seeds SEED .. SEED + K - 1")
    parser.add_argument("--mode", choices=[sched.RECREATE, sched.IN_PLACE], help="default: the seed picks")
    parser.add_argument("--max-replicas", type=int, default=MAX_REPLICAS)
    parser.add_argument("--epochs", type=int, help="the job's epochs (default: enough for the events)")
    parser.add_argument("--sleep-s", type=float, default=SLEEP_S, help="the trainers' pause after each step")
    parser.add_argument("--budget-s", type=float, default=0.0, help="start no seed after this many seconds")
    parser.add_argument("--json", type=Path, help="write every seed's result here")
    args = parser.parse_args(argv)
    probe.become_subreaper()
    signal.signal(signal.SIGTERM, _interrupted)  # stopped from outside: the runs stop first (finally)
    # The soak writes to the table (lancedb) and then starts processes; they exec at once.
    warnings.filterwarnings("ignore", message=forking.FORK_WARNING, category=RuntimeWarning)
    results: list[dict[str, Any]] = []
    started = time.monotonic()
    for seed in range(args.seed, args.seed + args.seeds):
        if args.budget_s and results and time.monotonic() - started > args.budget_s:
            break
        results.append(run_seed(seed, args))
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    table = recovery_table([tuple(o) for r in results for o in r["outcomes"]])  # type: ignore[misc]
    failed = [r["seed"] for r in results if r["violations"]]
    events = sum(len(r["outcomes"]) - 1 for r in results)
    print(f"soak: {len(results)} seeds, {events} events, {len(failed)} failing seeds {failed}; "
          f"recovery (s) per event kind: {json.dumps(table)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
