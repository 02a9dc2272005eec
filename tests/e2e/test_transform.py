"""End to end: a StreamingJob with a transform shipped as a ConfigMap, onTransformError: fill.

The README's way for a small transform: the module (tests/e2e/e2e_transforms.py) goes
into a ConfigMap, the trainer template declares it as the `splitfeed-transforms`
volume, and the operator mounts it into the sidecar. Some rows fail. The real DDP
trainers (tests/e2e/trainer.py) must receive, for their rank, exactly the rows of
lancedb's in-process `StreamingDataset(..., transform=...)` with every failing row
replaced as docs/preprocessing.md says: by the output of the next row of the same split
whose transform succeeds, wrapping to the split's start. The test applies that rule
itself to each split's own StreamingDataset order. `status.progress.filledRows` counts
the replaced rows while the world runs.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from lancedb.streaming import StreamingDataset

from splitfeed.trainer_client.contract import specs, topology
from tests.e2e import e2e_transforms
from tests.e2e.cluster import NS, Cluster, log, wait_for
from tests.e2e.jobs import wait_phase
from tests.reading.tables import open_reference_table

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
MODULE = Path(e2e_transforms.__file__)
CONFIGMAP = "e2e-transforms"
REPLICAS = 2


def rows(data: specs.DataSpec, *, rank: int, world_size: int) -> list[dict[str, Any]]:
    """lancedb's StreamingDataset with the job's transform (no row failing), in-process."""
    dataset = StreamingDataset(
        open_reference_table(data), num_splits=data.num_splits, shuffle=data.shuffle,
        shuffle_seed=data.shuffle_seed, epoch=0, rank=rank, world_size=world_size,
        read_batch_size=data.read_batch_size, transform=e2e_transforms.tagged)
    with contextlib.closing(iter(dataset)) as it:
        return list(it)


def filled(data: specs.DataSpec, bad: set[int]) -> dict[int, dict[str, Any]]:
    """id -> the row a trainer receives in its place: itself, or for a failing row the next
    row of its split whose transform succeeds (wrapping to the split's start)."""
    out: dict[int, dict[str, Any]] = {}
    for split in range(data.num_splits):  # a rank of a world of numSplits owns exactly one split
        order = rows(data, rank=split, world_size=data.num_splits)
        for p, row in enumerate(order):
            q = p
            while int(order[q]["id"]) in bad:
                q = (q + 1) % len(order)
            out[int(row["id"])] = order[q]
    return out


def test_a_configmap_transform_with_fill_delivers_the_reference_rows_and_counts_fills(cluster: Cluster) -> None:
    name = "transform"
    probe = cluster.manifest(name, replicas=REPLICAS)
    data = specs.parse_job(probe, check_replicas=False).data
    cycles = topology.rows_per_split_per_step(data.global_batch_size, data.num_splits)
    # Bad rows in the first steps (so the live count is complete long before the world ends):
    # a run of two in split 3 (the first one's substitute skips the second) and one in split 17.
    three = rows(data, rank=3, world_size=data.num_splits)
    seventeen = rows(data, rank=17, world_size=data.num_splits)
    bad = [int(r["id"]) for r in three[1:3] + seventeen[4:5]]
    assert all(p // cycles < 3 for p in (1, 2, 4))  # in steps 0..2 of 20

    cluster.kubectl("-n", NS, "delete", "configmap", CONFIGMAP, "--ignore-not-found")
    cluster.kubectl("-n", NS, "create", "configmap", CONFIGMAP, f"--from-file=e2e_transforms.py={MODULE}")
    manifest = cluster.manifest(name, replicas=REPLICAS, sleep_s=0.5, transform="e2e_transforms:tagged",
                                transformArgs=json.dumps({"bad": bad}), onTransformError="fill")
    manifest["spec"]["statusIntervalSeconds"] = 5
    pod = manifest["spec"]["trainer"]["template"]["spec"]
    pod["volumes"] = [{"name": "splitfeed-transforms", "configMap": {"name": CONFIGMAP}}]
    pod["containers"][0]["command"] += ["--log-column", "tag"]
    try:
        cluster.apply(manifest)
        counted = wait_for(lambda: (cluster.status(name).get("progress") or {}).get("filledRows") == len(bad)
                           and cluster.status(name)["progress"], 150,
                           f"{name}'s status.progress.filledRows to reach {len(bad)}")
        log(f"{name}: live progress {counted}")
        assert all(p["status"].get("phase") in ("Pending", "Running") for p in cluster.pods(name)), \
            "a pod ended: the count must come from the running world"
        status = wait_phase(cluster, name, "Succeeded")
        assert status["progress"]["filledRows"] == len(bad)
    finally:
        cluster.kubectl("-n", NS, "delete", "configmap", CONFIGMAP, "--ignore-not-found", check=False)

    substitute = filled(data, set(bad))
    b = topology.rank_batch_size(data.global_batch_size, REPLICAS)
    replaced = 0
    for rank in range(REPLICAS):
        ours = rows(data, rank=rank, world_size=REPLICAS)
        delivered = ours[:len(ours) // b * b]
        replaced += sum(int(r["id"]) in bad for r in delivered)
        expected = [[substitute[int(r["id"])] for r in delivered[k:k + b]] for k in range(0, len(delivered), b)]
        log_file = cluster.log_dir(name) / f"w0-r{rank}.jsonl"
        got = [r for r in map(json.loads, log_file.read_text().splitlines()) if r["event"] == "batch"]
        assert [r["step"] for r in got] == list(range(len(expected))), f"rank {rank}"
        assert [r["ids"] for r in got] == [[int(x["id"]) for x in step] for step in expected], f"rank {rank}"
        assert [r["columns"]["tag"] for r in got] == [[float(x["tag"]) for x in step] for step in expected], \
            f"rank {rank}"
    assert replaced == len(bad)  # every failing row sits where some rank delivers it
