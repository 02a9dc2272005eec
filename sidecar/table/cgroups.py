"""What this container may use: CPUs and memory, from its cgroup limits.

`os.cpu_count()` and /proc/meminfo describe the node, not the pod: a sidecar on a
64-CPU, 1 TiB node may hold 2 CPUs and 2 GiB. Sizing thread pools or lancedb's
permutation builder from the node's figures oversubscribes the pod or gets it
OOM-killed; these read the limits Kubernetes sets (resources.limits) instead.
"""

from __future__ import annotations

import math
import os
import pathlib

CGROUP_CPU_FILES = (
    ("/sys/fs/cgroup/cpu.max", None),  # cgroup v2: "<quota|max> <period>"
    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"),  # v1
)
"""Where Linux says a container's CPU limit (the pod's resources.limits.cpu)."""

CGROUP_MEMORY_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
)
"""Where Linux says a container's memory limit (resources.limits.memory) and its use."""

NO_LIMIT = 1 << 60
"""cgroup v1 writes a huge number (not "max") for no limit: anything above this is none."""


def cpu_quota(quota: str, period: str | None = None) -> float | None:
    """CPUs a cgroup quota allows: cgroup v2's cpu.max text ("200000 100000" is 2 CPUs,
    "max 100000" no limit), or v1's cfs_quota_us and cfs_period_us ("-1": no limit)."""
    parts = quota.split()
    if period is None and len(parts) == 2:
        parts, period = parts[:1], parts[1]
    if len(parts) != 1 or period is None or parts[0] in ("max", "-1"):
        return None
    try:
        q, p = int(parts[0]), int(period.strip())
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def usable_cpus(affinity: int | None, quota: float | None) -> int:
    """CPUs this process may use: its affinity mask, capped by the cgroup quota (rounded
    up: a limit of 1.5 CPUs still runs two threads part-time), at least 1."""
    cpus = affinity or 1
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def _read_quota() -> float | None:
    for quota_file, period_file in CGROUP_CPU_FILES:
        try:
            quota = pathlib.Path(quota_file).read_text()
            period = pathlib.Path(period_file).read_text() if period_file else None
        except OSError:
            continue
        return cpu_quota(quota, period)
    return None


def process_cpus() -> int:
    """usable_cpus for this process (os.cpu_count() counts the node's, not the pod's)."""
    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        affinity = os.cpu_count()
    return usable_cpus(affinity, _read_quota())


def memory_limit(limit: str, usage: str | None = None) -> tuple[int, int] | None:
    """(limit, in use) in bytes from cgroup text ("max" or a v1 huge number: no limit)."""
    text = limit.strip()
    if text == "max":
        return None
    try:
        value = int(text)
        used = int(usage.strip()) if usage else 0
    except ValueError:
        return None
    return None if value <= 0 or value >= NO_LIMIT else (value, used)


def _meminfo_available() -> int | None:
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def free_memory() -> tuple[int | None, bool]:
    """(bytes this container may still allocate, whether a cgroup limit says so). Without a
    limit: the node's available memory (None when even that is unknown)."""
    for limit_file, usage_file in CGROUP_MEMORY_FILES:
        try:
            limit = pathlib.Path(limit_file).read_text()
            usage = pathlib.Path(usage_file).read_text()
        except OSError:
            continue
        found = memory_limit(limit, usage)
        if found is not None:
            return max(0, found[0] - found[1]), True
        break
    return _meminfo_available(), False
