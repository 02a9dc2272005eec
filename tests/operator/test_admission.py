"""Admission rules: a rejection names the rule and lists the valid replica counts."""

from __future__ import annotations

import pytest

from splitfeed.operator import admission
from splitfeed.trainer_client import specs
from tests.operator.builders import manifest

ALLOWED_48_960 = [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]


def test_a_valid_job_is_admitted():
    job = admission.review_job(manifest())
    assert job.replicas == 4 and admission.allowed_replicas(job) == ALLOWED_48_960


@pytest.mark.parametrize("replicas", ALLOWED_48_960)
def test_every_allowed_scale_is_admitted(replicas):
    admission.review_scale(manifest(), replicas)


@pytest.mark.parametrize("replicas, rule", [
    pytest.param(5, "numSplits % (worldSize * numWorkers) == 0", id="splits-not-divisible"),
    pytest.param(0, "replicas >= 1", id="zero"),
    pytest.param(96, "numSplits % (worldSize * numWorkers) == 0", id="more-than-splits"),
])
def test_an_invalid_scale_names_the_rule_and_the_valid_counts(replicas, rule):
    with pytest.raises(admission.Rejected) as info:
        admission.review_scale(manifest(), replicas)
    assert rule in info.value.rule
    assert str(info.value).count("Valid replica counts for this job: [") == 1
    if replicas:
        assert "[1, 2, 3, 4, 6, 8, 12, 16, 24, 48]" in str(info.value)


def test_batch_size_rules_are_named():
    m = manifest()
    m["spec"]["data"]["globalBatchSize"] = 100  # not a multiple of 48
    with pytest.raises(admission.Rejected) as info:
        admission.review_job(m)
    assert "globalBatchSize % numSplits == 0" in str(info.value)


def test_workers_and_gpus_shrink_the_valid_counts():
    m = manifest(gpusPerReplica=2, replicas=5)
    m["spec"]["data"]["numWorkers"] = 2
    with pytest.raises(admission.Rejected) as info:
        admission.review_job(m)
    # 2r * 2 workers must divide 48 splits: r divides 12 (and 960 % 2r == 0 for those)
    assert info.value.allowed == [1, 2, 3, 4, 6, 12]
    assert "[1, 2, 3, 4, 6, 12]" in str(info.value)
    m["spec"]["replicas"] = 12
    assert admission.review_job(m).world_size == 24


def test_a_bad_field_names_the_field():
    m = manifest()
    m["spec"]["data"]["numSplit"] = 3
    with pytest.raises(admission.Rejected) as info:
        admission.review_job(m)
    assert info.value.rule == "field spec.data.numSplit"
    assert "numSplits" in str(info.value)  # the did-you-mean hint


def test_a_template_without_a_trainer_container_is_rejected():
    m = manifest()
    m["spec"]["trainer"]["template"]["spec"]["containers"][0]["name"] = "main"
    with pytest.raises(admission.Rejected, match="container named 'trainer'"):
        admission.review_job(m)


@pytest.mark.parametrize("where", ["containers", "initContainers"])
def test_the_sidecar_name_is_reserved(where):
    m = manifest()
    spec = m["spec"]["trainer"]["template"]["spec"]
    spec.setdefault(where, []).append({"name": "splitfeed-sidecar", "image": "x"})
    with pytest.raises(admission.Rejected, match="reserved"):
        admission.review_job(m)


def test_reserved_volume_names_are_rejected():
    m = manifest()
    m["spec"]["trainer"]["template"]["spec"]["volumes"] = [{"name": "splitfeed-shm", "emptyDir": {}}]
    with pytest.raises(admission.Rejected, match="splitfeed-"):
        admission.review_job(m)


def test_restart_policy_always_is_rejected():
    m = manifest()
    m["spec"]["trainer"]["template"]["spec"]["restartPolicy"] = "Always"
    with pytest.raises(admission.Rejected, match="Never or OnFailure"):
        admission.review_job(m)


@pytest.mark.parametrize("name", ["Resnet", "9lives", "a" * 46, "under_score"])
def test_names_that_cannot_be_hostnames_are_rejected(name):
    with pytest.raises(admission.Rejected, match="DNS-1035"):
        admission.review_job(manifest(name=name))


def test_a_45_character_name_is_fine():
    admission.review_job(manifest(name="a" * 45))


def test_scale_review_still_reports_broken_fields():
    m = manifest()
    del m["spec"]["data"]["table"]
    with pytest.raises(admission.Rejected, match="spec.data.table"):
        admission.review_scale(m, 4)


def test_operator_sidecar_defaults_fill_only_what_the_job_omits():
    from splitfeed.operator import planning
    settings = planning.Settings.from_env({"SPLITFEED_SIDECAR_IMAGE": "reg/sf:2", "SPLITFEED_SIDECAR_SHM_SIZE": "8Gi",
                                           "SPLITFEED_SIDECAR_PREFETCH_BATCHES": "8"})
    m = manifest()
    m["spec"]["sidecar"] = {"shmSize": "1Gi"}
    job = admission.review_job(m, settings.sidecar_defaults)
    assert (job.sidecar.image, job.sidecar.shm_size, job.sidecar.prefetch_batches) == ("reg/sf:2", "1Gi", 8)
    del m["spec"]["sidecar"]
    assert admission.parse(m, settings.sidecar_defaults).sidecar.shm_size == "8Gi"
    assert admission.parse(m).sidecar.image == "splitfeed:0.1.0"


# --- UPDATE: order-defining fields are fixed; a stop needs a checkpoint store ---------

ORDER_CHANGES = [
    pytest.param("uri", "s3://other/db", id="uri"),
    pytest.param("table", "other", id="table"),
    pytest.param("version", 9, id="version"),
    pytest.param("columns", ["id"], id="columns"),
    pytest.param("filter", "label > 2", id="filter"),
    pytest.param("numSplits", 96, id="numSplits"),
    pytest.param("shuffle", False, id="shuffle"),
    pytest.param("shuffleSeed", 5, id="shuffleSeed"),
    pytest.param("shuffleClumpSize", 16, id="shuffleClumpSize"),
    pytest.param("globalBatchSize", 1920, id="globalBatchSize"),
]


def with_data(m, **data):
    out = manifest(**{k: v for k, v in m["spec"].items() if k != "data"})
    out["spec"]["data"] = {**m["spec"]["data"], **data}
    return out


@pytest.mark.parametrize("field, value", ORDER_CHANGES)
def test_an_update_of_an_order_defining_field_is_refused_naming_it(field, value):
    old = with_data(manifest(), version=7)
    new = with_data(old, **{field: value})
    admission.review_job(new)  # a fine job to create...
    with pytest.raises(admission.Rejected) as info:
        admission.review_update(old, new)  # ...but not to turn this job into
    assert info.value.rule == f"data.{field} is immutable"
    assert "create a new StreamingJob" in str(info.value)


def test_every_changed_order_field_is_named():
    old = manifest()
    new = with_data(old, shuffle=False, globalBatchSize=1920)
    with pytest.raises(admission.Rejected) as info:
        admission.review_update(old, new)
    assert info.value.rule == "data.shuffle is immutable, data.globalBatchSize is immutable"


def test_the_order_fields_are_the_config_models():
    assert [p.values[0] for p in ORDER_CHANGES] == list(specs.ORDER_FIELDS)


@pytest.mark.parametrize("change", [
    pytest.param({"replicas": 6}, id="scale"),
    pytest.param({"epochs": 3}, id="epochs"),
    pytest.param({"numWorkers": 2}, id="numWorkers"),
    pytest.param({"readBatchSize": 7}, id="readBatchSize"),
    pytest.param({"suspend": True}, id="suspend"),
])
def test_an_update_that_keeps_the_order_is_admitted(change):
    old = manifest()
    new = manifest(**{k: v for k, v in change.items() if k in ("replicas", "suspend")})
    new["spec"]["data"].update({k: v for k, v in change.items() if k not in ("replicas", "suspend")})
    assert admission.review_update(old, new).data.num_splits == 48


def no_store(**spec):
    m = manifest(**spec)
    del m["spec"]["checkpoint"]["uri"]
    return m


@pytest.mark.parametrize("old, new", [
    pytest.param(no_store(), no_store(replicas=6), id="scale-up"),
    pytest.param(no_store(), no_store(replicas=2), id="scale-down"),
    pytest.param(no_store(), no_store(suspend=True), id="suspend"),
    pytest.param(no_store(), manifest(replicas=6), id="scale-while-adding-the-uri"),
    pytest.param(manifest(), no_store(replicas=6), id="scale-while-removing-the-uri"),
])
def test_a_scale_or_suspend_without_a_checkpoint_store_is_refused(old, new):
    with pytest.raises(admission.Rejected) as info:
        admission.review_update(old, new)
    assert info.value.rule == admission.STORE_RULE
    assert "set spec.checkpoint.uri" in str(info.value)


@pytest.mark.parametrize("old, new", [
    pytest.param(no_store(suspend=True), no_store(), id="resume"),
    pytest.param(no_store(), manifest(), id="adding-the-uri-alone"),
    pytest.param(manifest(), manifest(replicas=6), id="scale-with-a-store"),
    pytest.param(manifest(), manifest(suspend=True), id="suspend-with-a-store"),
])
def test_a_stop_with_a_store_or_a_resume_is_admitted(old, new):
    admission.review_update(old, new)


def test_a_new_job_may_be_created_suspended_without_a_store():
    admission.review_job(no_store(suspend=True))


def test_a_scale_subresource_request_needs_a_store_too():
    with pytest.raises(admission.Rejected, match="set spec.checkpoint.uri"):
        admission.review_scale(no_store(), 6)
    admission.review_scale(no_store(), 4)  # the same count stops nothing
    admission.review_scale(manifest(), 6)


def test_an_old_object_that_no_longer_parses_is_judged_as_new():
    old = manifest()
    old["spec"]["data"]["numSplit"] = 3  # admitted before the rule
    new = with_data(manifest(), globalBatchSize=1920)
    assert admission.review_update(old, new).data.global_batch_size == 1920


# --- the same through Kopf's webhook server (AdmissionReviews, as the apiserver posts them) ---

from tests.operator.test_kopf_emulated import (  # noqa: E402  (fixtures and helpers)
    add_job,
    cluster,  # noqa: F401
    free_port,
    review,
    running_operator,
)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_the_webhooks_refuse_order_changes_and_stops_without_a_store(cluster):  # noqa: F811
    import asyncio
    import time
    from typing import Any

    import aiohttp
    import kopf

    from splitfeed.operator import webhooks

    port = free_port()
    settings = kopf.OperatorSettings()
    settings.admission.server = kopf.WebhookServer(addr="127.0.0.1", port=port, insecure=True)
    registry = kopf.OperatorRegistry()
    webhooks.register(registry)
    add_job(cluster, no_store())

    async with running_operator(cluster, settings, registry), aiohttp.ClientSession() as http:
        async def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
            deadline = time.monotonic() + 20
            while True:
                try:
                    async with http.post(f"http://127.0.0.1:{port}/{path}", json=body) as resp:
                        if resp.status != 404 or time.monotonic() > deadline:  # 404 until the CRD is found
                            assert resp.status == 200, await resp.text()
                            answer: dict[str, Any] = (await resp.json())["response"]
                            return answer
                except aiohttp.ClientConnectionError:
                    if time.monotonic() > deadline:
                        raise
                await asyncio.sleep(0.2)

        def update(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
            return review(new, operation="UPDATE", old=old)

        denied = await post("streamingjob", update(manifest(), with_data(manifest(), globalBatchSize=1920)))
        assert not denied["allowed"] and denied["status"]["code"] == 422
        assert "data.globalBatchSize is immutable" in denied["status"]["message"]
        for new in (no_store(replicas=6), no_store(suspend=True)):
            denied = await post("streamingjob", update(no_store(), new))
            assert not denied["allowed"] and "set spec.checkpoint.uri" in denied["status"]["message"]
        assert (await post("streamingjob", update(manifest(), manifest(replicas=6))))["allowed"]
        assert (await post("streamingjob", update(no_store(suspend=True), no_store())))["allowed"]

        def scale(replicas: int) -> dict[str, Any]:
            return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                    "metadata": {"name": "resnet", "namespace": "ns"}, "spec": {"replicas": replicas}}

        denied = await post("scale", review(scale(6), operation="UPDATE", old=scale(4), sub_resource="scale"))
        assert not denied["allowed"] and "set spec.checkpoint.uri" in denied["status"]["message"]
