"""Children of the sidecar forked from a helper that the sidecar forks at its start.

A plan of more than planner.IN_PROCESS_ROWS rows is built in a child process, so that
lancedb's memory goes back when the build ends. From multiprocessing's 'forkserver'
that child waited for a fresh interpreter to import lancedb again: 2 s of CPU (4-6 s
on a loaded 2-core machine), on the path to the first batch of every cold start. The
sidecar has done those imports already, and at its start it has run nothing: no lancedb
call, no thread but lancedb's idle event loop. A fork then is as safe as
local/forkserver.py's, so `start` forks a helper there; the helper stays
single-threaded and idle, forks one child per `run` and hands back what the child sent.

Not for the sidecar's loader workers: they keep multiprocessing's forkserver (its
sentinel, its process objects), which a world with numWorkers > 1 starts as it serves.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

from splitfeed.trainer_client.contract import errors

FORK_WARNING = "lancedb fork support is experimental"
"""What lancedb warns at every fork of a process that imported it (silenced where nothing runs yet)."""


Target = Callable[..., None]
"""A child's function: called with a Connection to send its one result over, then `args`."""


class ChildDied(errors.SplitfeedError, RuntimeError):
    """The child exited without sending its result (killed, or out of memory)."""

    def __init__(self, code: int) -> None:
        super().__init__(f"exit code {code}")
        self.code = code


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the parent goes, however it goes (Linux); at once if it went already."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _run_child(target: Target, args: tuple[Any, ...]) -> tuple[Any, int]:
    """Fork a child that runs `target`; what it sent (None if nothing) and its exit code."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    helper = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            reader.close()
            _die_with_parent(helper)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)  # a build ends with its group, as before
            target(writer, *args)
            code = 0
        finally:
            os._exit(code)
    writer.close()
    try:
        sent = reader.recv()
    except EOFError:
        sent = None
    finally:
        reader.close()
    _, status = os.waitpid(pid, 0)
    return sent, os.waitstatus_to_exitcode(status)


def _serve(conn: multiprocessing.connection.Connection, parent: int) -> None:
    """The helper: a child per request, one at a time, until the sidecar closes its end."""
    _die_with_parent(parent)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # ends with the sidecar (EOF, PDEATHSIG), not before
    while True:
        try:
            target, args = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(_run_child(target, args))


class Helper:
    """The sidecar's end of the helper."""

    def __init__(self, pid: int, conn: multiprocessing.connection.Connection) -> None:
        self.pid = pid
        self._conn = conn
        self._lock = threading.Lock()  # one child at a time: the replies come in order
        self._closed = False

    def run(self, target: Target, *args: Any) -> Any:
        """Run `target(conn, *args)` in a new child of the helper; what it sent over `conn`.
        ChildDied when it sent nothing; OSError/EOFError when the helper is gone."""
        with self._lock:
            if self._closed:
                raise EOFError("the helper is closed")
            self._conn.send((target, args))
            sent, code = self._conn.recv()
        if sent is None:
            raise ChildDied(code)
        return sent

    def close(self) -> None:
        """End the helper (its stdin-like pipe closes) and reap it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._conn.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


_HELPER: list[Helper] = []


def start() -> Helper | None:
    """Fork this process's helper (once); call it first thing, before any lancedb call or
    thread (module doc). None where there is no fork."""
    if _HELPER:
        return _HELPER[0]
    if not hasattr(os, "fork"):
        return None
    ours, theirs = multiprocessing.Pipe(duplex=True)
    parent = os.getpid()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FORK_WARNING, category=RuntimeWarning)
        pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            _serve(theirs, parent)
        finally:
            os._exit(0)
    theirs.close()
    _HELPER.append(Helper(pid, ours))
    return _HELPER[0]


def helper() -> Helper | None:
    """This process's helper, if `start` forked one and it has not been closed."""
    return _HELPER[0] if _HELPER and not _HELPER[0]._closed else None


def stop() -> None:
    """Close this process's helper: it is not needed (nothing here builds in a child)."""
    if _HELPER:
        _HELPER[0].close()
