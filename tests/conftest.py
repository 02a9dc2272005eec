"""Checks every test of every tier gets: nothing left running, nothing left in shared memory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import guards


@pytest.fixture(scope="session", autouse=True)
def session_shared_memory() -> Iterator[None]:
    """This session's own memory-backed directory (guards.session_shm), removed at the end."""
    guards.session_shm()
    yield
    guards.remove_session_shm()


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """Fail a test that leaves child processes, threads or shared-memory files behind.

    Function scope, so session and module fixtures (a control plane, a moto server)
    are set up before the snapshot and are not counted.
    """
    before = guards.Snapshot.take()
    yield
    leaks = before.leaks()
    assert not leaks, "left behind by this test: " + "; ".join(leaks)
