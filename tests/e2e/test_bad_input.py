"""Bad input through kubectl: what the user sees, from the webhook or on the job's status."""

from __future__ import annotations

import pytest
import yaml

from tests.e2e.cluster import NS, Cluster, log, wait_for
from tests.e2e.jobs import event_reasons

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def exists(cluster: Cluster, name: str) -> bool:
    return cluster.kubectl("-n", NS, "get", "sj", name, check=False).returncode == 0


def condition(status: dict, type_: str) -> dict | None:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)


def test_a_job_whose_num_splits_does_not_fit_is_rejected_by_the_webhook(cluster: Cluster) -> None:
    m = cluster.manifest("splits", replicas=3, numSplits=20, globalBatchSize=60)
    out = cluster.apply(m, check=False)
    log(f"splits: kubectl apply -> {out.returncode}: {out.stderr.strip()}")
    assert out.returncode != 0
    assert "admission webhook" in out.stderr and "denied the request" in out.stderr
    assert "numSplits % (worldSize * numWorkers) == 0" in out.stderr
    assert "Valid replica counts for this job: [1, 2, 4, 5, 10, 20]" in out.stderr
    assert not exists(cluster, "splits")


def test_a_scale_to_an_invalid_count_is_rejected_with_the_valid_counts(cluster: Cluster) -> None:
    m = cluster.manifest("scale-bad", replicas=2)
    m["spec"]["suspend"] = True  # no pods needed to judge a scale request
    cluster.apply(m)
    out = cluster.kubectl("-n", NS, "scale", "sj/scale-bad", "--replicas=5", check=False)
    log(f"scale-bad: kubectl scale --replicas=5 -> {out.returncode}: {out.stderr.strip()}")
    assert out.returncode != 0
    assert "Valid replica counts for this job: [1, 2, 3, 4, 6, 8, 12, 24]" in out.stderr
    assert cluster.job("scale-bad")["spec"]["replicas"] == 2
    cluster.kubectl("-n", NS, "delete", "sj", "scale-bad")


def test_a_scale_or_suspend_of_a_job_without_a_checkpoint_store_is_refused_by_kubectl(cluster: Cluster) -> None:
    """Nowhere to save the data position: a rescale would start over; the API says so first."""
    m = cluster.manifest("no-store", replicas=2)
    m["spec"]["suspend"] = True  # no pods needed to judge the request
    del m["spec"]["checkpoint"]
    cluster.apply(m)
    out = cluster.kubectl("-n", NS, "scale", "sj/no-store", "--replicas=4", check=False)
    log(f"no-store: kubectl scale --replicas=4 -> {out.returncode}: {out.stderr.strip()}")
    assert out.returncode != 0 and "spec.checkpoint.uri" in out.stderr
    assert cluster.job("no-store")["spec"]["replicas"] == 2
    out = cluster.kubectl("-n", NS, "patch", "sj/no-store", "--type=merge", "-p",
                          '{"spec": {"suspend": false, "replicas": 4}}', check=False)
    assert out.returncode != 0 and "spec.checkpoint.uri" in out.stderr, out.stderr
    cluster.kubectl("-n", NS, "delete", "sj", "no-store")


@pytest.mark.parametrize("name,data,words", [
    pytest.param("no-table", {"table": "nope"}, "table spec.data.table='nope' does not exist", id="missing-table"),
    pytest.param("few-rows", {"filter": "id < 10"}, "has 10 rows after spec.data.filter='id < 10', fewer "
                 "than spec.data.numSplits=24", id="filter-too-strict"),
])
def test_data_that_cannot_feed_the_job_fails_it_at_once_with_a_condition_that_says_why(
        cluster: Cluster, name: str, data: dict, words: str) -> None:
    cluster.apply(cluster.manifest(name, replicas=2, **data))
    log(f"{name}: applied with {data}; waiting for the job to fail")
    status = wait_for(lambda: (st := cluster.status(name)).get("phase") == "Failed" and st, 90,
                      f"{name} to fail")
    failed = condition(status, "Failed")
    log(f"{name}: Failed: {failed}")
    assert failed and failed["status"] == "True" and failed["reason"] == "DataError", status
    assert words in failed["message"]
    assert status.get("restarts", 0) == 0, "a data error must not spend the restart budget"
    assert status["worldEpoch"] == 0
    # Events are posted after the status patch they describe: wait for ours.
    wait_for(lambda: "DataError" in event_reasons(cluster, name), 30, f"{name}'s DataError event")
    reasons = event_reasons(cluster, name)
    assert "WorldFailed" not in reasons, reasons
    described = cluster.kubectl("-n", NS, "describe", "sj", name).stdout
    assert words in described
    wait_for(lambda: not [p for p in cluster.pods(name) if p["status"].get("phase") == "Running"], 30,
             "the failed world's pods to stop")
    cluster.kubectl("-n", NS, "delete", "sj", name)


def test_a_manifest_with_an_unknown_field_is_rejected_by_name(cluster: Cluster) -> None:
    m = cluster.manifest("typo")
    m["spec"]["data"]["numSplit"] = 24  # typo of numSplits
    out = cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(m), check=False)
    log(f"typo: kubectl apply -> {out.returncode}: {out.stderr.strip()}")
    assert out.returncode != 0
    assert "numSplit" in out.stderr and "unknown field" in out.stderr
    assert not exists(cluster, "typo")
