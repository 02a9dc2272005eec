"""A standby operator's liveness endpoint (operator.standby) over real HTTP."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from splitfeed.operator.cluster import standby
from tests.support.ports import free_port


def _get(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_live_while_the_election_loop_tries_and_dead_once_it_stops() -> None:
    now = [100.0]
    attempted = [100.0]

    async def scenario() -> list[tuple[int, dict[str, object]]]:
        port = free_port()
        probe = standby.StandbyProbe(f"http://127.0.0.1:{port}/healthz", lambda: attempted[0], lambda: "other-pod",
                                     "ns/lease", max_quiet_s=30.0, clock=lambda: now[0])
        await probe.start()
        try:
            seen = [await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/healthz")]
            now[0] += 29.0  # still within one attempt's bound
            seen.append(await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/readyz"))
            now[0] += 2.0  # the loop has not tried for 31 s: wedged
            seen.append(await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/healthz"))
        finally:
            await probe.stop()
        # The port is free again for Kopf's own server.
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", port)
        server.close()
        return seen

    seen = asyncio.run(scenario())
    assert [s for s, _ in seen] == [200, 200, 503]
    assert seen[0][1]["holder"] == "other-pod" and seen[0][1]["standby"] is True
    assert seen[2][1]["alive"] is False


def test_only_http_endpoints() -> None:
    with pytest.raises(ValueError, match="--liveness"):
        standby.StandbyProbe("https://0.0.0.0:8080/healthz", lambda: 0.0, lambda: None, "ns/l", 1.0)
