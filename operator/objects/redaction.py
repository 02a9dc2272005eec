"""Keep credentials that ride in URIs out of what the operator writes.

A storage URI may carry user info (`s3://KEY:SECRET@bucket/db`) or a signed
query (`https://host/db?sig=...&X-Amz-Signature=...`). The operator needs the
real URI only in the ConfigMap it hands the sidecar; everywhere it writes text
for people (logs, events, conditions, admission messages) a URI goes through
`redact`, or a whole message through `redact_text`. Pure.
"""

from __future__ import annotations

import re
import urllib.parse

MASK = "***"

_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")


def redact(uri: str) -> str:
    """`uri` with its user info and every query value (a bare query word too) replaced by ***.

    Scheme, host, port, path, query keys and fragment are kept, so the message
    still says where. Anything that does not parse as a URI comes back unchanged.
    """
    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError:
        return uri
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{MASK}@{netloc.rsplit('@', 1)[1]}"
    query = parts.query
    if query:
        pairs = [f"{p.split('=', 1)[0]}={MASK}" if "=" in p else MASK for p in query.split("&")]
        query = "&".join(pairs)
    if netloc == parts.netloc and query == parts.query:
        return uri
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """`text` with every URI in it redacted (sidecar errors, rule messages, log lines)."""
    if "://" not in text:
        return text
    return _URI.sub(lambda m: redact(m.group(0)), text)
