"""Data-plane fixtures; the machinery lives in harness.py."""

from tests.streaming.harness import pods, socket_root, table_uri  # noqa: F401  (fixtures)
