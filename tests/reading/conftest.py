"""Fixtures of the data-plane read tests (helpers live in tables.py).

What a test leaves running (loader workers, reader threads) is checked for every
test by tests/conftest.py."""

from __future__ import annotations

import pytest

from tests.reading.tables import write_table
from tests.support.s3 import s3_bucket, s3_endpoint  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def db_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local database holding the `frames` table, written once per module."""
    uri = str(tmp_path_factory.mktemp("db"))
    write_table(uri)
    return uri
