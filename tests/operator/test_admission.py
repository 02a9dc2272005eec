"""Admission rules: a rejection names the rule and lists the valid replica counts."""

from __future__ import annotations

import pytest

from splitfeed.operator import admission
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
