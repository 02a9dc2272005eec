"""Data-plane fixtures; the machinery lives in harness.py."""

from typing import Any

import pytest

from tests.streaming.harness import pods, socket_root, table_uri  # noqa: F401  (fixtures)
from tests.support import skipping


@pytest.fixture(scope="module")
def plan(table_uri: str) -> dict[str, Any]:  # noqa: F811
    """The skipping tests' failing ids and each epoch's world end (skipping.make_plan)."""
    return skipping.make_plan(table_uri)
