"""Admission rules: a rejection names the rule and lists the valid replica counts."""

from __future__ import annotations

import pytest

from splitfeed.operator.objects import admission
from splitfeed.trainer_client.contract import specs
from tests.support.builders import manifest

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


def test_model_parallel_groups_change_what_a_scale_may_be():
    # 8 GPUs a pod in tensor-parallel groups of 16: a pod is half a group, so a world is an
    # even number of pods, and 2r/... data-parallel ranks must divide the 48 splits and 960 rows.
    m = manifest(gpusPerReplica=8, replicas=2)
    m["spec"]["data"]["ranksPerBatch"] = 16
    job = admission.review_job(m)
    assert admission.allowed_replicas(job) == [2, 4, 6, 8, 12, 16, 24, 32, 48, 96]
    with pytest.raises(admission.Rejected) as info:
        admission.review_scale(m, 3)
    assert "worldSize % ranksPerBatch == 0" in info.value.rule
    assert "worldSize=24 (replicas*gpusPerReplica = 3*8) is not divisible by ranksPerBatch=16" in str(info.value)
    assert "[2, 4, 6, 8, 12, 16, 24, 32, 48, 96]" in str(info.value)
    admission.review_scale(m, 96)  # 96 pods x 8 GPUs / 16 = 48 data-parallel ranks, one split each


def test_pipeline_stages_must_divide_the_group_they_belong_to():
    m = manifest()
    m["spec"]["data"].update(ranksPerBatch=4, pipelineStages=3)
    with pytest.raises(admission.Rejected, match="spec.data.pipelineStages: must divide spec.data.ranksPerBatch=4"):
        admission.review_job(m)


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
    from splitfeed.operator.objects import planning
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
    pytest.param("transform", "pkg.mod:decode", id="transform"),
    pytest.param("transformArgs", '{"size": 64}', id="transformArgs"),
    pytest.param("onTransformError", "fill", id="onTransformError"),
    pytest.param("packSequences", {"column": "tokens", "blockSize": 512, "eosId": 2, "padId": 0,
                                   "blocksPerEpoch": 4800}, id="packSequences"),
]
# What an order field needs beside it on the job before and after the change.
ORDER_CONTEXT = {
    "transformArgs": {"transform": "pkg.mod:decode", "transformArgs": '{"size": 32}'},
    "onTransformError": {"transform": "pkg.mod:decode"},
}


def with_data(m, **data):
    out = manifest(**{k: v for k, v in m["spec"].items() if k != "data"})
    out["spec"]["data"] = {**m["spec"]["data"], **data}
    return out


@pytest.mark.parametrize("field, value", ORDER_CHANGES)
def test_an_update_of_an_order_defining_field_is_refused_naming_it(field, value):
    old = with_data(manifest(), version=7, **ORDER_CONTEXT.get(field, {}))
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

from tests.support.emulated import add_job, cluster, post_review, review, running_operator  # noqa: E402, F401
from tests.support.ports import free_port  # noqa: E402


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_the_webhooks_refuse_order_changes_and_stops_without_a_store(cluster):  # noqa: F811
    from typing import Any

    import aiohttp
    import kopf

    from splitfeed.operator.cluster import webhooks

    port = free_port()
    settings = kopf.OperatorSettings()
    settings.admission.server = kopf.WebhookServer(addr="127.0.0.1", port=port, insecure=True)
    registry = kopf.OperatorRegistry()
    webhooks.register(registry)
    add_job(cluster, no_store())

    async with running_operator(cluster, settings, registry), aiohttp.ClientSession() as http:
        async def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
            return await post_review(http, f"http://127.0.0.1:{port}/{path}", body)

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


def test_a_pod_is_dry_run_again_only_when_the_parsed_trainer_template_changed():
    from splitfeed.operator.cluster import webhooks

    job = admission.review_job(manifest())
    assert not webhooks._template_changed(manifest(replicas=6), job, {})  # a scale: the same template
    other = manifest()
    other["spec"]["trainer"]["template"]["spec"]["containers"][0]["image"] = "other:1"
    assert webhooks._template_changed(other, job, {})
    assert webhooks._template_changed(None, job, {})  # a new job
    assert webhooks._template_changed({"spec": "not a spec"}, job, {})  # an old object that no longer parses


# --- bounds: the CRD's maxima, applied again here ----------------------------------------

def crd_spec_schema() -> dict:
    import pathlib

    import yaml

    crd = yaml.safe_load((pathlib.Path(__file__).resolve().parents[2] / "crds" / "streamingjob.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def at(schema: dict, field: str) -> dict:
    node = schema
    for key in field.split(".")[1:]:
        node = node["properties"][key]
    return node


def test_the_crd_has_exactly_the_admission_maxima():
    schema = crd_spec_schema()
    found = {}

    def walk(node: dict, path: str) -> None:
        if "maximum" in node:
            found[path] = node["maximum"]
        for key, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.{key}")
    walk(schema, "spec")
    assert found == admission.MAXIMA


def with_field(m: dict, field: str, value: int) -> dict:
    node = m
    for key in field.split(".")[:-1]:
        node = node.setdefault(key, {})
    node[field.split(".")[-1]] = value
    return m


@pytest.mark.parametrize("field", sorted(admission.MAXIMA))
def test_each_maximum_is_admitted_and_one_more_is_refused_by_name(field):
    limit = admission.MAXIMA[field]
    admission.check_job(admission.parse(with_field(manifest(), field, limit)))
    with pytest.raises(admission.Rejected) as info:
        admission.parse(with_field(manifest(), field, limit + 1))
    assert f"{field}: must be at most {limit}, got {limit + 1}" in str(info.value)


def test_a_job_at_the_split_maximum_is_judged_and_planned_in_milliseconds():
    """A complexity check, not a benchmark: the old walk over every replica count took seconds.

    This thread's CPU time, not the wall clock: on a loaded machine the work can wait
    longer than the bound for a core."""
    import time

    from splitfeed.operator.lifecycle import deciding
    from splitfeed.operator.objects import planning
    from tests.support.builders import OWNER, T0

    n = admission.MAXIMA["spec.data.numSplits"]
    m = manifest(replicas=10)
    m["spec"]["data"].update(numSplits=n, globalBatchSize=n * 8)
    start = time.thread_time()
    job = admission.review_job(m)
    with pytest.raises(admission.Rejected) as info:
        admission.review_scale(m, 7)  # the rejection lists every valid count
    d = deciding.decide(job, {}, [], owner=OWNER, settings=planning.Settings(), now=T0)
    elapsed = time.thread_time() - start
    assert elapsed < 0.5, f"{elapsed:.2f} s of CPU"
    assert info.value.allowed[:4] == [1, 2, 4, 5] and len(info.value.allowed) == 49
    assert d.status["allowedReplicas"] == info.value.allowed and len([o for o in d.create if o["kind"] == "Pod"]) == 10


# --- credentials stay in the Secret ---------------------------------------------------------

@pytest.mark.parametrize("key", [
    "aws_secret_access_key", "aws_access_key_id", "AWS_SESSION_TOKEN", "azure_storage_account_key",
    "azure_storage_sas_key", "azure_client_secret", "google_service_account_key", "bearer_token",
    "password", "db_passwd", "my_api_key", "private_key",
])
def test_storage_options_that_look_like_credentials_are_refused_pointing_at_the_secret(key):
    m = manifest()
    m["spec"]["data"]["storageOptions"] = {"region": "us-east-1", key: "hunter2"}
    with pytest.raises(admission.Rejected) as info:
        admission.review_job(m)
    message = str(info.value)
    assert info.value.rule == "spec.data.storageOptions holds no credentials"
    assert key in message and "spec.data.storageOptionsSecret" in message and "s3-creds" in message
    assert "hunter2" not in message


@pytest.mark.parametrize("key", ["region", "aws_region", "endpoint", "aws_endpoint", "allow_http",
                                 "virtual_hosted_style_request", "azure_storage_account_name", "timeout"])
def test_plain_storage_options_are_admitted(key):
    m = manifest()
    m["spec"]["data"]["storageOptions"] = {key: "x"}
    admission.review_job(m)


def test_a_uri_with_credentials_never_appears_in_a_rejection():
    old, new = manifest(), manifest()
    old["spec"]["data"]["uri"] = "s3://AKIAOLD:oldsecret@bucket/db"
    new["spec"]["data"]["uri"] = "https://host/db?sig=newsecret&sv=1"
    with pytest.raises(admission.Rejected) as info:
        admission.review_update(old, new)
    message = str(info.value)
    assert "data.uri is immutable" in message
    assert "oldsecret" not in message and "newsecret" not in message and "AKIAOLD" not in message
    assert "s3://***@bucket/db" in message and "https://host/db?sig=***&sv=***" in message


# --- the template: a shape the operator can build from, no access to the sidecar's volumes --

def template_with(mutate) -> dict:
    m = manifest()
    mutate(m["spec"]["trainer"]["template"])
    return m


MALFORMED = {
    "containers-not-a-list": lambda t: t["spec"].update(containers={"name": "trainer"}),
    "container-not-a-mapping": lambda t: t["spec"]["containers"].append("sidecar"),
    "container-without-name": lambda t: t["spec"]["containers"].append({"image": "x"}),
    "env-item-a-string": lambda t: t["spec"]["containers"][0].update(env=["A=1"]),
    "mount-without-path": lambda t: t["spec"]["containers"][0].update(volumeMounts=[{"name": "x"}]),
    "volumes-a-mapping": lambda t: t["spec"].update(volumes={"x": {}}),
    "volume-without-name": lambda t: t["spec"].update(volumes=[{"emptyDir": {}}]),
    "labels-not-strings": lambda t: t["metadata"].update(labels={"tier": 1}),
    "metadata-a-list": lambda t: t.update(metadata=["x"]),
    "spec-a-string": lambda t: t.update(spec="pod"),
    "init-containers-a-string": lambda t: t["spec"].update(initContainers="fetch"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_template_is_rejected_and_the_reconciler_says_so_without_crashing(case):
    from splitfeed.operator.lifecycle import deciding
    from splitfeed.operator.objects import planning
    from tests.support.builders import OWNER, T0

    m = template_with(MALFORMED[case])
    with pytest.raises(admission.Rejected) as info:
        admission.review_job(m)
    assert "spec.trainer.template" in str(info.value)
    job = admission.parse(m)
    d = deciding.decide(job, {}, [], owner=OWNER, settings=planning.Settings(), now=T0)
    assert d.permanent_error and not d.create
    (validated,) = [c for c in d.status["conditions"] if c["type"] == "Validated"]
    assert validated["reason"] == "InvalidSpec" and "spec.trainer.template" in validated["message"]


@pytest.mark.parametrize("volume", ["splitfeed-storage", "splitfeed-config", "splitfeed-podinfo", "splitfeed-shm"])
@pytest.mark.parametrize("where", ["containers", "initContainers"])
def test_no_template_container_may_mount_the_sidecars_volumes(volume, where):
    def mutate(t):
        spec = t["spec"]
        c = spec["containers"][0] if where == "containers" else {"name": "peek", "image": "x"}
        c["volumeMounts"] = [{"name": volume, "mountPath": "/steal"}]
        if where == "initContainers":
            spec["initContainers"] = [c]
    with pytest.raises(admission.Rejected) as info:
        admission.review_job(template_with(mutate))
    assert info.value.rule == "the template's containers mount none of the sidecar's volumes"
    assert volume in str(info.value)
