"""The leak guard: a test must not leave child processes, threads or shared memory behind.

A leaked loader worker, reader thread or ring file outlives the test that made it
and makes a later test (or the machine) fail for a reason it did not cause, so
tests/conftest.py runs `Snapshot` around every test. What exists before the test
starts (including what session and module fixtures set up) is not the test's.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

from . import processes

GRACE_S = 10.0
"""How long a process or thread the test stopped may take to finish exiting."""
SHM_ENV = "SPLITFEED_SHM_ROOT"
"""Where `splitfeed local` and the test harnesses put their memory-backed files; the
root conftest points it at a directory of its own for the session (see `session_shm`)."""


_session: Path | None = None


def session_shm() -> Path:
    """This test session's own memory-backed directory, named in SPLITFEED_SHM_ROOT; made once.

    Its own directory, not /dev/shm itself: sessions run side by side on one
    machine, and only what this session wrote may count against its tests.
    """
    global _session
    if _session is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        _session = Path(tempfile.mkdtemp(prefix=f"sf-pytest-{os.getpid()}-", dir=base))
        os.environ[SHM_ENV] = str(_session)
    return _session


def shm_root() -> Path:
    """The memory-backed directory tests use: SPLITFEED_SHM_ROOT (inherited by the processes a
    test starts), else this session's."""
    configured = os.environ.get(SHM_ENV)
    return Path(configured) if configured else session_shm()


def remove_session_shm() -> None:
    global _session
    if _session is not None:
        shutil.rmtree(_session, ignore_errors=True)
        if os.environ.get(SHM_ENV) == str(_session):
            del os.environ[SHM_ENV]
        _session = None


def _helpers() -> set[int]:
    """The interpreter's own long-lived helper processes, started once on first use and kept
    for the session: multiprocessing's resource tracker and fork server. Not a test's leak."""
    from multiprocessing import forkserver, resource_tracker

    pids = {getattr(resource_tracker._resource_tracker, "_pid", None),
            getattr(forkserver._forkserver, "_forkserver_pid", None)}
    return {pid for pid in pids if isinstance(pid, int)}


def _ours(thread: threading.Thread) -> bool:
    """Threads the check counts: every non-daemon thread, and every daemon thread of ours.

    A library's daemon pool thread (a thread pool kept for reuse) is not a leak.
    """
    return not thread.daemon or thread.name.startswith("splitfeed-")


_LONG_LIVED = (set(), set(), set())  # type: tuple[set[int], set[threading.Thread], set[str]]
"""Processes, threads and shm entries that session, package or module fixtures started: they
live on past the test that happened to set them up, and are stopped by their fixture. Threads
are kept as objects, not idents: an ended thread's ident is handed to the next thread started,
which then passed for the fixture's (a leak missed; a guard test failed at random under CI)."""


_INHERITED = (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)
"""Signals whose disposition a child process inherits when it is ignored (SIG_IGN survives
exec) or blocked (the mask survives fork and exec)."""


def _signal_state() -> tuple[frozenset[int], frozenset[int]]:
    """Which of _INHERITED this process ignores, and which its main thread blocks."""
    ignored = frozenset(int(s) for s in _INHERITED if signal.getsignal(s) is signal.SIG_IGN)
    blocked = frozenset()
    if threading.current_thread() is threading.main_thread():
        blocked = frozenset(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []) if s in _INHERITED)
    return ignored, blocked


@dataclasses.dataclass
class Snapshot:
    """What runs and what is in the session's shared memory before a test."""

    children: set[int]
    threads: set[threading.Thread]
    shm: set[str]
    signals: tuple[frozenset[int], frozenset[int]] = (frozenset(), frozenset())
    """Ignored and blocked signals (_signal_state): a test that leaves SIGINT ignored makes every
    process a later test starts ignore Ctrl-C and PR_SET_PDEATHSIG's SIGINT."""

    @classmethod
    def take(cls) -> Snapshot:
        children = processes.children()
        _LONG_LIVED[0].intersection_update(children)  # an ended fixture process's pid gets reused too
        _LONG_LIVED[1].difference_update([t for t in _LONG_LIVED[1] if not t.is_alive()])
        return cls(children, set(threading.enumerate()), _shm_entries(), _signal_state())

    def adopt(self) -> None:
        """Everything new since this snapshot belongs to a fixture that outlives the test
        (called around the setup of a fixture of wider scope, which a test may start late,
        through `request.getfixturevalue`)."""
        now = Snapshot.take()
        _LONG_LIVED[0].update(now.children - self.children)
        _LONG_LIVED[1].update(now.threads - self.threads)
        _LONG_LIVED[2].update(now.shm - self.shm)

    @staticmethod
    def adopt_running(pids: set[int], shm: set[str]) -> None:
        """These processes and shm entries belong to something that outlives the test (a
        cluster's own pods, restarted by their Deployment while a test ran)."""
        _LONG_LIVED[0].update(pids)
        _LONG_LIVED[2].update(shm)

    def leaks(self) -> list[str]:
        """What the test left behind (after a grace for what is still exiting); cleans it up."""
        deadline = time.monotonic() + GRACE_S
        while True:
            kids = processes.children() - self.children - _LONG_LIVED[0] - _helpers()
            threads = [t for t in threading.enumerate() if t not in self.threads
                       and t not in _LONG_LIVED[1] and t.is_alive() and _ours(t)]
            if (not kids and not threads) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        found = [f"child process {pid} ({processes.command_line(pid)})" for pid in sorted(kids)]
        for pid in kids:  # clean up for the next test, then fail this one
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        found += [f"thread {t.name!r}" for t in threads]
        found += _restore_signals(self.signals)
        root = shm_root()
        for name in sorted(_shm_entries() - self.shm - _LONG_LIVED[2]):
            found.append(f"shared memory {root / name}")
            path = root / name
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        return found


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(shm_root()))
    except OSError:
        return set()


def _restore_signals(before: tuple[frozenset[int], frozenset[int]]) -> list[str]:
    """Name and undo what the test left ignored or blocked of _INHERITED."""
    ignored, blocked = _signal_state()
    found = []
    for sig in sorted(ignored - before[0]):
        found.append(f"{signal.Signals(sig).name} left ignored (SIG_IGN)")
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    if blocked - before[1]:
        found.append("signals left blocked: " + ", ".join(signal.Signals(s).name for s in sorted(blocked - before[1])))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked - before[1])
    return found
