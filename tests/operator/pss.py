"""The Pod Security Standards' "restricted" profile (Kubernetes 1.30), as a checker for tests.

The test apiserver (1.20) has no PodSecurity admission, so built pods are judged
here, rule by rule as https://kubernetes.io/docs/concepts/security/pod-security-standards/
writes them (baseline, then restricted). `violations(pod)` names each broken rule,
prefixed with the container it is about (or "pod").
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def containers(pod: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    spec = pod.get("spec") or {}
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(key) or []


def _container_rules(c: Mapping[str, Any], pod_sc: Mapping[str, Any]) -> list[str]:
    sc = c.get("securityContext") or {}
    found = []
    if sc.get("privileged"):
        found.append("privileged")
    if (sc.get("windowsOptions") or {}).get("hostProcess"):
        found.append("hostProcess")
    caps = sc.get("capabilities") or {}
    if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
        found.append(f"capabilities.add {sorted(set(caps.get('add') or []) - {'NET_BIND_SERVICE'})}")
    if "ALL" not in (caps.get("drop") or []):
        found.append("capabilities.drop lacks ALL")
    if any(p.get("hostPort") for p in c.get("ports") or []):
        found.append("hostPort")
    if sc.get("procMount") not in (None, "Default"):
        found.append("procMount")
    se = sc.get("seLinuxOptions") or {}
    if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
        found.append("seLinuxOptions")
    if sc.get("allowPrivilegeEscalation") is not False:
        found.append("allowPrivilegeEscalation is not false")
    non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
    if non_root is not True:
        found.append("runAsNonRoot is not true")
    if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
        found.append("runAsUser 0")
    seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
    if seccomp not in ("RuntimeDefault", "Localhost"):
        found.append(f"seccompProfile {seccomp or 'unset'}")
    return found


def violations(pod: Mapping[str, Any]) -> list[str]:
    """Every rule of the restricted profile the pod breaks; empty when it is restricted."""
    spec = pod.get("spec") or {}
    pod_sc = spec.get("securityContext") or {}
    found = [f"pod: {key}" for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]
    for v in spec.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"pod: volume {v.get('name')} is {sorted(kinds - RESTRICTED_VOLUMES)}")
    bad = [s.get("name") for s in pod_sc.get("sysctls") or [] if s.get("name") not in SAFE_SYSCTLS]
    if bad:
        found.append(f"pod: sysctls {bad}")
    if (pod_sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        found.append("pod: seccompProfile Unconfined")
    se = pod_sc.get("seLinuxOptions") or {}
    if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
        found.append("pod: seLinuxOptions")
    if pod_sc.get("runAsUser") == 0:
        found.append("pod: runAsUser 0")
    for c in containers(pod):
        found += [f"{c.get('name')}: {rule}" for rule in _container_rules(c, pod_sc)]
    return found


RESTRICTED_POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
