"""Asking a running world to drain: one `drain_request` to its coordinator.

The coordinator is replica 0's sidecar (docs/agreement.md). The operator and
`splitfeed local` both ask through this one function; a sidecar or trainer
asks through its own connection. Best effort by design: the caller has a
slower sure path (the pod annotation) or retries on its next pass, so any
failure is a None, never an exception.

Blocking (a socket and a wait): the operator calls it from a worker thread
(`asyncio.to_thread`), never on Kopf's event loop.

Every request is a CURVE client of the coordinator with the job's keypair
(trainer_client.keys): `keys`, or the one SPLITFEED_KEYS_DIR names. A missing
keypair is a UserError, not a None: it is a setup to fix, not a world to wait for.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from ..contract import errors, messages
from . import keys as keymod
from .keys import Keypair

log = logging.getLogger(__name__)


def request_drain(address: str, token: str, reason: str, timeout_s: float = 1.0,
                  context: zmq.Context[Any] | None = None, not_before: int = 0,
                  replicas: int = 0, lost: list[int] | None = None, keys: Keypair | None = None) -> str | None:
    """Ask the coordinator at `address` (layout.WorldLayout.coordinator_at) to drain; its `drain_ack` state, or None without an answer.

    A fresh DEALER per call with LINGER 0: nothing is left queued for a
    coordinator that is gone, and no socket outlives the call. The coordinator
    deduplicates by `token`, so sending again (every poll) is harmless.
    `not_before`: drain at that global step at the earliest; `replicas` > 0: then change the
    world in place to that many replicas (messages.DrainRequest); `lost`: these member replicas'
    pods failed, end the world now without a drain and go on in place without them.
    """
    answer = _ask(address, messages.DrainRequest(token=token, reason=reason, not_before=not_before,
                                                 replicas=replicas, lost=lost),
                  timeout_s, context, keys)
    if answer is None:
        return None
    if not isinstance(answer, messages.DrainAck) or answer.token != token:
        log.debug("drain request to %s: unexpected answer %s", address, answer)
        return None
    return answer.state


def request_status(address: str, timeout_s: float = 1.0, context: zmq.Context[Any] | None = None,
                   keys: Keypair | None = None) -> messages.Status | None:
    """The coordinator's `status` answer (the world's progress, trainer_client.progress), or None.

    Same shape as `request_drain`: a fresh DEALER, one frame, a bounded wait; the
    operator polls again at its next interval, so a lost answer costs nothing. The
    answer is the validated message itself (messages.decode checked every field).
    """
    answer = _ask(address, messages.StatusRequest(), timeout_s, context, keys)
    return answer if isinstance(answer, messages.Status) else None


def stand_in(address: str, request: messages.StandIn, timeout_s: float,
             context: zmq.Context[Any] | None = None, keys: Keypair | None = None) -> messages.Message | None:
    """Ask the coordinator at `address` to write a rank's checkpoint record or commit marker in
    the stead of its dead sidecar (trainer_client.stranded); its answer, or None without one."""
    return _ask(address, request, timeout_s, context, keys)


def _ask(address: str, request: messages.Message, timeout_s: float,
         context: zmq.Context[Any] | None, keys: Keypair | None) -> messages.Message | None:
    """Send one frame on a fresh DEALER and wait a bounded time for one answer; None if none came."""
    keypair = keys or keymod.from_env(who=f"a {request.kind} to the world's coordinator")
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.IPV6, 1)
        keymod.connect_as(sock, keypair)
        sock.connect(address)
        sock.send(request.encode(), zmq.NOBLOCK)
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return messages.decode(sock.recv(zmq.NOBLOCK))
    except (zmq.ZMQError, errors.ProtocolError) as exc:
        log.debug("%s request to %s failed: %s", request.kind, address, exc)
        return None
    finally:
        sock.close(linger=0)
