"""StreamingJob manifests for the tests: one builder per shape of job the tiers use."""

from __future__ import annotations

from typing import Any

from splitfeed.trainer_client.contract import specs


def data_manifest(uri: str, checkpoint_uri: str | None = None, **data: object) -> dict[str, Any]:
    """A job reading `uri`'s `frames`: 24 splits, 48 rows per global step, one shuffled epoch."""
    spec_data: dict[str, Any] = {"uri": uri, "table": "frames", "numSplits": 24, "globalBatchSize": 48,
                                 "shuffleSeed": 3, "epochs": 1}
    spec_data.update(data)
    spec: dict[str, Any] = {"data": spec_data, "sidecar": {"prefetchBatches": 2}}
    if checkpoint_uri:
        spec["checkpoint"] = {"uri": checkpoint_uri}
    return {"apiVersion": specs.API_VERSION, "kind": specs.KIND,
            "metadata": {"name": "job", "namespace": "test"}, "spec": spec}
