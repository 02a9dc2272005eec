"""Shared builders for the operator tests: manifests, pods in a given phase."""

from __future__ import annotations

import copy
import datetime
from typing import Any

from splitfeed.operator.objects import planning
from splitfeed.trainer_client.contract import messages, stalls

T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.timezone.utc)


def manifest(name: str = "resnet", **spec: Any) -> dict[str, Any]:
    """A valid StreamingJob: numSplits 48, globalBatchSize 960, 1 GPU per replica."""
    base: dict[str, Any] = {
        "replicas": 4,
        "gpusPerReplica": 1,
        "data": {"uri": "s3://bucket/db", "table": "frames", "numSplits": 48,
                 "globalBatchSize": 960, "storageOptionsSecret": "s3-creds"},
        "checkpoint": {"uri": "s3://bucket/ckpt", "timeoutSeconds": 60},
        "sidecar": {"image": "splitfeed:0.1.0", "shmSize": "1Gi"},
        "trainer": {"template": {
            "metadata": {"labels": {"team": "vision"}},
            "spec": {"containers": [{"name": "trainer", "image": "trainer:1",
                                     "env": [{"name": "RANK", "value": "bogus"},
                                             {"name": "KEEP", "value": "1"}]}]},
        }},
    }
    for key, value in spec.items():
        base[key] = value
    return {"apiVersion": "splitfeed.io/v1alpha1", "kind": "StreamingJob",
            "metadata": {"name": name, "namespace": "ns", "uid": "uid-1"}, "spec": base}


OWNER = planning.Owner(name="resnet", uid="uid-1")


def pod_dict(pod: dict[str, Any], phase: str = "Pending", **extra_status: Any) -> dict[str, Any]:
    p = copy.deepcopy(pod)
    p["status"] = {"phase": phase, **extra_status}
    return p


def status_answer(**fields: Any) -> messages.Status:
    """A coordinator's `status` answer as worlds.request_status returns it: a world of 2 members
    that both reported, before any batch, unless `fields` say otherwise."""
    base: dict[str, Any] = dict(
        replicas=2, reporting=2, global_step=None, steps_per_epoch=0, total_steps=0, resume_step=0, rows=0,
        rows_per_s=0.0, wait_s=0.0, wall_s=0.0, buckets=[0] * stalls.NUM_BUCKETS, drain_step=None,
        filled_rows=0, skipped_rows=0)
    return messages.Status(**{**base, **fields})
