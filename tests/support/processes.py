"""Child processes the tests start: tied to their parent, and listed for the leak guard."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

try:  # loaded here, not in the forked child (no imports between fork and exec)
    _LIBC: Any = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:  # pragma: no cover - no C library to load
    _LIBC = None
PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A Popen preexec_fn: the child gets `sig` when the thread that started it dies (Linux).

    So a test run that is killed leaves no server behind. SIGKILL for servers
    (etcd, pods of the test kubelet); SIGTERM where the child should clean up.
    """

    def preexec() -> None:  # pragma: no cover - runs in the child
        if _LIBC is not None:
            _LIBC.prctl(PR_SET_PDEATHSIG, sig)

    return preexec


def children(pid: int | None = None) -> set[int]:
    """The live (not zombie) child processes of `pid` (default: this process), from /proc."""
    pid = os.getpid() if pid is None else pid
    found: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(p) for p in f.read().split())
        except OSError:
            continue
    return {p for p in found if _state(p) not in ("Z", "X", None)}


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def stop(proc: subprocess.Popen[Any], grace_s: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace_s` (an operator shuts down cleanly)."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
