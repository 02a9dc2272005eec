"""A job whose transform fails on chosen ids under onTransformError=skip, and what lancedb says
its ranks get: the streaming tier's skipping tests share it (tests/streaming/test_skipping.py,
test_skip_trainer.py, test_coordinator_restart.py; their `plan` fixture is `make_plan`).

Expected rows come from lancedb's StreamingDataset(on_transform_error="skip") in-process
for each rank, cut at the world's end E, computed from each split's rows and the failing ids.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from typing import Any

from lancedb.streaming import StreamingDataset

from splitfeed.sidecar.data import reading
from splitfeed.trainer_client.contract import specs
from splitfeed.trainer_client.script.client import StreamClient

from tests.support import skipping_transforms
from tests.support.manifests import data_manifest as manifest

N, G, EPOCHS = 24, 48, 2
TRANSFORM = "tests.support.skipping_transforms:ids_fragile"


def lancedb_ids(data: specs.DataSpec, *, epoch: int, rank: int, world: int, bad: list[int] | None) -> list[int]:
    extra: dict[str, Any] = {}
    if bad is not None:
        extra = dict(transform=functools.partial(skipping_transforms.ids_fragile, bad=bad),
                     on_transform_error="skip")
    dataset = StreamingDataset(
        reading.open_table(data), num_splits=N, shuffle=True, shuffle_seed=data.shuffle_seed, epoch=epoch,
        rank=rank, world_size=world, read_batch_size=data.read_batch_size, **extra)
    with contextlib.closing(iter(dataset)) as rows:
        return [int(r["id"]) for r in rows]


def job(uri: str, bad: list[int], checkpoint_uri: str | None = None) -> dict[str, Any]:
    return manifest(uri, checkpoint_uri, transform=TRANSFORM, transformArgs=json.dumps({"bad": bad}),
                    onTransformError="skip", epochs=EPOCHS)


def make_plan(table_uri: str) -> dict[str, Any]:
    """Failing ids concentrated in splits 5 (7 rows) and 11 (2 rows) of epoch 0 and split 8
    (3 rows) of epoch 1, the world's end E of each epoch (from the splits' own rows), and the
    steps per epoch."""
    data = specs.parse_job(manifest(table_uri, epochs=EPOCHS), check_replicas=False).data
    splits = {e: [lancedb_ids(data, epoch=e, rank=s, world=N, bad=None) for s in range(N)] for e in range(EPOCHS)}
    bad = splits[0][5][3:10] + splits[0][11][30:32]
    bad += [i for i in splits[1][8] if i not in bad][:3]
    spe = len(splits[0][0]) // (G // N)
    ends = [min(spe, *(sum(i not in bad for i in ids) // (G // N) for ids in splits[e])) for e in range(EPOCHS)]
    # The failing rows before the last delivered row of their split: what the sidecars drop.
    dropped = 0
    for epoch, end in enumerate(ends):
        for ids in splits[epoch]:
            survivors = [p for p, i in enumerate(ids) if i not in bad]
            dropped += sum(i in bad for i in ids[:survivors[end * (G // N) - 1] + 1])
    assert ends[0] == spe - 3 and ends[1] < spe and ends[1] != ends[0], ends  # both epochs end early
    data = specs.parse_job(job(table_uri, bad), check_replicas=False).data
    return {"bad": bad, "ends": ends, "spe": spe, "data": data, "dropped": dropped}


def expected_steps(plan: dict[str, Any], world: int, rank: int) -> dict[int, list[int]]:
    """Global step -> this rank's ids: lancedb's skip order, cut at the world's end."""
    per_rank = G // world
    out = {}
    for epoch, end in enumerate(plan["ends"]):
        ids = lancedb_ids(plan["data"], epoch=epoch, rank=rank, world=world, bad=plan["bad"])
        for k in range(end):
            out[epoch * plan["spe"] + k] = ids[k * per_rank:(k + 1) * per_rank]
    return out


def lockstep(world: int, socket_dirs: list, body) -> list[Any]:  # type: ignore[no-untyped-def]
    """Run `body(client, barrier)` for each rank in a thread; re-raise the first failure."""
    barrier = threading.Barrier(world, timeout=60)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            with StreamClient(socket_dirs[rank], 0, timeout_s=60) as client:
                results[rank] = body(client, barrier)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a trainer hung"
    if errors:
        raise errors[0]
    return results
