"""End to end: a running job's live progress in its status and `kubectl get sj`, and both /metrics endpoints.

The world is not drained and no pod ends while the assertions on progress run:
status.progress can only come from the coordinator's live answer then, never
from a sidecar's termination report.
"""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.cluster import NS, Cluster, log, wait_for
from tests.e2e.jobs import finish, scale, wait_running
from tests.e2e.kubelet import host_ip

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
SIDECAR_METRICS_PORT = 29502


def scrape(port: int) -> dict[str, list]:  # type: ignore[type-arg]
    text = urllib.request.urlopen(f"http://{host_ip()}:{port}/metrics", timeout=5).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def samples(families: dict, name: str) -> list:  # type: ignore[type-arg]
    return [s for family in families.values() for s in family if s.name == name]


def no_pod_ended(cluster: Cluster, name: str) -> bool:
    return all(p["status"].get("phase") in ("Pending", "Running") for p in cluster.pods(name))


def test_a_running_jobs_progress_advances_in_its_status_and_metrics_before_any_world_ends(cluster: Cluster) -> None:
    name = "live"
    manifest = cluster.manifest(name, replicas=2, epochs=3, sleep_s=0.4)
    manifest["spec"]["statusIntervalSeconds"] = 5
    cluster.apply(manifest)
    wait_running(cluster, name, 0)

    def progressed(at_least: int) -> int | None:
        step = (cluster.status(name).get("progress") or {}).get("globalStep")
        return step if isinstance(step, int) and step >= at_least else None

    first = wait_for(lambda: progressed(2), 120, f"{name}'s status.progress.globalStep >= 2")
    assert no_pod_ended(cluster, name), "a pod ended: progress may have come from a termination report"
    later = wait_for(lambda: progressed(first + 1), 60, f"{name}'s globalStep past {first}")
    assert no_pod_ended(cluster, name)
    status = cluster.status(name)
    log(f"{name}: live progress {status['progress']}")
    progress = status["progress"]
    assert later > first
    assert progress["stepsPerEpoch"] == 20 and progress["epoch"] == later // 20
    assert progress["rowsPerSecond"] > 0
    assert 0 <= progress["dataStallShare"] <= 1
    assert set(progress["dataReady"]) == {"p50Seconds", "p95Seconds", "p99Seconds"}
    # kubectl shows it: the Step and Stall printer columns of the live status.
    table = cluster.kubectl("-n", NS, "get", "sj", name).stdout
    log(table)
    header, row = table.splitlines()[:2]
    columns = dict(zip(header.split(), row.split()))
    assert int(columns["STEP"]) >= later % 20 or int(columns["EPOCH"]) > progress["epoch"], table
    assert "STALL" in columns, table

    # The sidecars' /metrics (pods share the host network here: one sidecar holds the port).
    rows = lambda fams: sum(s.value for s in samples(fams, "splitfeed_rows_delivered_total"))  # noqa: E731
    before = scrape(SIDECAR_METRICS_PORT)
    wait_for(lambda: rows(scrape(SIDECAR_METRICS_PORT)) > rows(before), 30, "rows delivered to grow")
    after = scrape(SIDECAR_METRICS_PORT)
    counted = samples(after, "splitfeed_rows_delivered_total")
    assert counted and all(s.labels["job"] == name and s.labels["namespace"] == NS and s.labels["world"] == "0"
                           and s.labels["rank"] in ("0", "1") for s in counted), counted
    buckets = [s.labels["le"] for s in samples(after, "splitfeed_data_ready_seconds_bucket")
               if s.labels["rank"] == counted[0].labels["rank"]]
    assert buckets[0] == "0.0001" and buckets[-1] == "+Inf" and len(buckets) == 17, buckets
    # The operator's /metrics: its reconcile passes are counted per job and go up.
    reconciles = lambda fams: sum(s.value for s in samples(fams, "splitfeed_operator_reconciles_total")  # noqa: E731
                                  if s.labels.get("job") == name)
    first_count = reconciles(scrape(cluster.metrics_port))
    assert first_count > 0
    wait_for(lambda: reconciles(scrape(cluster.metrics_port)) > first_count, 30, "reconciles to grow")

    # A rescale's timeline: in the status, in an event `kubectl describe` shows, and in the operator's histogram.
    scale(cluster, name, 1, world=0, steps_in_world=1)
    report = wait_for(lambda: cluster.status(name).get("lastRescale"), 90, f"{name}'s status.lastRescale")
    log(f"{name}: last rescale {report}")
    assert (report["fromReplicas"], report["toReplicas"]) == (2, 1)
    marks = [report["requestedAt"], report["checkpointAgreedAt"], report["oldWorldGoneAt"], report["firstBatchAt"]]
    assert marks == sorted(marks), report
    assert report["latencySeconds"] > 0 and report["stepsRedone"] == 0, report
    described = cluster.kubectl("-n", NS, "describe", "sj", name).stdout
    assert "RescaleReport" in described and "steps redone" in described, described[-3000:]
    operator = scrape(cluster.metrics_port)
    rescale_count = [s for s in samples(operator, "splitfeed_operator_rescale_seconds_count")
                     if s.labels.get("job") == name]
    assert rescale_count and rescale_count[0].value == 1, rescale_count
    # docs/observability.md's buckets: 5 s to an hour.
    assert [s.labels["le"] for s in samples(operator, "splitfeed_operator_rescale_seconds_bucket")
            if s.labels.get("job") == name] == ["5.0", "10.0", "20.0", "30.0", "60.0", "120.0", "300.0", "600.0",
                                                 "1200.0", "3600.0", "+Inf"]
    assert [s.value for s in samples(operator, "splitfeed_operator_rescales_total")
            if s.labels.get("job") == name] == [1.0]
    assert [s.value for s in samples(operator, "splitfeed_operator_steps_redone_total")
            if s.labels.get("job") == name] == [0.0]  # the series exists, and nothing was redone
    finish(cluster, name)
