"""The objects of a world, built from a StreamingJob: pods, headless Service, ConfigMap, budget,
keypair Secret and (operator/objects/policies.py) NetworkPolicy. Who the sidecar runs as in a pod
is operator/objects/security.py; a world's ports and rank environment follow from its value,
trainer_client/contract/layout.py's WorldLayout (`world_layout`).

Pure: a JobSpec, a world epoch and the operator's settings in, plain dicts out.
Called by the life cycle (`lifecycle`, which decides *when* a world starts) and by the tests,
which validate every object against the Kubernetes schemas. What goes into a pod
is docs/pod-contract.md; change that document and this module together.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from splitfeed.trainer_client.contract import wellknown, errors, layout, membership, specs
from splitfeed.trainer_client.transport import keys

from . import policies, security

SCRAPE_ANNOTATIONS = {"prometheus.io/scrape": "true", "prometheus.io/port": str(wellknown.METRICS_PORT),
                      "prometheus.io/path": "/metrics"}
"""On every pod, unless the trainer's template sets its own (its trainer's metrics, say)."""

SidecarMode = Literal["native", "container"]


@dataclasses.dataclass(frozen=True)
class Owner:
    """The StreamingJob that owns every object of its worlds (for the garbage collector)."""

    name: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": wellknown.API_VERSION,
            "kind": specs.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclasses.dataclass(frozen=True)
class Settings:
    """Operator-wide choices that are not part of a job's spec."""

    sidecar_mode: SidecarMode = "native"
    """native: an initContainer with restartPolicy Always (Kubernetes >= 1.29);
    container: a plain container, for older clusters."""
    sidecar_image: str | None = None
    """Overrides spec.sidecar.image for every job (pinning the loader to the operator)."""
    sidecar_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """spec.sidecar fields (wire names: image, shmSize, prefetchBatches) for jobs that omit
    them; the Helm chart sets them through SPLITFEED_SIDECAR_* (the CRD has no defaults)."""
    restart_backoff_s: float = 10.0
    """Back-off before the world that replaces a failed one starts, doubled per restart
    already counted (10 s, 20 s, 40 s, ... like a Kubernetes Job's); also the first wait
    after an object of a world could not be created."""
    restart_backoff_max_s: float = 360.0
    """The back-off never exceeds this (a Job's cap: 6 minutes)."""
    stall_timeout_s: float = 900.0
    """A world whose pods have not all been running for this long is marked Stalled."""
    network_policy: policies.NetworkPolicy | None = None
    """Who besides a job's own pods may reach them (operator/objects/policies.py); None: the operator
    makes no NetworkPolicy (the command line's default; the Helm chart turns it on)."""

    def backoff_s(self, attempt: int) -> float:
        """The wait before attempt `attempt` (1: the first retry) of a restart or a creation."""
        if attempt < 1 or self.restart_backoff_s <= 0:
            return 0.0
        return float(min(self.restart_backoff_s * 2 ** min(attempt - 1, 30), self.restart_backoff_max_s))

    @classmethod
    def from_env(cls, env: Mapping[str, str], **kwargs: Any) -> "Settings":
        defaults: dict[str, Any] = {}
        for var, key in (("SPLITFEED_SIDECAR_IMAGE", "image"), ("SPLITFEED_SIDECAR_SHM_SIZE", "shmSize"),
                         ("SPLITFEED_SIDECAR_PREFETCH_BATCHES", "prefetchBatches")):
            if env.get(var):
                defaults[key] = int(env[var]) if key == "prefetchBatches" else env[var]
        return cls(sidecar_defaults=defaults, **kwargs)


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    """The UID of the object's controller (the ownerReference with controller: true), if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller"):
            return str(ref.get("uid"))
    return None


def pod_name(job: str, world_epoch: int, replica: int, in_place: bool = False) -> str:
    """`<job>-w<epoch>-<replica>`; `<job>-r<replica>` when pods outlive their world
    (spec.rescale inPlace): a kept pod's name, hostname and DNS name never change."""
    return f"{job}-r{replica}" if in_place else f"{job}-w{world_epoch}-{replica}"


def pod_name_of(job: specs.JobSpec, world_epoch: int, replica: int) -> str:
    return pod_name(job.name, world_epoch, replica, job.in_place)


def world_layout(job: specs.JobSpec, world_epoch: int) -> layout.WorldLayout:
    """World `world_epoch` of `job`: replica 0 by its stable name under the headless Service,
    on the job's ports (the other pair in odd worlds in place, layout.WorldLayout.at)."""
    return layout.WorldLayout.at(world_epoch, replicas=job.replicas, gpus_per_replica=job.gpus_per_replica,
                                 in_place=job.in_place, master_addr=f"{pod_name_of(job, world_epoch, 0)}.{job.name}")


def config_map_name(job: str) -> str:
    return f"{job}-data"


def job_selector(job: str) -> dict[str, str]:
    return {wellknown.LABEL_JOB: job}


def selector_string(job: str) -> str:
    """status.selector: what the scale subresource (and HPA) uses to count pods."""
    return ",".join(f"{k}={v}" for k, v in job_selector(job).items())


def config_json(job: specs.JobSpec) -> str:
    return json.dumps(job.data_config(), sort_keys=True, indent=2)


def config_checksum(job: specs.JobSpec) -> str:
    return specs.data_config_checksum(job.data_config())


def _meta(job: specs.JobSpec, name: str, owner: Owner, labels: Mapping[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": dict(labels),
        "ownerReferences": [owner.reference()],
    }


def keys_secret_name(job: str, uid: str) -> str:
    """`<job>-keys-<uid prefix>`: the job's CURVE keypair. The UID is in the name so that a
    job deleted and created again gets a new keypair, never its predecessor's (whose Secret
    the garbage collector removes with it)."""
    return f"{job}-keys-{uid[:8]}" if uid else f"{job}-keys"


def keys_secret(namespace: str, owner: Owner, keypair: keys.Keypair) -> dict[str, Any]:
    """The job's keypair (trainer_client.keys) as an immutable Secret owned by the job: its
    sidecars serve and its trainers and the operator ask the world's coordinator with it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "immutable": True,
        "metadata": {"name": keys_secret_name(owner.name, owner.uid), "namespace": namespace,
                     "labels": job_selector(owner.name), "ownerReferences": [owner.reference()]},
        "data": {wellknown.KEY_PUBLIC: base64.b64encode(keypair.public).decode(),
                 wellknown.KEY_SECRET: base64.b64encode(keypair.secret).decode()},
    }


def keypair_of(secret: Mapping[str, Any]) -> keys.Keypair:
    """The keypair a `keys_secret` holds; a UserError naming the Secret when it is damaged."""
    name = (secret.get("metadata") or {}).get("name", "")
    data = secret.get("data") or {}
    try:
        public, private = (base64.b64decode(data[k], validate=True) for k in (wellknown.KEY_PUBLIC, wellknown.KEY_SECRET))
    except (KeyError, TypeError, ValueError) as exc:
        raise errors.UserError(f"Secret {name}: no base64 {wellknown.KEY_PUBLIC} and {wellknown.KEY_SECRET} "
                               f"({exc}); delete it and the operator makes a new keypair") from exc
    return keys.parse(public, private, f"Secret {name}")


KEYS_FILE_MODE = 0o440
"""The keypair's files in a pod: read-only, to the pod's fsGroup (security.pod_security_context), which
the sidecar's user and the trainer's share; nobody else on the node."""


def keys_volume(job: str, uid: str) -> dict[str, Any]:
    return {"name": wellknown.VOLUME_KEYS,
            "secret": {"secretName": keys_secret_name(job, uid), "defaultMode": KEYS_FILE_MODE}}


def keys_mount() -> dict[str, Any]:
    return {"name": wellknown.VOLUME_KEYS, "mountPath": wellknown.KEYS_DIR, "readOnly": True}


def config_map(job: specs.JobSpec, owner: Owner) -> dict[str, Any]:
    """`<job>-data`: the loader's view of the job. Never credentials (see storage secret)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            **_meta(job, config_map_name(job.name), owner, job_selector(job.name)),
            "annotations": {wellknown.ANNOTATION_CHECKSUM: config_checksum(job)},
        },
        "data": {wellknown.CONFIG_FILE: config_json(job)},
    }


def service(job: specs.JobSpec, owner: Owner) -> dict[str, Any]:
    """Headless Service `<job>`: stable DNS `<pod>.<job>` for MASTER_ADDR, also before Ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, job.name, owner, job_selector(job.name)),
        "spec": {
            "clusterIP": "None",
            "selector": job_selector(job.name),
            "publishNotReadyAddresses": True,
            "ports": [{"name": f"{name}{suffix}", "port": port, "targetPort": port}
                      for suffix, world in zip(("", "-odd"), world_layout(job, 0).alternating())
                      for name, port in (("rendezvous", world.master_port), ("coordinator", world.coordinator_port))],
        },
    }


def _env(items: Mapping[str, str | int]) -> list[dict[str, str]]:
    return [{"name": k, "value": str(v)} for k, v in items.items()]


def _merge_env(existing: list[dict[str, Any]], ours: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The user's env with ours appended; ours wins on a name clash (it is the contract)."""
    names = {e["name"] for e in ours}
    return [e for e in existing if e.get("name") not in names] + ours


def pod_env(job: specs.JobSpec, world_epoch: int, replica: int) -> wellknown.Env:
    """Environment both containers get (docs/pod-contract.md, "Environment")."""
    return world_layout(job, world_epoch).env(replica)


def trainer_env(job: specs.JobSpec, world_epoch: int, replica: int) -> wellknown.Env:
    world = world_layout(job, world_epoch)
    return {**world.env(replica), wellknown.KEYS_DIR_ENV: wellknown.KEYS_DIR, **world.torchrun_env(replica)}


def _local_path(uri: str | None) -> str | None:
    if not uri:
        return None
    if uri.startswith("file://"):
        return uri[len("file://"):]
    return uri if uri.startswith("/") else None


def shared_mounts(job: specs.JobSpec, trainer_mounts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trainer's volume mounts that hold a local data.uri or checkpoint.uri.

    The loader reads the table and writes checkpoints there too, so it gets the
    same mounts (a hostPath or a PVC on a development cluster; object storage
    needs none). Without them a local path would name the sidecar's own image.
    """
    paths = [p for p in (_local_path(job.data.uri), _local_path(job.checkpoint.uri)) if p]
    out: list[dict[str, Any]] = []
    for m in trainer_mounts:
        mount = str(m.get("mountPath", "")).rstrip("/")
        if mount and any(p == mount or p.startswith(mount + "/") for p in paths):
            shared: dict[str, Any] = {k: m[k] for k in ("name", "mountPath", "subPath", "readOnly") if k in m}
            if shared not in out:
                out.append(shared)
    return out


def coordinator_of(job: str, world_epoch: int, pods: Sequence[Mapping[str, Any]],
                   in_place: bool = False) -> str | None:
    """World `world_epoch`'s coordinator: replica 0's pod, found by its name (a kept pod's world
    label follows a change in place late), at that world's port; None while the pod has no IP
    or has stopped."""
    name = pod_name(job, world_epoch, 0, in_place)
    world = layout.WorldLayout.at(world_epoch, in_place=in_place)  # its ports; its size does not matter here
    for p in pods:
        status = p.get("status") or {}
        if (p.get("metadata") or {}).get("name") == name and status.get("podIP") \
                and status.get("phase") in ("Pending", "Running"):
            return world.coordinator_at(str(status["podIP"]))
    return None


def sidecar_container(
    job: specs.JobSpec, world_epoch: int, replica: int, settings: Settings,
    extra_mounts: list[dict[str, Any]] | None = None, resume_step: int | None = None,
    job_uid: str = "", table_version: int | None = None,
) -> dict[str, Any]:
    """The loader. `resume_step`: the step the previous world agreed on (status.resumeStep);
    None lets the new world's coordinator pick the newest complete checkpoint. `job_uid`:
    the StreamingJob's metadata.uid, which keys its checkpoints (a re-created job's are new)."""
    args = ["sidecar", "--config", f"{wellknown.CONFIG_DIR}/{wellknown.CONFIG_FILE}",
            "--podinfo-dir", wellknown.PODINFO_DIR]
    mounts = [
        {"name": wellknown.VOLUME_SHM, "mountPath": wellknown.SOCKET_DIR},
        {"name": wellknown.VOLUME_CONFIG, "mountPath": wellknown.CONFIG_DIR, "readOnly": True},
        {"name": wellknown.VOLUME_PODINFO, "mountPath": wellknown.PODINFO_DIR, "readOnly": True},
    ]
    if job.data.storage_options_secret:
        args += ["--storage-options-dir", wellknown.STORAGE_DIR]
        mounts.append({"name": wellknown.VOLUME_STORAGE, "mountPath": wellknown.STORAGE_DIR, "readOnly": True})
    mounts.append(keys_mount())
    mounts += [copy.deepcopy(m) for m in extra_mounts or []]
    args += ["--termination-log", wellknown.TERMINATION_LOG]
    world = world_layout(job, world_epoch)
    env = {
        **world.env(replica),
        **wellknown.sidecar_env(
            coordinator=world.coordinator, job_uid=job_uid, resume_step=resume_step,
            table_version=table_version, config_checksum=config_checksum(job)),
        wellknown.METRICS_PORT_ENV: str(wellknown.METRICS_PORT),
        wellknown.KEYS_DIR_ENV: wellknown.KEYS_DIR,
        # Its only writable directory (the root file system is read-only): multiprocessing's
        # fork server, which starts the numWorkers loader processes, puts its socket there.
        "TMPDIR": wellknown.SOCKET_DIR,
    }
    if any(m.get("name") == wellknown.VOLUME_TRANSFORMS for m in extra_mounts or []):
        env["PYTHONPATH"] = wellknown.TRANSFORMS_DIR
    container: dict[str, Any] = {
        "name": wellknown.SIDECAR_NAME,
        "image": settings.sidecar_image or job.sidecar.image,
        "command": ["splitfeed"],
        "args": args,
        "env": _env(env),
        "ports": [{"name": "metrics", "containerPort": wellknown.METRICS_PORT, "protocol": "TCP"}],
        "volumeMounts": mounts,
        "resources": copy.deepcopy(dict(job.sidecar.resources)),
        "terminationMessagePath": wellknown.TERMINATION_LOG,
        "terminationMessagePolicy": "File",
        # Ready once every local rank's trainer has imported and said hello (membership.WAITING):
        # an in-place scale-up asks the world to drain only then (operator/lifecycle/inplace.py).
        "readinessProbe": {"exec": {"command": trainers_waiting(job)}, "periodSeconds": 1,
                           "timeoutSeconds": 1},
        "securityContext": security.sidecar_security_context(job),
    }
    if settings.sidecar_mode == "native":
        container["restartPolicy"] = "Always"
    return container


def trainers_waiting(job: specs.JobSpec) -> list[str]:
    """A probe command: true once each local rank's trainer made its waiting file."""
    files = [f"{wellknown.SOCKET_DIR}/{membership.WAITING.format(local_rank=r)}" for r in range(job.gpus_per_replica)]
    command = ["test", "-e", files[0]]
    for f in files[1:]:
        command += ["-a", "-e", f]
    return command


def network_policy(job: specs.JobSpec, owner: Owner, settings: policies.NetworkPolicy) -> dict[str, Any]:
    """NetworkPolicy `<job>`: one for the job, covering every world's pods (operator/objects/policies.py)."""
    return policies.network_policy(job, _meta(job, job.name, owner, job_selector(job.name)), settings)


def disruption_budget(job: specs.JobSpec, world_epoch: int, owner: Owner) -> dict[str, Any]:
    """PodDisruptionBudget `<job>`: at most one voluntary eviction at a time in the running world.

    An eviction is a SIGTERM, which drains the whole world at one agreed step
    (docs/pod-contract.md, "A world that drains itself"); the budget holds every
    further eviction of a running pod of that world back until the world has
    drained (pods that have finished, or not started, are always evictable), so
    a node drain waits for the checkpoint instead of killing the world piecemeal,
    and never waits for more than that. Its selector follows the world epoch.
    """
    labels = {**job_selector(job.name), wellknown.LABEL_EPOCH: str(world_epoch)}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(job, job.name, owner, job_selector(job.name)),
        "spec": {
            "minAvailable": max(job.replicas - 1, 0),
            "selector": {"matchLabels": labels},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def volumes(job: specs.JobSpec) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {"name": wellknown.VOLUME_SHM, "emptyDir": {"medium": "Memory", "sizeLimit": job.sidecar.shm_size}},
        {
            "name": wellknown.VOLUME_CONFIG,
            "configMap": {
                "name": config_map_name(job.name),
                "items": [{"key": wellknown.CONFIG_FILE, "path": wellknown.CONFIG_FILE}],
            },
        },
        {
            "name": wellknown.VOLUME_PODINFO,
            "downwardAPI": {"items": [
                {"path": wellknown.PODINFO_ANNOTATIONS, "fieldRef": {"fieldPath": "metadata.annotations"}},
                {"path": wellknown.PODINFO_LABELS, "fieldRef": {"fieldPath": "metadata.labels"}},
            ]},
        },
    ]
    if job.data.storage_options_secret:
        out.append({"name": wellknown.VOLUME_STORAGE, "secret": {"secretName": job.data.storage_options_secret}})
    return out


def pod(
    job: specs.JobSpec, world_epoch: int, replica: int, owner: Owner, settings: Settings,
    resume_step: int | None = None, table_version: int | None = None,
) -> dict[str, Any]:
    """Replica `replica` of world `world_epoch`: the user's template plus the sidecar.

    The template is assumed admitted (admission.check_template): it has a container
    named "trainer" and uses none of the reserved volume names.
    """
    template = copy.deepcopy(dict(job.trainer.template))
    tmeta = template.get("metadata") or {}
    spec: dict[str, Any] = template.get("spec") or {}
    name = pod_name_of(job, world_epoch, replica)
    labels = {
        **(tmeta.get("labels") or {}),
        wellknown.LABEL_JOB: job.name,
        wellknown.LABEL_REPLICA: str(replica),
        wellknown.LABEL_EPOCH: str(world_epoch),
    }
    annotations = {**SCRAPE_ANNOTATIONS, **(tmeta.get("annotations") or {}),
                   wellknown.ANNOTATION_CHECKSUM: config_checksum(job)}

    containers = spec.get("containers") or []
    shared: list[dict[str, Any]] = []
    trainer: dict[str, Any] = {}
    for c in containers:
        if c.get("name") == wellknown.TRAINER_NAME:
            trainer = c
            shared = shared_mounts(job, c.get("volumeMounts") or [])
            c["env"] = _merge_env(c.get("env") or [], _env(trainer_env(job, world_epoch, replica)))
            c["volumeMounts"] = (c.get("volumeMounts") or []) + [
                {"name": wellknown.VOLUME_SHM, "mountPath": wellknown.SOCKET_DIR}, keys_mount(),
            ]
    if any(v.get("name") == wellknown.VOLUME_TRANSFORMS for v in spec.get("volumes") or []):
        shared = shared + [{"name": wellknown.VOLUME_TRANSFORMS, "mountPath": wellknown.TRANSFORMS_DIR, "readOnly": True}]
    sidecar = security.with_trainer_identity(
        sidecar_container(job, world_epoch, replica, settings, shared, resume_step, owner.uid, table_version),
        trainer, spec.get("volumes") or [])
    if settings.sidecar_mode == "native":
        spec["initContainers"] = (spec.get("initContainers") or []) + [sidecar]
    else:
        containers = containers + [sidecar]
    spec["containers"] = containers
    spec["volumes"] = (spec.get("volumes") or []) + volumes(job) + [keys_volume(job.name, owner.uid)]
    spec["hostname"] = name
    spec["subdomain"] = job.name
    # serviceAccountName and automountServiceAccountToken stay the template's: the pod's
    # identity (IRSA, workload identity) is the job's way to read without a storage Secret.
    if isinstance(spec.get("securityContext") or {}, Mapping):
        spec["securityContext"] = security.pod_security_context(spec.get("securityContext") or {})
    # A world is replaced as a whole: a failed pod must show as Failed, not loop in place.
    spec.setdefault("restartPolicy", "Never")
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**_meta(job, name, owner, labels), "annotations": annotations},
        "spec": spec,
    }


def world(
    job: specs.JobSpec, world_epoch: int, owner: Owner, settings: Settings, resume_step: int | None = None,
    table_version: int | None = None,
) -> list[dict[str, Any]]:
    """Every object world `world_epoch` needs, in creation order: ConfigMap, Service, budget and
    the job's NetworkPolicy before the pods, so that no pod ever runs unfenced."""
    fence = [network_policy(job, owner, settings.network_policy)] if settings.network_policy is not None else []
    return [config_map(job, owner), service(job, owner), disruption_budget(job, world_epoch, owner), *fence] + [
        pod(job, world_epoch, r, owner, settings, resume_step, table_version) for r in range(job.replicas)
    ]
