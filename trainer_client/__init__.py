"""splitfeed's trainer-side client, wire protocol, shared-memory ring and topology math.

Importable with pyzmq, numpy and pyarrow alone (torch is optional): this is the
package a training script imports.
"""

from .errors import (
    CheckpointError,
    ProtocolError,
    SidecarFailed,
    SidecarUnavailable,
    SplitfeedError,
    UserError,
)

__all__ = [
    "CheckpointError",
    "ProtocolError",
    "SidecarFailed",
    "SidecarUnavailable",
    "SplitfeedError",
    "UserError",
]
