"""The leak guard every test runs under (tests/conftest.py, tests/support/guards.py)."""

from __future__ import annotations

import signal
import subprocess
import threading

from tests.support import guards, processes


def test_a_child_process_a_thread_and_a_shared_memory_file_left_behind_are_named_and_removed(monkeypatch):
    monkeypatch.setattr(guards, "GRACE_S", 0.2)
    before = guards.Snapshot.take()
    child = subprocess.Popen(["sleep", "60"])
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="splitfeed-leaky", daemon=True)
    thread.start()
    (guards.shm_root() / "ring-leaked").write_bytes(b"x")
    try:
        leaks = before.leaks()
        assert any(f"child process {child.pid} (sleep 60)" == leak for leak in leaks), leaks
        assert "thread 'splitfeed-leaky'" in leaks
        assert f"shared memory {guards.shm_root() / 'ring-leaked'}" in leaks
        assert child.wait(5) == -9, "the guard kills what it found"
        assert not (guards.shm_root() / "ring-leaked").exists()
    finally:
        stop.set()
        thread.join()
        if child.poll() is None:
            child.kill()
            child.wait()


def test_what_finishes_within_the_grace_is_not_a_leak(monkeypatch):
    monkeypatch.setattr(guards, "GRACE_S", 5.0)
    before = guards.Snapshot.take()
    child = subprocess.Popen(["sleep", "0.3"])
    thread = threading.Thread(target=lambda: None, name="splitfeed-quick")
    thread.start()
    assert before.leaks() == []
    child.wait()
    thread.join()


def test_a_library_daemon_thread_is_not_counted_but_a_zombie_is_gone():
    before = guards.Snapshot.take()
    stop = threading.Event()
    pool = threading.Thread(target=stop.wait, name="some-library-pool", daemon=True)
    pool.start()
    child = subprocess.Popen(["true"])
    processes.children()  # a child that exited but is not reaped yet is a zombie: not running
    try:
        assert before.leaks() == []
    finally:
        stop.set()
        pool.join()
        child.wait()


def test_the_interpreters_resource_tracker_is_not_a_leak():
    from multiprocessing import resource_tracker

    before = guards.Snapshot.take()
    resource_tracker.ensure_running()  # started once per interpreter, on first use
    assert before.leaks() == []


def test_what_a_wider_fixture_starts_during_a_test_is_the_fixtures(monkeypatch):
    monkeypatch.setattr(guards, "GRACE_S", 0.2)
    before = guards.Snapshot.take()
    setup = guards.Snapshot.take()
    server = subprocess.Popen(["sleep", "60"])  # as a session fixture set up late would
    setup.adopt()
    try:
        assert before.leaks() == []
        assert server.poll() is None
    finally:
        server.kill()
        server.wait()


def test_sigint_left_ignored_or_blocked_is_named_and_undone():
    """SIG_IGN and a blocked mask outlive exec: every process a later test starts would ignore
    Ctrl-C and the SIGINT of PR_SET_PDEATHSIG (splitfeed local's children)."""
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # a suite run with `&` ignores it
    before = guards.Snapshot.take()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    try:
        leaks = before.leaks()
        assert "SIGINT left ignored (SIG_IGN)" in leaks, leaks
        assert "signals left blocked: SIGTERM" in leaks, leaks
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    finally:
        signal.signal(signal.SIGINT, inherited)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])


def test_a_thread_that_reuses_an_ended_fixture_threads_ident_is_still_named(monkeypatch):
    """An ended thread's ident goes to the next thread started (glibc reuses its stack): a guard
    that remembered a fixture's threads by ident let such a thread pass (seen failing at random)."""
    monkeypatch.setattr(guards, "GRACE_S", 0.2)
    setup = guards.Snapshot.take()
    fixture_done = threading.Event()
    fixture_thread = threading.Thread(target=fixture_done.wait, name="splitfeed-fixture")
    fixture_thread.start()
    setup.adopt()  # a wider fixture's thread, as test_what_a_wider_fixture_starts... adopts
    fixture_done.set()  # its fixture stops it
    fixture_thread.join()
    before = guards.Snapshot.take()
    stop = threading.Event()
    for _ in range(50):
        thread = threading.Thread(target=stop.wait, name="splitfeed-reused", daemon=True)
        thread.start()
        if thread.ident == fixture_thread.ident:
            break
        stop.set()
        thread.join()
        stop.clear()
    try:
        assert thread.ident == fixture_thread.ident, "the ident was not reused: the case is not made"
        assert "thread 'splitfeed-reused'" in before.leaks()
    finally:
        stop.set()
        thread.join()
