"""One line for an error from lancedb or the object store: what failed and what to do.

lancedb and its object store raise ValueError / RuntimeError / OSError whose
text is a Rust error chain (credential providers, HTTP headers, source paths
of dependencies): kilobytes nobody can act on. `explain` maps the cases users
hit to a sentence that names the field to fix; anything else keeps its first
200 characters. The full chain stays on the raised error's `__cause__` and is
printed by `splitfeed -v`.
"""

from __future__ import annotations

import re

_CREDENTIALS = re.compile(
    r"credential|lacked the necessary privileges|\b403\b|Forbidden|AccessDenied|InvalidAccessKeyId|"
    r"SignatureDoesNotMatch|ExpiredToken|PermissionDenied", re.IGNORECASE)
_NO_BUCKET = re.compile(r"NoSuchBucket|bucket does not exist", re.IGNORECASE)
_UNREACHABLE = re.compile(
    r"tcp connect error|Connection refused|dns error|error trying to connect|failed to lookup address|"
    r"Name or service not known|timed out|kind: Connect", re.IGNORECASE)
_ENDPOINT = re.compile(r"(https?://[^/\s\"'?]+)")
MAX_CHARS = 200

CREDENTIALS_HINT = (
    "give them in the Secret named by spec.data.storageOptionsSecret (for `splitfeed local` and "
    "`splitfeed plan`: --storage-options-dir DIR, one file per option such as aws_access_key_id)")


def explain(exc: BaseException, *, uri: str) -> str:
    """`exc` from opening or reading `uri`, as one line."""
    text = str(exc)
    if _UNREACHABLE.search(text):
        endpoint = _ENDPOINT.search(text)
        where = f" at {endpoint.group(1)}" if endpoint else ""
        return (f"cannot reach the object store of {uri}{where}: check spec.data.storageOptions "
                "(aws_endpoint, region) and that the endpoint is reachable from here")
    if _NO_BUCKET.search(text):
        return f"the bucket of {uri} does not exist: check spec.data.uri"
    if _CREDENTIALS.search(text):
        return (f"the object store refused to read {uri}: credentials are missing or not allowed; "
                + CREDENTIALS_HINT)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first if len(first) <= MAX_CHARS else first[:MAX_CHARS] + "... (splitfeed -v shows all)"
