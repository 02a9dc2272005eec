"""Pod, Service and ConfigMap building: docs/pod-contract.md, checked against Kubernetes 1.30 schemas."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from splitfeed.operator.objects import admission, planning, security
from splitfeed.trainer_client.contract import wellknown, specs
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
            assert not [v for v in broken if v.startswith(wellknown.SIDECAR_NAME)], broken
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
    return {e["name"]: e.get("value") for e in container.get("env", [])}


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
                      "splitfeed-podinfo": "/etc/splitfeed/podinfo", "splitfeed-storage": "/etc/splitfeed/storage",
                      "splitfeed-keys": "/etc/splitfeed/keys"}
    assert {m["name"]: m["mountPath"] for m in c["trainer"]["volumeMounts"]} == {
        "splitfeed-shm": "/var/run/splitfeed", "splitfeed-keys": "/etc/splitfeed/keys"}
    # The job's keypair (its Secret has the job's UID in its name), read-only, and named in both.
    assert vols["splitfeed-keys"]["secret"] == {"secretName": planning.keys_secret_name("resnet", OWNER.uid),
                                                "defaultMode": 0o440}
    for name in ("splitfeed-sidecar", "trainer"):
        assert [m.get("readOnly") for m in c[name]["volumeMounts"] if m["name"] == "splitfeed-keys"] == [True]
        assert {e["name"]: e.get("value") for e in c[name]["env"]}["SPLITFEED_KEYS_DIR"] == "/etc/splitfeed/keys"


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


# --- identity: a job without storageOptionsSecret reads through the pod's service account ----

ROLE_ARN = "arn:aws:iam::111122223333:role/splitfeed-reader"
EKS_MOUNT = "/var/run/secrets/eks.amazonaws.com/serviceaccount"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "credentials"


def identity_manifest(**template_spec):
    """A job with no storage Secret whose template names a service account."""
    m = manifest()
    del m["spec"]["data"]["storageOptionsSecret"]
    m["spec"]["trainer"]["template"]["spec"].update({"serviceAccountName": "s3-reader", **template_spec})
    return m


def eks_pod_identity_webhook(pod, service_accounts, region="us-east-1"):
    """A stand-in for EKS's pod-identity webhook (amazon-eks-pod-identity-webhook,
    pkg/handler/handler.go) on a pod being created: when the pod's service account carries
    `eks.amazonaws.com/role-arn`, every init and regular container not named in the pod's
    `eks.amazonaws.com/skip-containers` annotation gets AWS_ROLE_ARN and
    AWS_WEB_IDENTITY_TOKEN_FILE (unless it sets either), AWS_REGION and AWS_DEFAULT_REGION
    (unless it sets either), AWS_STS_REGIONAL_ENDPOINTS (when the account asks for it and
    the container does not set it) and a read-only mount of `aws-iam-token` (unless it
    mounts that volume), and the pod gets the projected token volume (unless it has one)."""
    pod = copy.deepcopy(pod)
    spec = pod["spec"]
    account = service_accounts.get(spec.get("serviceAccountName") or "default") or {}
    notes = (account.get("metadata") or {}).get("annotations") or {}
    role = notes.get("eks.amazonaws.com/role-arn")
    if not role:
        return pod
    skip = set(((pod["metadata"].get("annotations") or {}).get("eks.amazonaws.com/skip-containers") or "").split(","))
    for key in ("initContainers", "containers"):
        for c in spec.get(key) or []:
            if c["name"] in skip:
                continue
            names = {e["name"] for e in c.get("env") or []}
            env = c.setdefault("env", [])
            if notes.get("eks.amazonaws.com/sts-regional-endpoints") == "true" \
                    and "AWS_STS_REGIONAL_ENDPOINTS" not in names:
                env.append({"name": "AWS_STS_REGIONAL_ENDPOINTS", "value": "regional"})
            if not names & {"AWS_REGION", "AWS_DEFAULT_REGION"}:
                env += [{"name": "AWS_DEFAULT_REGION", "value": region}, {"name": "AWS_REGION", "value": region}]
            if not names & {"AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"}:
                env += [{"name": "AWS_ROLE_ARN", "value": role},
                        {"name": "AWS_WEB_IDENTITY_TOKEN_FILE", "value": f"{EKS_MOUNT}/token"}]
            if not any(m["name"] == "aws-iam-token" for m in c.get("volumeMounts") or []):
                c.setdefault("volumeMounts", []).append(
                    {"name": "aws-iam-token", "mountPath": EKS_MOUNT, "readOnly": True})
    if not any(v["name"] == "aws-iam-token" for v in spec.get("volumes") or []):
        spec.setdefault("volumes", []).insert(0, {"name": "aws-iam-token", "projected": {"sources": [
            {"serviceAccountToken": {"audience": "sts.amazonaws.com", "expirationSeconds": 86400, "path": "token"}}]}})
    return pod


SA_READER = {"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": "s3-reader", "namespace": "ns",
                          "annotations": {"eks.amazonaws.com/role-arn": ROLE_ARN}}}


def token_file(pod, volume):
    """(owner uid, group, mode) of the service-account token in projected volume `volume` as
    the kubelet (1.19+) writes it: the volume's defaultMode (0644 by default), but 0600 when
    the pod has fsGroup or one runAsUser for every container (FsUserFrom: then owned by that
    user); with fsGroup the file is then group-owned by it and group-readable (0640)."""
    spec = pod["spec"]
    pod_sc = spec.get("securityContext") or {}
    users = {(c.get("securityContext") or {}).get("runAsUser", pod_sc.get("runAsUser"))
             for c in spec.get("initContainers", []) + spec["containers"]}
    fs_user = users.pop() if len(users) == 1 and None not in users else None
    fs_group = pod_sc.get("fsGroup")
    projected = next(v for v in spec["volumes"] if v["name"] == volume)["projected"]
    mode = projected.get("defaultMode", 0o644)
    if fs_user is not None or fs_group is not None:
        mode = 0o600
    if fs_group is not None:
        mode |= 0o040
    return (fs_user if fs_user is not None else 0), (fs_group if fs_group is not None else 0), mode


def can_read(pod, container, path):
    """Whether `container`'s process (its or the pod's runAsUser, else the image's 65532; its
    groups: the primary, fsGroup and supplementalGroups) may read the token file at `path`."""
    spec = pod["spec"]
    pod_sc = spec.get("securityContext") or {}
    sc = container.get("securityContext") or {}
    uid = sc.get("runAsUser", pod_sc.get("runAsUser", security.LOADER_GROUP))
    groups = {sc.get("runAsGroup", pod_sc.get("runAsGroup", security.LOADER_GROUP)),
              *([pod_sc["fsGroup"]] if "fsGroup" in pod_sc else []), *(pod_sc.get("supplementalGroups") or [])}
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    owner, group, mode = token_file(pod, mount["name"])
    if uid == 0:
        return True
    if uid == owner:
        return bool(mode & 0o400)
    return bool(mode & (0o040 if group in groups else 0o004))


@pytest.mark.parametrize("automount", [None, False, True])
@pytest.mark.parametrize("settings", [NATIVE, CONTAINER], ids=["native", "container"])
def test_the_templates_service_account_reaches_the_pod_unchanged(settings, automount):
    extra = {} if automount is None else {"automountServiceAccountToken": automount}
    pod = planning.pod(specs.parse_job(identity_manifest(**extra)), 2, 1, OWNER, settings)
    assert pod["spec"]["serviceAccountName"] == "s3-reader"
    assert pod["spec"].get("automountServiceAccountToken") == automount
    kubernetes_validate.validate(pod, "1.30.0", strict=True)
    plain = planning.pod(job(), 0, 0, OWNER, settings)["spec"]
    assert "serviceAccountName" not in plain and "automountServiceAccountToken" not in plain


def test_the_pod_gets_fs_group_65532_unless_its_template_sets_one():
    assert planning.pod(job(), 0, 0, OWNER, NATIVE)["spec"]["securityContext"] == {
        "fsGroup": 65532, "fsGroupChangePolicy": "OnRootMismatch"}
    restricted = planning.pod(specs.parse_job(restricted_manifest()), 0, 0, OWNER, NATIVE)
    assert restricted["spec"]["securityContext"] == {
        **pss.RESTRICTED_POD_SECURITY, "fsGroup": 65532, "fsGroupChangePolicy": "OnRootMismatch"}
    for own, built in [({"fsGroup": 2000}, {"fsGroup": 2000}),
                       ({"fsGroup": 2000, "fsGroupChangePolicy": "Always"},
                        {"fsGroup": 2000, "fsGroupChangePolicy": "Always"}),
                       ({"fsGroupChangePolicy": "Always"}, {"fsGroup": 65532, "fsGroupChangePolicy": "Always"}),
                       ({"runAsUser": 1000, "supplementalGroups": [7]},
                        {"runAsUser": 1000, "supplementalGroups": [7], "fsGroup": 65532,
                         "fsGroupChangePolicy": "OnRootMismatch"})]:
        m = manifest()
        m["spec"]["trainer"]["template"]["spec"]["securityContext"] = own
        pod = planning.pod(specs.parse_job(m), 0, 0, OWNER, NATIVE)
        assert pod["spec"]["securityContext"] == built, own
        kubernetes_validate.validate(pod, "1.30.0", strict=True)


@pytest.mark.parametrize("restricted", [False, True], ids=["plain", "restricted"])
@pytest.mark.parametrize("settings", [NATIVE, CONTAINER], ids=["native", "container"])
def test_the_eks_webhook_injects_the_role_into_the_sidecar_and_its_user_can_read_the_token(settings, restricted):
    m = identity_manifest()
    if restricted:
        m = restricted_manifest()
        del m["spec"]["data"]["storageOptionsSecret"]
        m["spec"]["trainer"]["template"]["spec"]["serviceAccountName"] = "s3-reader"
    built = planning.pod(specs.parse_job(m), 0, 1, OWNER, settings)
    sidecar_before = containers(built)["splitfeed-sidecar"]
    assert not {e["name"] for e in sidecar_before["env"]} & {"AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"}
    pod = eks_pod_identity_webhook(built, {"s3-reader": SA_READER})
    kubernetes_validate.validate(pod, "1.30.0", strict=True)  # what the webhook added is a valid pod
    assert pss.violations(pod) == ([] if restricted else pss.violations(built))
    for name in ("trainer", "splitfeed-sidecar"):
        c = containers(pod)[name]
        env = env_of(c)
        assert env["AWS_ROLE_ARN"] == ROLE_ARN
        assert env["AWS_WEB_IDENTITY_TOKEN_FILE"] == f"{EKS_MOUNT}/token"
        assert env["AWS_REGION"] == "us-east-1"
        assert {"name": "aws-iam-token", "mountPath": EKS_MOUNT, "readOnly": True} in c["volumeMounts"]
        assert can_read(pod, c, env["AWS_WEB_IDENTITY_TOKEN_FILE"]), name
    assert pod["spec"]["securityContext"]["fsGroup"] == 65532
    # The sidecar's own contract env survives the webhook.
    assert env_of(containers(pod)["splitfeed-sidecar"])["SPLITFEED_COORDINATOR"] == "tcp://resnet-w0-0.resnet:29501"


def test_the_eks_webhook_leaves_a_pod_alone_whose_service_account_has_no_role():
    built = planning.pod(specs.parse_job(identity_manifest()), 0, 0, OWNER, NATIVE)
    assert eks_pod_identity_webhook(built, {"s3-reader": {"metadata": {"name": "s3-reader"}}}) == built
    assert eks_pod_identity_webhook(planning.pod(job(), 0, 0, OWNER, NATIVE), {"s3-reader": SA_READER}) \
        == planning.pod(job(), 0, 0, OWNER, NATIVE)  # no serviceAccountName: "default", no role


def explicit_identity_manifest(default_mode=None):
    """A cluster without the webhook: the user wrote the IRSA variables, a token volume, a GCP
    key file and an Azure client id on the trainer, beside settings of its own."""
    m = identity_manifest()
    tpl = m["spec"]["trainer"]["template"]["spec"]
    token = {"sources": [{"serviceAccountToken": {"audience": "sts.amazonaws.com", "path": "token"}}]}
    if default_mode is not None:
        token["defaultMode"] = default_mode
    tpl["volumes"] = [{"name": "aws-iam-token", "projected": token},
                      {"name": "gcp-key", "secret": {"secretName": "gcp-key"}},
                      {"name": "model-out", "persistentVolumeClaim": {"claimName": "models"}}]
    trainer = tpl["containers"][0]
    trainer["env"] += [
        {"name": "AWS_ROLE_ARN", "value": ROLE_ARN},
        {"name": "AWS_WEB_IDENTITY_TOKEN_FILE", "value": f"{EKS_MOUNT}/token"},
        {"name": "AWS_REGION", "value": "eu-west-1"},
        {"name": "GOOGLE_APPLICATION_CREDENTIALS", "value": "/var/secrets/google/key.json"},
        {"name": "AZURE_CLIENT_ID", "valueFrom": {"configMapKeyRef": {"name": "azure", "key": "client-id"}}},
        {"name": "NCCL_DEBUG", "value": "WARN"}]
    trainer["volumeMounts"] = [{"name": "aws-iam-token", "mountPath": EKS_MOUNT, "readOnly": True},
                               {"name": "gcp-key", "mountPath": "/var/secrets/google", "readOnly": True},
                               {"name": "model-out", "mountPath": "/models"}]
    return m


@pytest.mark.parametrize("settings", [NATIVE, CONTAINER], ids=["native", "container"])
def test_the_sidecar_gets_the_identity_the_user_wrote_on_the_trainer(settings):
    m = explicit_identity_manifest()
    pod = planning.pod(specs.parse_job(m), 0, 0, OWNER, settings)
    kubernetes_validate.validate(pod, "1.30.0", strict=True)
    c = containers(pod)
    trainer_env = {e["name"]: e for e in c["trainer"]["env"]}
    sidecar_env = {e["name"]: e for e in c["splitfeed-sidecar"]["env"]}
    for name in ("AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_REGION", "GOOGLE_APPLICATION_CREDENTIALS",
                 "AZURE_CLIENT_ID"):
        assert sidecar_env[name] == trainer_env[name], name  # a valueFrom stays a reference
    assert "NCCL_DEBUG" not in sidecar_env and "KEEP" not in sidecar_env
    own = [m for m in c["splitfeed-sidecar"]["volumeMounts"] if not m["name"].startswith("splitfeed-")]
    assert own == [{"name": "aws-iam-token", "mountPath": EKS_MOUNT, "readOnly": True},
                   {"name": "gcp-key", "mountPath": "/var/secrets/google", "readOnly": True}]
    # The webhook, if the cluster has one after all, then adds nothing that conflicts.
    hooked = eks_pod_identity_webhook(pod, {"s3-reader": SA_READER})
    kubernetes_validate.validate(hooked, "1.30.0", strict=True)
    for name in ("trainer", "splitfeed-sidecar"):
        assert env_of(containers(hooked)[name])["AWS_REGION"] == "eu-west-1"
        assert [e["name"] for e in containers(hooked)[name]["env"]].count("AWS_ROLE_ARN") == 1


def test_a_strict_token_mode_is_readable_by_the_sidecar_through_the_pods_fs_group():
    """A token volume with defaultMode 0400 is root's alone, unless the pod has fsGroup."""
    pod = planning.pod(specs.parse_job(explicit_identity_manifest(default_mode=0o400)), 0, 0, OWNER, NATIVE)
    sidecar = containers(pod)["splitfeed-sidecar"]
    assert can_read(pod, sidecar, f"{EKS_MOUNT}/token")
    without = copy.deepcopy(pod)
    del without["spec"]["securityContext"]["fsGroup"]
    assert not can_read(without, sidecar, f"{EKS_MOUNT}/token")  # the model would catch a missing fsGroup
    m = explicit_identity_manifest(default_mode=0o400)
    m["spec"]["trainer"]["template"]["spec"]["securityContext"] = {"fsGroup": 3000}
    own = planning.pod(specs.parse_job(m), 0, 0, OWNER, NATIVE)
    assert own["spec"]["securityContext"] == {"fsGroup": 3000}
    assert can_read(own, containers(own)["splitfeed-sidecar"], f"{EKS_MOUNT}/token")


def test_the_sidecar_keeps_its_own_variables_and_mount_paths_over_the_trainers():
    sidecar = {"name": "splitfeed-sidecar", "env": [{"name": "AWS_REGION", "value": "ours"}],
               "volumeMounts": [{"name": "data", "mountPath": "/data"}]}
    trainer = {"name": "trainer",
               "env": [{"name": "AWS_REGION", "value": "theirs"}, {"name": "AWS_SHARED_CREDENTIALS_FILE",
                                                                   "value": "/data/aws/credentials"},
                       {"name": "AZURE_FEDERATED_TOKEN_FILE", "value": "/var/run/secrets/azure/tokens/token"},
                       {"name": "GOOGLE_CLOUD_PROJECT", "value": "p"}, {"name": "PATH", "value": "/x"}],
               "envFrom": [{"secretRef": {"name": "everything"}}],
               "volumeMounts": [{"name": "other", "mountPath": "/data/"},
                                {"name": "azure-identity-token", "mountPath": "/var/run/secrets/azure/tokens",
                                 "readOnly": True, "mountPropagation": "None"},
                                {"name": "scratch", "mountPath": "/scratch"}]}
    before = copy.deepcopy((sidecar, trainer))
    out = security.with_trainer_identity(sidecar, trainer, [])
    assert (sidecar, trainer) == before  # pure
    assert out["env"] == [{"name": "AWS_REGION", "value": "ours"}, trainer["env"][1], trainer["env"][2],
                          trainer["env"][3]]
    assert out["volumeMounts"] == [{"name": "data", "mountPath": "/data"},  # /data/ is taken: not the trainer's
                                   {"name": "azure-identity-token", "mountPath": "/var/run/secrets/azure/tokens",
                                    "readOnly": True}]
    assert "envFrom" not in out
    token_volume = {"name": "scratch", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}
    assert {"name": "scratch", "mountPath": "/scratch"} in \
        security.with_trainer_identity(sidecar, trainer, [token_volume])["volumeMounts"]


# --- the credentials examples (docs/credentials.md) -------------------------------------------

def example(name):
    return list(yaml.safe_load_all((EXAMPLES / name).read_text()))


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_credentials_example_is_admitted_and_builds_valid_pods(name):
    docs = example(name)
    jobs = [d for d in docs if d["kind"] == "StreamingJob"]
    assert len(jobs) == 1
    for d in docs:
        if d["kind"] != "StreamingJob":
            kubernetes_validate.validate(d, "1.30.0", strict=True)
            assert d["kind"] != "Secret", "no Secret in an example: the user creates it"
    j = admission.review_job(jobs[0])
    for settings in (NATIVE, CONTAINER):
        for p in planning.world(j, 0, OWNER, settings)[3:]:
            kubernetes_validate.validate(p, "1.30.0", strict=True)
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    wanted = (j.trainer.template.get("spec") or {}).get("serviceAccountName")
    assert (wanted in accounts) == (j.data.storage_options_secret is None), "identity, or a Secret"


def test_the_irsa_example_gives_the_sidecar_its_role_through_the_webhook():
    docs = example("s3-irsa.yaml")
    j = admission.review_job(next(d for d in docs if d["kind"] == "StreamingJob"))
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    pod = eks_pod_identity_webhook(planning.pod(j, 0, 0, OWNER, NATIVE), accounts)
    sidecar = containers(pod)["splitfeed-sidecar"]
    assert env_of(sidecar)["AWS_ROLE_ARN"].startswith("arn:aws:iam::")
    assert can_read(pod, sidecar, env_of(sidecar)["AWS_WEB_IDENTITY_TOKEN_FILE"])
    assert "--storage-options-dir" not in sidecar["args"]


def test_the_gcs_example_names_a_workload_identity_account_and_shares_its_checkpoint_volume():
    docs = example("gcs-workload-identity.yaml")
    (account,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    assert account["metadata"]["annotations"]["iam.gke.io/gcp-service-account"].endswith(".iam.gserviceaccount.com")
    j = admission.review_job(next(d for d in docs if d["kind"] == "StreamingJob"))
    sidecar = containers(planning.pod(j, 0, 0, OWNER, NATIVE))["splitfeed-sidecar"]
    assert {"name": "checkpoints", "mountPath": "/checkpoints"} in sidecar["volumeMounts"]


def test_the_endpoint_example_keeps_keys_in_the_secret_and_the_endpoint_in_storage_options():
    (doc,) = example("r2-endpoint.yaml")
    data = doc["spec"]["data"]
    assert data["storageOptionsSecret"] == "r2-creds"
    assert data["storageOptions"]["aws_endpoint"].endswith(".r2.cloudflarestorage.com")
    assert data["storageOptions"]["aws_region"] == "auto"
    admission.check_storage_options(specs.parse_job(doc))  # nothing that looks like a credential
