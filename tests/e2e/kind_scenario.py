"""The end-to-end scenario on a real cluster (kind), driven through kubectl. Run by tests/e2e/kind.sh.

    python -m tests.e2e.kind_scenario --context kind-splitfeed-e2e --work DIR --image splitfeed:e2e

DIR is the host directory that kind mounts at /e2e on its node: the table is
DIR/lance/db (/e2e/lance/db in the pods, through a hostPath volume that the
operator also gives the sidecar), checkpoints go to /e2e/ckpt and the trainers
(tests/e2e/trainer.py, from ConfigMap e2e-trainer) log to /e2e/logs. The same
exactness rule as the local-process tier (tests/support/exactness.py) judges the run.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from tests.support import manifests, tables, waiting
from tests.support import exactness

NS, NAME, EPOCHS = "e2e", "scenario", 2
_T0 = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - _T0:6.1f}s] {message}", flush=True)


class Kind:
    def __init__(self, context: str) -> None:
        self.context = context

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        out = subprocess.run(["kubectl", "--context", self.context, *args], input=input, text=True,
                             capture_output=True, timeout=120)
        if check and out.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {out.stderr}")
        return out.stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("-n", NS, "get", *args, "-o", "json"))

    def status(self) -> dict[str, Any]:
        return self.get("sj", NAME).get("status") or {}


def wait_for(check: Any, timeout: float, what: str) -> Any:
    return waiting.wait_for(check, timeout, what, interval=1.0, ignore=(RuntimeError, ValueError, OSError))


def manifest(image: str) -> dict[str, Any]:
    data = manifests.data_manifest("/e2e/lance/db", "/e2e/ckpt", epochs=EPOCHS)["spec"]
    return {"apiVersion": "splitfeed.io/v1alpha1", "kind": "StreamingJob",
            "metadata": {"name": NAME, "namespace": NS},
            "spec": {"replicas": 4, "data": data["data"], "sidecar": data["sidecar"],
                     "checkpoint": {"uri": "/e2e/ckpt", "timeoutSeconds": 120},
                     "trainer": {"template": {"spec": {
                         "containers": [{
                             "name": "trainer", "image": image, "imagePullPolicy": "Never",
                             "command": ["python", "/trainer/trainer.py", "/e2e/logs", "--sleep-s", "0.25"],
                             "volumeMounts": [{"name": "e2e", "mountPath": "/e2e"},
                                              {"name": "trainer", "mountPath": "/trainer", "readOnly": True}],
                             "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
                         }],
                         "volumes": [{"name": "e2e", "hostPath": {"path": "/e2e", "type": "Directory"}},
                                     {"name": "trainer", "configMap": {"name": "e2e-trainer"}}],
                     }}}}}


def steps_of(log_dir: Path, world: int) -> tuple[int | None, int]:
    """(resume step, highest step logged) of a world, from the trainers' logs on the host."""
    resume, top = None, -1
    for path in log_dir.glob(f"w{world}-r*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["event"] == "start":
                resume = rec["resumeStep"]
            elif rec["event"] == "batch":
                top = max(top, rec["step"])
    return resume, top


def scale(k: Kind, log_dir: Path, world: int, steps: int, replicas: int) -> None:
    def trained() -> bool:
        resume, top = steps_of(log_dir, world)
        return resume is not None and top >= resume + steps - 1
    wait_for(trained, 600, f"world {world} to train {steps} steps")
    log(f"world {world} at step {steps_of(log_dir, world)[1]}: kubectl scale --replicas={replicas}")
    k.kubectl("-n", NS, "scale", f"sj/{NAME}", f"--replicas={replicas}")
    wait_for(lambda: (st := k.status()).get("worldEpoch") == world + 1 and st.get("phase") == "Running",
             600, f"world {world + 1} running")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--context", required=True)
    p.add_argument("--work", required=True, type=Path)
    p.add_argument("--image", required=True)
    args = p.parse_args()
    k, log_dir = Kind(args.context), args.work / "logs"
    log("kubectl apply: 4 replicas, numSplits 24, globalBatchSize 48, 2 epochs")
    k.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest(args.image)))
    wait_for(lambda: len([x for x in k.get("pods", "-l", f"splitfeed.io/job={NAME}")["items"]
                          if x["status"].get("phase") == "Running"]) == 4, 600, "4 pods running")
    log("4 pods running")
    scale(k, log_dir, 0, 6, 2)
    scale(k, log_dir, 1, 5, 3)
    wait_for(lambda: k.status().get("phase") == "Succeeded", 900, "the job to succeed")
    log("Succeeded")

    uri = str(args.work / "lance" / "db")
    rank_batches = functools.lru_cache(maxsize=None)(
        lambda w, r: tables.reference_batches(uri, {"epochs": EPOCHS}, w, r))
    summary = exactness.check(log_dir, exactness.complete_checkpoints(args.work / "ckpt" / NS / NAME),
                              tables.reference_global_steps(uri, {"epochs": EPOCHS}), rank_batches)
    log(f"exact: {summary}")
    assert [w.size for w in summary.worlds] == [4, 2, 3], summary
    assert [w.ended for w in summary.worlds] == ["drained", "drained", "end"], summary
    assert summary.replayed == 0, summary
    events = [e["reason"] for e in k.get("events", "--field-selector", f"involvedObject.name={NAME}")["items"]]
    for reason in ("CheckpointRequested", "Drained", "RescaleComplete"):
        assert events.count(reason) >= 2, (reason, events)
    table = k.kubectl("-n", NS, "get", "sj", NAME)
    log("kubectl get sj\n" + table)
    assert table.splitlines()[0].split() == ["NAME", "REPLICAS", "WORLD", "PHASE", "EPOCH", "STEP", "AGE"]

    k.kubectl("-n", NS, "delete", "sj", NAME, "--wait=true", "--timeout=120s")
    wait_for(lambda: not k.get("pods,services,configmaps", "-l", f"splitfeed.io/job={NAME}")["items"], 120,
             "the job's pods, Service and ConfigMap to be gone")
    log("deleted: every object is gone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
