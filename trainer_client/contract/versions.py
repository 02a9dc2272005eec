"""Which splitfeed a process is, and the one text a mismatch between two is told in.

A trainer and its sidecar say their package version in `hello` and `welcome` (messages.Hello,
messages.Welcome); a peer of another wire protocol is refused with a fatal error
(messages.refusal) that names both sides' versions with `mismatch`.
"""

from __future__ import annotations

import functools

from . import messages

DISTRIBUTION = "splitfeed"


@functools.cache
def package_version() -> str:
    """This process's splitfeed version, from the installed distribution's metadata (read once)."""
    from importlib import metadata  # not at import: the trainer's import stays lean

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # the sources on sys.path without an install
        return "unknown"


def version_line() -> str:
    """What `splitfeed --version` prints: the package and the wire protocol."""
    return f"splitfeed {package_version()} (wire protocol {messages.PROTOCOL_VERSION})"


def mismatch(*, trainer: tuple[int, str], sidecar: tuple[int, str]) -> str:
    """The one text a version mismatch is told in: each side's (protocol, package) and the fix."""

    def side(name: str, protocol: int, package: str) -> str:
        return (f"{name} speaks wire protocol {protocol} "
                f"({f'splitfeed {package}' if package else 'a splitfeed too old to say its version'})")

    return (f"{side('the trainer', *trainer)} and {side('its sidecar', *sidecar)}: install the same "
            "splitfeed version in the trainer image as in the sidecar image "
            "(`splitfeed --version` in each prints both numbers)")
