"""Pod, Service and ConfigMap building: docs/pod-contract.md, checked against Kubernetes 1.30 schemas."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest

from splitfeed.operator import planning
from splitfeed.trainer_client import specs
from tests.operator import pss
from tests.support.builders import OWNER, manifest

NATIVE = planning.Settings()
CONTAINER = planning.Settings(sidecar_mode="container")


@pytest.fixture(autouse=True)
def every_built_pod_is_restricted_when_its_template_is(monkeypatch):
    """Checked on every pod any test here builds: the sidecar never breaks the restricted
    profile, so a pod breaks it only where its template does."""
    build = planning.pod

    def checked(job, *args, **kwargs):
        pod = build(job, *args, **kwargs)
        broken = pss.violations(pod)
        template = {"spec": job.trainer.template.get("spec") or {}}
        if (template["spec"].get("securityContext") or {}).get("runAsUser") != 0:  # root is the template's choice
            assert not [v for v in broken if v.startswith(planning.SIDECAR_NAME)], broken
        if not pss.violations(template):
            assert broken == [], broken
        return pod

    monkeypatch.setattr(planning, "pod", checked)


def restricted_manifest(**spec):
    m = manifest(**spec)
    tpl = m["spec"]["trainer"]["template"]["spec"]
    tpl["securityContext"] = dict(pss.RESTRICTED_POD_SECURITY)
    for c in tpl["containers"]:
        c["securityContext"] = dict(pss.RESTRICTED_CONTAINER_SECURITY)
    return m


def job(**spec):
    return specs.parse_job(manifest(**spec))


def env_of(container):
    return {e["name"]: e["value"] for e in container.get("env", [])}


def containers(pod):
    spec = pod["spec"]
    return {c["name"]: c for c in spec.get("containers", []) + spec.get("initContainers", [])}


@pytest.mark.parametrize("settings", [NATIVE, CONTAINER], ids=["native", "container"])
@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("restricted", [False, True], ids=["plain", "restricted"])
def test_every_object_of_a_world_is_valid_for_kubernetes_1_30(settings, gpus, restricted):
    spec = {"gpusPerReplica": gpus, "replicas": 2}
    j = specs.parse_job(restricted_manifest(**spec) if restricted else manifest(**spec))
    objs = planning.world(j, 3, OWNER, settings)
    assert [o["kind"] for o in objs] == ["ConfigMap", "Service", "PodDisruptionBudget", "Pod", "Pod"]
    for obj in objs:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
        if obj["kind"] == "Pod":
            assert (pss.violations(obj) == []) is restricted


def test_pods_are_named_by_job_world_and_replica_and_labelled_so():
    pods = [o for o in planning.world(job(), 7, OWNER, NATIVE) if o["kind"] == "Pod"]
    assert [p["metadata"]["name"] for p in pods] == [f"resnet-w7-{i}" for i in range(4)]
    labels = pods[2]["metadata"]["labels"]
    assert labels == {"team": "vision", "splitfeed.io/job": "resnet",
                      "splitfeed.io/replica": "2", "splitfeed.io/world-epoch": "7"}
    assert pods[2]["spec"]["hostname"] == "resnet-w7-2"
    assert pods[2]["spec"]["subdomain"] == "resnet"
    assert pods[2]["metadata"]["namespace"] == "ns"


def test_every_object_is_owned_by_the_job_for_garbage_collection():
    for obj in planning.world(job(), 0, OWNER, NATIVE):
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "splitfeed.io/v1alpha1", "kind": "StreamingJob", "name": "resnet",
                       "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}


def test_native_sidecar_is_an_init_container_that_restarts_always():
    pod = planning.pod(job(), 0, 1, OWNER, NATIVE)
    (sidecar,) = pod["spec"]["initContainers"]
    assert sidecar["name"] == "splitfeed-sidecar" and sidecar["restartPolicy"] == "Always"
    assert [c["name"] for c in pod["spec"]["containers"]] == ["trainer"]


def test_container_mode_sidecar_is_a_plain_container():
    pod = planning.pod(job(), 0, 1, OWNER, CONTAINER)
    assert "initContainers" not in pod["spec"]
    names = [c["name"] for c in pod["spec"]["containers"]]
    assert names == ["trainer", "splitfeed-sidecar"]
    assert "restartPolicy" not in pod["spec"]["containers"][1]


def test_user_init_containers_are_kept_before_the_sidecar():
    m = manifest()
    m["spec"]["trainer"]["template"]["spec"]["initContainers"] = [{"name": "fetch", "image": "x"}]
    pod = planning.pod(specs.parse_job(m), 0, 0, OWNER, NATIVE)
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["fetch", "splitfeed-sidecar"]


def test_sidecar_command_follows_the_contract():
    sidecar = containers(planning.pod(job(), 0, 0, OWNER, NATIVE))["splitfeed-sidecar"]
    assert sidecar["command"] + sidecar["args"] == [
        "splitfeed", "sidecar", "--config", "/etc/splitfeed/config/config.json",
        "--podinfo-dir", "/etc/splitfeed/podinfo", "--storage-options-dir", "/etc/splitfeed/storage",
        "--termination-log", "/dev/termination-log"]
    assert sidecar["terminationMessagePath"] == "/dev/termination-log"


def test_without_storage_secret_there_is_no_storage_volume_or_flag():
    m = manifest()
    del m["spec"]["data"]["storageOptionsSecret"]
    pod = planning.pod(specs.parse_job(m), 0, 0, OWNER, NATIVE)
    assert "splitfeed-storage" not in {v["name"] for v in pod["spec"]["volumes"]}
    assert "--storage-options-dir" not in containers(pod)["splitfeed-sidecar"]["args"]


def test_volumes_and_mounts_follow_the_contract():
    pod = planning.pod(job(), 0, 0, OWNER, NATIVE)
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["splitfeed-shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert vols["splitfeed-config"]["configMap"]["name"] == "resnet-data"
    assert vols["splitfeed-config"]["configMap"]["items"] == [{"key": "config.json", "path": "config.json"}]
    assert {i["path"]: i["fieldRef"]["fieldPath"] for i in vols["splitfeed-podinfo"]["downwardAPI"]["items"]} \
        == {"annotations": "metadata.annotations", "labels": "metadata.labels"}
    assert vols["splitfeed-storage"]["secret"] == {"secretName": "s3-creds"}
    c = containers(pod)
    mounts = {m["name"]: m["mountPath"] for m in c["splitfeed-sidecar"]["volumeMounts"]}
    assert mounts == {"splitfeed-shm": "/var/run/splitfeed", "splitfeed-config": "/etc/splitfeed/config",
                      "splitfeed-podinfo": "/etc/splitfeed/podinfo", "splitfeed-storage": "/etc/splitfeed/storage"}
    assert {m["name"]: m["mountPath"] for m in c["trainer"]["volumeMounts"]} == {
        "splitfeed-shm": "/var/run/splitfeed"}


def test_the_sidecar_gets_the_trainer_mounts_that_hold_a_local_table_or_checkpoint_dir():
    """A hostPath table on a development cluster: the loader must see it (found by make e2e-kind)."""
    m = manifest()
    m["spec"]["data"]["uri"] = "/data/lance/db"
    m["spec"]["checkpoint"]["uri"] = "file:///ckpt/run1"
    tpl = m["spec"]["trainer"]["template"]["spec"]
    tpl["volumes"] = [{"name": n, "hostPath": {"path": f"/{n}"}} for n in ("data", "ckpt", "other")]
    tpl["containers"][0]["volumeMounts"] = [
        {"name": "data", "mountPath": "/data", "readOnly": True},
        {"name": "ckpt", "mountPath": "/ckpt/"}, {"name": "other", "mountPath": "/dat"}]
    pod = planning.pod(specs.parse_job(m), 0, 0, OWNER, NATIVE)
    mounts = containers(pod)["splitfeed-sidecar"]["volumeMounts"]
    assert [x for x in mounts if not x["name"].startswith("splitfeed-")] == [
        {"name": "data", "mountPath": "/data", "readOnly": True}, {"name": "ckpt", "mountPath": "/ckpt/"}]
    kubernetes_validate.validate(pod, "1.30.0", strict=True)


@pytest.mark.parametrize("gpus, replica, rank", [(1, 0, 0), (1, 3, 3), (2, 3, 6), (4, 1, 4)])
def test_rank_environment(gpus, replica, rank):
    j = job(gpusPerReplica=gpus, replicas=2 if gpus == 4 else 4)
    c = containers(planning.pod(j, 5, replica, OWNER, NATIVE))
    for name in ("trainer", "splitfeed-sidecar"):
        env = env_of(c[name])
        assert env["WORLD_SIZE"] == str(j.world_size)
        assert env["NODE_RANK"] == str(replica)
        assert env["RANK"] == str(rank)
        assert env["LOCAL_RANK"] == "0"
        assert env["LOCAL_WORLD_SIZE"] == str(gpus)
        assert env["MASTER_ADDR"] == "resnet-w5-0.resnet"
        assert env["MASTER_PORT"] == "29500"
        assert env["SPLITFEED_SOCKET_DIR"] == "/var/run/splitfeed"
        assert env["SPLITFEED_WORLD_EPOCH"] == "5"


def test_torchrun_variables_only_for_the_trainer_and_only_with_several_gpus():
    one = containers(planning.pod(job(), 0, 1, OWNER, NATIVE))
    assert not any(k.startswith("PET_") for k in env_of(one["trainer"]))
    two = containers(planning.pod(job(gpusPerReplica=2, replicas=2), 0, 1, OWNER, NATIVE))
    env = env_of(two["trainer"])
    assert {k: v for k, v in env.items() if k.startswith("PET_")} == {
        "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "resnet-w0-0.resnet", "PET_MASTER_PORT": "29500"}
    assert not any(k.startswith("PET_") for k in env_of(two["splitfeed-sidecar"]))


def test_operator_env_wins_over_the_users_and_other_user_env_is_kept():
    env = containers(planning.pod(job(), 0, 2, OWNER, NATIVE))["trainer"]["env"]
    names = [e["name"] for e in env]
    assert names.count("RANK") == 1 and env_of({"env": env})["RANK"] == "2"
    assert env_of({"env": env})["KEEP"] == "1"


def test_sidecar_only_env_resume_coordinator_and_checksum():
    j = job()
    c = containers(planning.pod(j, 3, 2, OWNER, NATIVE))
    side, trainer = env_of(c["splitfeed-sidecar"]), env_of(c["trainer"])
    assert side["SPLITFEED_RESUME"] == "latest" and "SPLITFEED_RESUME_STEP" not in side
    assert side["SPLITFEED_COORDINATOR"] == "tcp://resnet-w3-0.resnet:29501"
    assert side["SPLITFEED_CONFIG_CHECKSUM"] == specs.data_config_checksum(j.data_config())
    for name in ("SPLITFEED_RESUME", "SPLITFEED_RESUME_STEP", "SPLITFEED_COORDINATOR", "SPLITFEED_CONFIG_CHECKSUM"):
        assert name not in trainer


def test_the_sidecars_temp_dir_is_its_writable_memory_volume():
    """Its root file system is read-only; the fork server of its loader workers needs a socket."""
    sidecar = containers(planning.pod(job(), 0, 0, OWNER, NATIVE))["splitfeed-sidecar"]
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    shm = next(m for m in sidecar["volumeMounts"] if m["name"] == "splitfeed-shm")
    assert env_of(sidecar)["TMPDIR"] == shm["mountPath"] and not shm.get("readOnly")


@pytest.mark.parametrize("step", [0, 7])
def test_a_resume_step_replaces_latest_in_every_sidecar_of_the_world(step):
    pods = [o for o in planning.world(job(), 1, OWNER, NATIVE, resume_step=step) if o["kind"] == "Pod"]
    for p in pods:
        side = env_of(containers(p)["splitfeed-sidecar"])
        assert side["SPLITFEED_RESUME_STEP"] == str(step) and "SPLITFEED_RESUME" not in side
        assert "SPLITFEED_RESUME_STEP" not in env_of(containers(p)["trainer"])
        kubernetes_validate.validate(p, "1.30.0", strict=True)


def test_config_map_carries_the_data_config_and_its_checksum_matches_the_sidecar_env():
    j = job()
    cm = planning.config_map(j, OWNER)
    assert cm["metadata"]["name"] == "resnet-data"
    config = json.loads(cm["data"]["config.json"])
    assert config == j.data_config()
    sidecar = containers(planning.pod(j, 0, 0, OWNER, NATIVE))["splitfeed-sidecar"]
    assert env_of(sidecar)["SPLITFEED_CONFIG_CHECKSUM"] == specs.data_config_checksum(config)


def test_no_secret_value_is_ever_in_a_config_map_or_env_literal():
    m = manifest()
    m["spec"]["data"]["storageOptions"] = {"region": "us-east-1"}
    j = specs.parse_job(m)
    blob = json.dumps(planning.world(j, 0, OWNER, NATIVE))
    assert "s3-creds" in blob  # the Secret's *name* is referenced ...
    for pod in planning.world(j, 0, OWNER, NATIVE)[2:]:
        for c in containers(pod).values():
            assert all("valueFrom" not in e for e in c["env"])  # ... its values never copied
    cm = planning.config_map(j, OWNER)
    assert "aws_secret_access_key" not in cm["data"]["config.json"]


def test_headless_service_selects_the_jobs_pods():
    svc = planning.service(job(), OWNER)
    assert svc["metadata"]["name"] == "resnet"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {"splitfeed.io/job": "resnet"}
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"rendezvous": 29500, "coordinator": 29501}


def test_pod_restart_policy_defaults_to_never_but_keeps_on_failure():
    assert planning.pod(job(), 0, 0, OWNER, NATIVE)["spec"]["restartPolicy"] == "Never"
    m = manifest()
    m["spec"]["trainer"]["template"]["spec"]["restartPolicy"] = "OnFailure"
    assert planning.pod(specs.parse_job(m), 0, 0, OWNER, NATIVE)["spec"]["restartPolicy"] == "OnFailure"


def test_sidecar_image_setting_overrides_the_spec_and_resources_are_copied():
    m = manifest()
    m["spec"]["sidecar"]["resources"] = {"limits": {"memory": "1Gi"}}
    j = specs.parse_job(m)
    side = containers(planning.pod(j, 0, 0, OWNER, planning.Settings(sidecar_image="reg/sf:9")))
    assert side["splitfeed-sidecar"]["image"] == "reg/sf:9"
    assert side["splitfeed-sidecar"]["resources"] == {"limits": {"memory": "1Gi"}}
    assert containers(planning.pod(j, 0, 0, OWNER, NATIVE))["splitfeed-sidecar"]["image"] == "splitfeed:0.1.0"


def test_building_does_not_mutate_the_template():
    j = job()
    before = json.dumps(j.trainer.template, sort_keys=True)
    planning.world(j, 0, OWNER, NATIVE)
    assert json.dumps(j.trainer.template, sort_keys=True) == before


def test_selector_string():
    assert planning.selector_string("resnet") == "splitfeed.io/job=resnet"


# --- security: the sidecar is "restricted"; the trainer gets nothing of it ------------------

@pytest.mark.parametrize("settings", [NATIVE, CONTAINER], ids=["native", "container"])
def test_the_sidecar_runs_with_the_restricted_security_context(settings):
    side = containers(planning.pod(job(), 0, 0, OWNER, settings))["splitfeed-sidecar"]
    assert side["securityContext"] == {
        "runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    assert "runAsUser" not in side["securityContext"]  # the pod's user or the image's: the ring is shared


def test_a_restricted_template_gives_restricted_pods_and_a_plain_one_is_flagged_only_for_its_own_parts():
    pod = planning.pod(specs.parse_job(restricted_manifest()), 0, 0, OWNER, NATIVE)
    assert pss.violations(pod) == []
    plain = pss.violations(planning.pod(job(), 0, 0, OWNER, NATIVE))
    assert plain and all(v.startswith(("trainer:", "pod:")) for v in plain), plain


def test_a_template_that_runs_the_pod_as_root_does_not_stop_the_sidecar_from_starting():
    m = manifest()
    m["spec"]["trainer"]["template"]["spec"]["securityContext"] = {"runAsUser": 0}
    side = containers(planning.pod(specs.parse_job(m), 0, 0, OWNER, NATIVE))["splitfeed-sidecar"]
    assert "runAsNonRoot" not in side["securityContext"]
    assert side["securityContext"]["allowPrivilegeEscalation"] is False


def test_the_checker_catches_what_the_restricted_profile_forbids():
    base = planning.pod(specs.parse_job(restricted_manifest()), 0, 0, OWNER, NATIVE)
    for mutate, rule in [
        (lambda p: p["spec"].update(hostNetwork=True), "pod: hostNetwork"),
        (lambda p: p["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "pod: volume h"),
        (lambda p: p["spec"]["containers"][0]["securityContext"].update(privileged=True), "trainer: privileged"),
        (lambda p: p["spec"]["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
         "trainer: allowPrivilegeEscalation"),
        (lambda p: p["spec"]["containers"][0]["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
         "trainer: capabilities.add"),
        (lambda p: p["spec"]["securityContext"].update(runAsUser=0), "pod: runAsUser 0"),
        (lambda p: p["spec"]["securityContext"].pop("seccompProfile"), "trainer: seccompProfile unset"),
    ]:
        pod = json.loads(json.dumps(base))
        mutate(pod)
        assert any(v.startswith(rule) for v in pss.violations(pod)), rule


def test_the_disruption_budget_lets_one_eviction_drain_the_current_world():
    j = job(replicas=4)
    pdb = planning.disruption_budget(j, 6, OWNER)
    kubernetes_validate.validate(pdb, "1.30.0", strict=True)
    assert pdb["metadata"]["name"] == "resnet" and pdb["metadata"]["ownerReferences"] == [OWNER.reference()]
    assert pdb["spec"] == {"minAvailable": 3, "unhealthyPodEvictionPolicy": "AlwaysAllow", "selector": {
        "matchLabels": {"splitfeed.io/job": "resnet", "splitfeed.io/world-epoch": "6"}}}
    pods = [o for o in planning.world(j, 6, OWNER, NATIVE) if o["kind"] == "Pod"]
    assert all(pdb["spec"]["selector"]["matchLabels"].items() <= p["metadata"]["labels"].items() for p in pods)
    assert planning.disruption_budget(job(replicas=1), 0, OWNER)["spec"]["minAvailable"] == 0


def test_controller_uid_reads_the_controlling_owner_reference():
    assert planning.controller_uid(planning.config_map(job(), OWNER)) == "uid-1"
    assert planning.controller_uid({"metadata": {"ownerReferences": [{"uid": "x", "controller": False}]}}) is None
    assert planning.controller_uid({"metadata": {}}) is None


def test_a_transforms_volume_of_the_template_is_mounted_into_the_sidecar_on_its_pythonpath():
    m = manifest()
    m["spec"]["data"]["transform"] = "my_transforms:decode"
    m["spec"]["trainer"]["template"]["spec"]["volumes"] = [
        {"name": "splitfeed-transforms", "configMap": {"name": "resnet-transforms"}}]
    pod = planning.pod(specs.parse_job(m), 0, 1, OWNER, NATIVE)
    kubernetes_validate.validate(pod, "1.30.0", strict=True)
    sidecar = containers(pod)["splitfeed-sidecar"]
    assert {"name": "splitfeed-transforms", "mountPath": "/etc/splitfeed/transforms",
            "readOnly": True} in sidecar["volumeMounts"]
    assert env_of(sidecar)["PYTHONPATH"] == "/etc/splitfeed/transforms"
    assert "PYTHONPATH" not in env_of(containers(pod)["trainer"])
    plain = containers(planning.pod(job(), 0, 1, OWNER, NATIVE))["splitfeed-sidecar"]
    assert "PYTHONPATH" not in env_of(plain)
    assert all(v["name"] != "splitfeed-transforms" for v in plain["volumeMounts"])
