"""Who the sidecar is in a pod: the user and group it runs as, its restricted profile, and the
cloud identity it reads the table through when the user wrote it on the trainer.

Part of the pod `planning.pod` builds (docs/pod-contract.md, docs/credentials.md); pure, plain
dicts in and out.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from splitfeed.trainer_client.contract import specs

LOADER_GROUP = 65532
"""The sidecar image's user and group (Dockerfile: USER 65532:65532); the pod's fsGroup
when the template sets none (pod_security_context)."""
IDENTITY_ENV_PREFIXES = ("AWS_", "AZURE_", "GOOGLE_")
"""The trainer's variables the sidecar gets too (with_trainer_identity): the families the
object store lancedb reads through (object_store's AmazonS3, MicrosoftAzure and
GoogleCloudStorage builders) and the clouds' SDKs take their identity and configuration from."""


def sidecar_security_context(job: specs.JobSpec) -> dict[str, Any]:
    """The Pod Security "restricted" profile for the loader.

    It writes only its memory emptyDir, the termination log and the checkpoint
    store, so its root file system is read-only. It runs as its image's user
    (65532) or the pod's runAsUser: both containers share the ring's files, so
    the sidecar takes no user of its own. runAsNonRoot is left out only when the
    template runs the pod as root (runAsUser 0), where it would stop the
    sidecar from starting (and such a pod is not "restricted" anyway).
    """
    pod_security = ((job.trainer.template.get("spec") or {}).get("securityContext")) or {}
    context: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if pod_security.get("runAsUser") != 0:
        context["runAsNonRoot"] = True
    return context


def _projects_a_token(volume: Mapping[str, Any]) -> bool:
    sources = (volume.get("projected") or {}).get("sources") or []
    return any(isinstance(s, Mapping) and "serviceAccountToken" in s for s in sources)


def with_trainer_identity(sidecar: Mapping[str, Any], trainer: Mapping[str, Any],
                          pod_volumes: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The sidecar given the cloud identity the user wrote on the trainer container.

    A job without data.storageOptionsSecret reads through the pod's identity. Where a
    webhook supplies it (EKS IRSA and Pod Identity, Azure workload identity) it injects
    its variables and token volume into every container of the pod at admission, the
    sidecar included, since the sidecar is in the pod the operator creates; GKE workload
    identity answers from the metadata server and needs nothing in the pod. But where the
    user wrote the identity on the trainer (a cluster without the webhook; a key file from
    a Secret), the loader, which reads the same table and writes the checkpoints, must get
    the same, or it would read anonymously or through the node's role. So it gets:

    - every `AWS_*`, `AZURE_*` and `GOOGLE_*` variable of the trainer that it does not set
      itself, as written: a valueFrom stays a reference, nothing secret is read or copied;
    - the trainer's mounts of a projected service-account token, and of the file or
      directory such a variable names (AWS_WEB_IDENTITY_TOKEN_FILE,
      GOOGLE_APPLICATION_CREDENTIALS, AZURE_FEDERATED_TOKEN_FILE, ...), unless the sidecar
      already mounts something at that path.

    envFrom is not copied: it brings whole ConfigMaps or Secrets, not only identity. A
    copied variable also stops a webhook from injecting its own into the sidecar, exactly
    as it does for the trainer, so both containers keep one identity.
    """
    env = [copy.deepcopy(dict(e)) for e in sidecar.get("env") or []]
    own = {e.get("name") for e in env}
    copied = [copy.deepcopy(dict(e)) for e in trainer.get("env") or []
              if isinstance(e, Mapping) and str(e.get("name", "")).startswith(IDENTITY_ENV_PREFIXES)
              and e.get("name") not in own]
    paths = [str(e["value"]).rstrip("/") for e in copied if str(e.get("value", "")).startswith("/")]
    tokens = {v.get("name") for v in pod_volumes if isinstance(v, Mapping) and _projects_a_token(v)}
    mounts = [copy.deepcopy(dict(m)) for m in sidecar.get("volumeMounts") or []]
    taken = {str(m.get("mountPath", "")).rstrip("/") for m in mounts}
    for m in trainer.get("volumeMounts") or []:
        path = str(m.get("mountPath", "")).rstrip("/")
        wanted = m.get("name") in tokens or any(p == path or p.startswith(path + "/") for p in paths)
        if path and wanted and path not in taken:
            mounts.append({k: m[k] for k in ("name", "mountPath", "subPath", "readOnly") if k in m})
            taken.add(path)
    return {**copy.deepcopy(dict(sidecar)), "env": env + copied, "volumeMounts": mounts}


def pod_security_context(template_context: Mapping[str, Any]) -> dict[str, Any]:
    """The pod's securityContext: the template's, with fsGroup 65532 where it sets none.

    The sidecar runs as the pod's user or its image's (65532) and must read the projected
    service-account token that a job without storageOptionsSecret reads through (IRSA's
    aws-iam-token, Azure's azure-identity-token, or the template's own). The kubelet
    writes that file with the volume's defaultMode (0644 unless it asks for less), but
    0600 when the pod has fsGroup or one runAsUser for every container (then owned by that
    user), and with fsGroup it makes the file group-readable (0640) by fsGroup, a group
    every container of the pod has. Without fsGroup a strict defaultMode (0400, 0600), or
    a kubelet before 1.19 (always 0600, root's), leaves uid 65532 unable to read it. The
    template's own fsGroup is kept: its group reads the token just as well.

    fsGroupChangePolicy OnRootMismatch (unless the template sets a policy) spares a large
    persistent volume the recursive ownership walk at every world's start; the kubelet
    ignores it for token, Secret, ConfigMap and emptyDir volumes, which it sets up
    group-owned every time (a refreshed token too).
    """
    context = copy.deepcopy(dict(template_context))
    if context.get("fsGroup") is None:
        context["fsGroup"] = LOADER_GROUP
        if context.get("fsGroupChangePolicy") is None:
            context["fsGroupChangePolicy"] = "OnRootMismatch"
    return context
