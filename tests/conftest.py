"""Checks every test of every tier gets: nothing left running, nothing left in shared memory."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from splitfeed.trainer_client.contract import wellknown
from tests.support import guards, keys


@pytest.fixture(scope="session", autouse=True)
def session_shared_memory() -> Iterator[None]:
    """This session's own memory-backed directory (guards.session_shm), removed at the end."""
    guards.session_shm()
    yield
    guards.remove_session_shm()


@pytest.fixture(scope="session", autouse=True)
def session_keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The job keypair every coordinator and client of this session uses (tests.support.keys)."""
    saved = os.environ.get(wellknown.KEYS_DIR_ENV)
    keys.install(tmp_path_factory.mktemp("keys"))
    yield
    if saved is None:
        os.environ.pop(wellknown.KEYS_DIR_ENV, None)
    else:
        os.environ[wellknown.KEYS_DIR_ENV] = saved


class _WiderFixtures:
    """What a fixture of wider scope than a test starts is that fixture's, whichever test
    happened to set it up (also late, through `request.getfixturevalue`).

    A plugin of its own, not a hook of this conftest: a conftest's hooks are not called
    for session-scoped fixtures, whose node is the session."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[object]) -> Iterator[None]:
        if fixturedef.scope == "function":
            yield
            return
        before = guards.Snapshot.take()
        yield
        before.adopt()


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_WiderFixtures(), "splitfeed-wider-fixtures")


@pytest.fixture(autouse=True)
def environment_restored() -> Iterator[None]:
    """Each test starts from the environment the one before it started from.

    A StreamClient in the test process sets RANK, WORLD_SIZE, SPLITFEED_WORLD_EPOCH, ... as
    the world it joins says (a trainer's environment: `rejoin`, `Session.adopt_world`). Left
    there, a later test's clients took world 2 of an earlier test for their own (found in CI).
    """
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """Fail a test that leaves child processes, threads or shared-memory files behind.

    What session, package and module fixtures start (a control plane, a moto server)
    is theirs, not the test's (pytest_fixture_setup).
    """
    before = guards.Snapshot.take()
    yield
    leaks = before.leaks()
    assert not leaks, "left behind by this test: " + "; ".join(leaks)
