"""Errors of the trainer client and the wire protocol.

    SplitfeedError
    ├── UserError              bad input; the message says what to fix (CLI exits 2)
    │   └── DataError          the table, its columns or the filter cannot feed this job:
    │                          restarting cannot help (the operator fails the job at once)
    ├── ProtocolError          a malformed, oversized or out-of-order message
    ├── SidecarUnavailable     the sidecar does not answer; reconnect or retry
    ├── SidecarFailed          the sidecar reported a fatal error (e.g. missing table)
    └── CheckpointError        a checkpoint could not be written or read

specs.SpecError and topology.TopologyError are ValueErrors raised by pure code;
callers at the edges wrap them in UserError.
"""

from __future__ import annotations


class SplitfeedError(Exception):
    pass


class UserError(SplitfeedError):
    pass


class DataError(UserError):
    pass


class ProtocolError(SplitfeedError):
    pass


class SidecarUnavailable(SplitfeedError):
    pass


class SidecarFailed(SplitfeedError):
    pass


class CheckpointError(SplitfeedError):
    pass
