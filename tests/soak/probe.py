"""Where a running `splitfeed local` job's processes and ports are, read from /proc (Linux).

A trainer names its own pid in its log's start record (tests/e2e/trainer.py); its agent is
its parent; a sidecar is found by the lock it holds on its socket directory's sidecar.lock
(trainer_client.stranded), which /proc/locks lists with the holder's pid.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from tests.support import processes

PR_SET_CHILD_SUBREAPER = 36
LISTEN = "0A"


def become_subreaper() -> None:
    """Orphans of this process's descendants become its children: what a run left running
    after its launcher exited shows up in tests.support.processes.children()."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)


def lock_holder(path: Path) -> int | None:
    """The pid holding a POSIX lock on `path`, or None."""
    try:
        inode = os.stat(path).st_ino
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if "->" in fields:
            continue  # a waiter, not the holder
        if len(fields) >= 6 and fields[1] == "POSIX" and fields[5].rsplit(":", 1)[-1] == str(inode):
            return int(fields[4])
    return None


def sidecar_pid(work: Path, replica: int) -> int | None:
    """The live sidecar of `replica`: its socket dir is that of the world its pod was made in
    (in place a kept pod keeps it), so the newest w<epoch>-replica-<replica> with a holder."""
    dirs = sorted(work.glob(f"w*-replica-{replica}"), key=lambda d: int(d.name[1:].split("-")[0]), reverse=True)
    for directory in dirs:
        pid = lock_holder(directory / "sidecar.lock")
        if pid is not None:
            return pid
    return None


def parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (sessions of their own included: /proc/*/task/*/children)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        fresh = processes.children(todo.pop()) - found
        found |= fresh
        todo += fresh
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def listening_ports(inodes: set[str] | None = None) -> dict[int, str]:
    """TCP ports in LISTEN (IPv4 and IPv6), by port, with their socket inode; only those of
    `inodes` when given."""
    found: dict[int, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == LISTEN and (inodes is None or fields[9] in inodes):
                found[int(fields[1].rsplit(":", 1)[1], 16)] = fields[9]
    return found


def ports_of(pids: set[int]) -> set[int]:
    """The TCP ports the processes `pids` listen on now."""
    inodes: set[str] = set()
    for pid in pids:
        inodes |= _socket_inodes(pid)
    return set(listening_ports(inodes)) if inodes else set()
