"""Asking a running world to drain: one `drain_request` to its coordinator.

The coordinator is replica 0's sidecar (docs/agreement.md). The operator and
`splitfeed local` both ask through this one function; a sidecar or trainer
asks through its own connection. Best effort by design: the caller has a
slower sure path (the pod annotation) or retries on its next pass.
"""

from __future__ import annotations

from typing import Any

import zmq

from . import protocol
from .errors import ProtocolError


def request_drain(address: str, token: str, reason: str, *, timeout_s: float = 1.0,
                  context: zmq.Context[Any] | None = None) -> str | None:
    """Send the request; the coordinator's state ("freezing", "committed", ...) or None if no answer.

    The same token twice is one request: the coordinator deduplicates, so
    asking again on every pass is safe.
    """
    sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
    try:
        sock.connect(address)
        sock.send(protocol.encode("drain_request", token=token, reason=reason))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        try:
            answer = protocol.decode(sock.recv())
        except ProtocolError:
            return None
        return str(answer["state"]) if answer["type"] == "drain_ack" else None
    finally:
        sock.close(linger=0)
