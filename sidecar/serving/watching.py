"""The drain requests a pod's annotations carry (downward API): read once every half second
and handed to the world's coordinator through this pod's server."""

from __future__ import annotations

import json
import time
from pathlib import Path

from splitfeed.trainer_client.contract import wellknown

from . import service

DRAIN_ANNOTATION = wellknown.ANNOTATION_DRAIN


def read_annotations(podinfo_dir: Path | None) -> dict[str, str]:
    """The downward-API annotations file: key="value" per line."""
    if podinfo_dir is None:
        return {}
    try:
        text = (podinfo_dir / wellknown.PODINFO_ANNOTATIONS).read_text()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            try:
                found[key.strip()] = json.loads(value)
            except ValueError:
                found[key.strip()] = value.strip().strip('"')
    return found


class RequestWatcher:
    """Turns a drain annotation token into a drain request to the world's coordinator.

    The slow, sure path (a kubelet refreshes the file on its sync period); the
    operator also asks the coordinator directly. A token present when the
    sidecar starts belongs to its world (tokens name the world epoch) and counts (one that
    names another world does not: a pod kept in place keeps its last world's annotation);
    the coordinator ignores a token it has seen.
    """

    def __init__(self, server: service.Server, podinfo_dir: Path | None, world_epoch: int = 0) -> None:
        self._server = server
        self._dir = podinfo_dir
        self._epoch = world_epoch
        self._seen: tuple[str, int] | None = None
        self._next_check = 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if self._dir is None or now < self._next_check:
            return
        self._next_check = now + 0.5
        found = read_annotations(self._dir)
        token = found.get(DRAIN_ANNOTATION)
        replicas = _count(found.get(wellknown.ANNOTATION_DRAIN_REPLICAS))
        if token and (token, replicas) != self._seen and _token_world(token) in (None, self._epoch):
            self._seen = (token, replicas)
            self._server.request_drain(token, token.split("-")[0] or "drain", replicas)


def _token_world(token: str) -> int | None:
    """The world a drain token names (`rescale-w3`: 3); None for a token that names none.
    A pod kept through an in-place change still carries its last world's token: it asked
    that world, not this one."""
    _, sep, epoch = token.rpartition("-w")
    return int(epoch) if sep and epoch.isdigit() else None


def _count(value: object) -> int:
    """A replica count from an annotation; 0 when absent or not a positive number."""
    try:
        return max(0, int(str(value)))
    except ValueError:
        return 0
