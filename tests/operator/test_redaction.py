"""redact(uri): user info and query values never reach logs, events, conditions or messages."""

from __future__ import annotations

import pytest

from splitfeed.operator.objects.redaction import redact, redact_text


@pytest.mark.parametrize("uri, shown", [
    ("s3://AKIA123:s3cr3t@bucket/db", "s3://***@bucket/db"),
    ("s3://token@bucket/db", "s3://***@bucket/db"),
    ("https://acct.blob.core.windows.net/c/db?sv=2022&sig=abc%2Fd&se=1", "https://acct.blob.core.windows.net/c/db?sv=***&sig=***&se=***"),
    ("gs://bucket/db?opaquetoken", "gs://bucket/db?***"),
    ("az://u:p@host:8443/path#frag", "az://***@host:8443/path#frag"),
    ("s3://bucket/db", "s3://bucket/db"),
    ("/data/lance/db", "/data/lance/db"),
    ("file:///data/db", "file:///data/db"),
])
def test_redact_hides_user_info_and_query_values_and_keeps_where(uri, shown):
    assert redact(uri) == shown
    assert redact(shown) == shown  # idempotent


def test_redact_text_finds_every_uri_in_a_message():
    text = "cannot open 's3://KEY:SECRET@bkt/db?x=1' (see https://h/p?sig=zz); plain /path stays"
    out = redact_text(text)
    assert "SECRET" not in out and "KEY" not in out and "zz" not in out
    assert "'s3://***@bkt/db?x=***'" in out and "plain /path stays" in out
    assert redact_text("no uri here") == "no uri here"
