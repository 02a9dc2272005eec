"""A free loopback port, for servers the tests start (moto, the control plane, coordinators)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now; the caller binds it soon after (a small race the tests accept)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tcp_address() -> str:
    """tcp://127.0.0.1:<free port>: where a test world's replica 0 runs its coordinator."""
    return f"tcp://127.0.0.1:{free_port()}"
