"""splitfeed's trainer-side client, wire messages, shared-memory ring and slot format, error tree and topology math.

Importable with pyzmq, numpy and pyarrow alone (torch is optional): this is the
package a training script imports.
"""

from typing import TYPE_CHECKING, Any

from .contract.errors import (
    CheckpointError,
    ProtocolError,
    SidecarFailed,
    SidecarUnavailable,
    SplitfeedError,
    UserError,
)

__all__ = [
    "Batch",
    "StreamClient",
    "CheckpointError",
    "ProtocolError",
    "SidecarFailed",
    "SidecarUnavailable",
    "SplitfeedError",
    "UserError",
    "init_process_group",
]

from .script.groups import init_process_group  # torch on first call only

if TYPE_CHECKING:
    from .script.client import Batch, StreamClient


def __getattr__(name: str) -> Any:
    # Lazy: the operator imports this package for specs and topology, and must
    # not pay for pyzmq (or torch) to do so.
    if name in ("Batch", "StreamClient"):
        from .script import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
