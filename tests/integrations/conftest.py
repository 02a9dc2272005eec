from tests.streaming.harness import table_uri  # noqa: F401 - the session's training table
