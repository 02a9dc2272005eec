"""The liveness endpoint of an operator that waits for the leader Lease.

Kopf serves `--liveness` only once it runs, and a standby replica runs Kopf only
after it takes the Lease: without this server the kubelet would find nothing on
the probe port and restart a standby that is doing exactly what it should.
While waiting, this server answers the same URL: 200 as long as the election
loop keeps trying (the process is not wedged), 503 once it has not tried for
longer than an attempt can take. It answers every path on the port, so a
readiness probe on the same port sees the standby as ready too, the convention
of Kubernetes' own controllers (kube-controller-manager, controller-runtime):
a standby serves nothing, and a never-ready pod would stall rollouts. The
webhook, which only the leader serves, has its own readiness probe (its port).

The server is stopped before Kopf starts and binds the same address.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import aiohttp.web


def verdict(attempted_ago_s: float, max_quiet_s: float, holder: str | None, lease: str) -> tuple[int, dict[str, Any]]:
    """The probe's HTTP status and body for a standby whose last election attempt was that long ago."""
    alive = attempted_ago_s < max_quiet_s
    body = {"standby": True, "lease": lease, "holder": holder or "", "alive": alive,
            "lastAttemptSecondsAgo": round(attempted_ago_s, 1)}
    return (200 if alive else 503), body


class StandbyProbe:
    """An aiohttp site on the liveness endpoint's host and port, for as long as the candidate waits."""

    def __init__(self, endpoint: str, last_attempt: Callable[[], float], holder: Callable[[], str | None],
                 lease: str, max_quiet_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        parts = urllib.parse.urlsplit(endpoint)
        if parts.scheme != "http":
            raise ValueError(f"--liveness: only http:// endpoints are served, not {endpoint!r}")
        self.host, self.port = parts.hostname or "localhost", parts.port or 80
        self.last_attempt, self.holder, self.lease = last_attempt, holder, lease
        self.max_quiet_s, self.clock = max_quiet_s, clock
        self._runner: aiohttp.web.AppRunner | None = None

    async def _answer(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        status, body = verdict(self.clock() - self.last_attempt(), self.max_quiet_s, self.holder(), self.lease)
        return aiohttp.web.json_response(body, status=status)

    async def start(self) -> None:
        app = aiohttp.web.Application()
        app.router.add_get("/{tail:.*}", self._answer)
        self._runner = aiohttp.web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        await aiohttp.web.TCPSite(self._runner, self.host, self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
