"""Fixtures of the data-plane read tests (helpers live in tables.py)."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator

import pytest

from tests.data.tables import write_table


@pytest.fixture(scope="module")
def db_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local database holding the `frames` table, written once per module."""
    uri = str(tmp_path_factory.mktemp("db"))
    write_table(uri)
    return uri


@pytest.fixture(autouse=True)
def nothing_left_running() -> Iterator[None]:
    """Fail a test that leaves loader worker processes or reader threads behind."""
    yield
    children = multiprocessing.active_children()
    threads = [t.name for t in threading.enumerate() if t.name.startswith("splitfeed-")]
    for child in children:  # clean up for the next test, then fail this one
        child.kill()
        child.join()
    assert not children, f"worker processes left running: {children}"
    assert not threads, f"reader threads left running: {threads}"
