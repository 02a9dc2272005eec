"""The control protocol between trainer and sidecar (ZeroMQ DEALER <-> ROUTER).

Payload never travels here: batches live in ring slots (see `ring`), and these
messages only say where. Each message is one frame of compact JSON carrying
the protocol version and a type; decoding validates both, the size and every
field's type, so garbage gets an error reply instead of crashing the sidecar.
Any failure of the JSON layer (deep nesting is a RecursionError, a 5,000-digit
number a ValueError) is a ProtocolError like the rest, and integers must fit the
int64 words they end up in. JSON rather than pickle: pickle would execute code
on the receiver.

Trainer -> sidecar: hello, checkpoint, commit, drain, wake, bye.
Sidecar -> trainer: welcome, ready, end, checkpointed, committed, error.

The world's agreement (docs/agreement.md) speaks the same frames over TCP:
member sidecar -> coordinator: join, frozen, drain_request, committed_world;
coordinator -> member: joined, freeze, commit_at, complete;
operator -> coordinator: drain_request, answered by drain_ack; status_request,
answered by status (members send progress).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .errors import ProtocolError

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024
"""Also ZeroMQ's MAXMSGSIZE on the sidecar's socket: a larger frame is dropped before it is buffered."""
_INT64 = 1 << 63
SOCKET_NAME = "sidecar.sock"

# type -> {field: allowed python types}; None allowed where listed.
_SCHEMAS: dict[str, dict[str, tuple[type, ...]]] = {
    "hello": {"local_rank": (int,), "pid": (int,), "next_step": (int, type(None))},
    "checkpoint": {"step": (int,)},
    "wake": {},
    "bye": {},
    "welcome": {
        "instance": (str,), "rank": (int,), "world_size": (int,), "ctl": (str,),
        "resume_step": (int,), "next_step": (int,), "total_steps": (int,),
        "steps_per_epoch": (int,),
    },
    "ready": {"global_step": (int,)},  # wakes a waiting trainer; slots say the rest
    "end": {"next_step": (int,)},
    "checkpointed": {"step": (int,), "drained": (bool,), "uri": (str,)},
    "error": {"code": (str,), "message": (str,), "fatal": (bool,)},
    # Trainer -> sidecar: phase two of a checkpoint (the model for `step` is saved).
    "commit": {"step": (int,)},
    "committed": {"step": (int,)},
    # Trainer -> sidecar: this process got SIGTERM; ask the world to drain.
    "drain": {"reason": (str,)},
    # The world's agreement (docs/agreement.md).
    "join": {"replica": (int,), "instance": (str,), "published": (int,)},
    "joined": {"resume_step": (int,), "table_version": (int, type(None))},
    "freeze": {"round": (int,)},
    "frozen": {"round": (int,), "replica": (int,), "published": (int,)},
    "commit_at": {"round": (int,), "step": (int,), "drain": (bool,), "reason": (str,)},
    "committed_world": {"replica": (int,), "step": (int,)},
    "complete": {"step": (int,)},
    "drain_request": {"token": (str,), "reason": (str,)},
    "drain_ack": {"token": (str,), "state": (str,)},
    # Live progress (docs/observability.md): member -> coordinator every few seconds;
    # operator -> coordinator `status_request`, answered by `status` (the world's sums).
    "progress": {"replica": (int,), "global_step": (int,), "steps_per_epoch": (int,), "rows": (int,),
                 "rows_per_s": (float, int), "wait_s": (float, int), "wall_s": (float, int), "buckets": (list,)},
    "status_request": {},
    "status": {"replicas": (int,), "reporting": (int,), "global_step": (int, type(None)),
               "steps_per_epoch": (int,), "total_steps": (int,), "resume_step": (int,),
               "rows": (int,), "rows_per_s": (float, int), "wait_s": (float, int), "wall_s": (float, int),
               "buckets": (list,), "drain_step": (int, type(None))},
}


def encode(kind: str, **fields: Any) -> bytes:
    """One frame; raises ProtocolError for a message we would refuse to receive."""
    message = {"v": PROTOCOL_VERSION, "type": kind, **fields}
    _validate(message)
    blob = json.dumps(message, separators=(",", ":")).encode()
    if len(blob) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{kind} message of {len(blob)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return blob


def decode(frame: bytes) -> dict[str, Any]:
    """Parse and validate one frame; ProtocolError says what is wrong with it."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        message = json.loads(frame)
    except Exception as exc:  # JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError, ...
        raise ProtocolError(f"message is not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(message, dict):
        raise ProtocolError("message is not a JSON object")
    _validate(message)
    return message


def _validate(message: Mapping[str, Any]) -> None:
    version = message.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} is not {PROTOCOL_VERSION}; "
            "run the same splitfeed version in the trainer and the sidecar"
        )
    kind = message.get("type")
    schema = _SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    extra = set(message) - set(schema) - {"v", "type"}
    if extra:
        raise ProtocolError(f"{kind} message has unknown fields {sorted(extra)}")
    for field, types in schema.items():
        value = message.get(field, _MISSING)
        if value is _MISSING:
            raise ProtocolError(f"{kind} message lacks field {field!r}")
        if isinstance(value, bool) and bool not in types:
            raise ProtocolError(f"{kind}.{field} must be {types[0].__name__}, got a bool")
        if not isinstance(value, types):
            raise ProtocolError(f"{kind}.{field} must be {types[0].__name__}, got {_short(value)}")
        if isinstance(value, int) and not -_INT64 <= value < _INT64:
            raise ProtocolError(f"{kind}.{field} is out of the int64 range")


def _short(value: Any) -> str:
    """A bounded description: repr of a deeply nested list would itself raise RecursionError."""
    if not isinstance(value, (str, int, float, type(None))):
        return f"a JSON {type(value).__name__}"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


_MISSING = object()
