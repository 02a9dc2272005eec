"""Exactly one active operator: a coordination.k8s.io/v1 Lease, the way controllers elect a leader.

A candidate takes the Lease when nobody holds it, or when the holder has not
renewed it for `duration_s` as measured on the candidate's own clock from the
moment it first saw that record (client-go's rule: no clock is compared with
another machine's). The holder renews every `renew_s`; one that cannot renew
for `renew_deadline_s` (< duration_s) stops working before anybody may take
over, and `commands` then exits non-zero so that its pod restarts as a
candidate. A holder that stops cleanly hands the Lease back (empty holder), so
its successor starts at once. Kopf peering only pauses lower-priority
operators; this is the lock.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from . import configs, kube

log = logging.getLogger(__name__)


def identity() -> str:
    """This process: the pod name (the hostname in a pod) and a random suffix."""
    return f"{os.environ.get('HOSTNAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def micro_time(now: datetime.datetime) -> str:
    """metav1.MicroTime's wire format."""
    return now.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _record(lease: Mapping[str, Any] | None) -> tuple[Any, ...]:
    spec = (lease or {}).get("spec") or {}
    return (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseTransitions"))


def claimed(lease: Mapping[str, Any], me: str, config: configs.LeaderElection,
            now: datetime.datetime) -> dict[str, Any]:
    """The Lease as `me` writes it to take or renew it (keeps the resourceVersion: an update
    onto a record someone else changed meanwhile fails)."""
    spec = dict(lease.get("spec") or {})
    before = spec.get("holderIdentity") or ""
    spec.update(holderIdentity=me, leaseDurationSeconds=max(1, int(config.duration_s)), renewTime=micro_time(now))
    if before != me:
        spec["acquireTime"] = micro_time(now)
        spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if before else 0)
    return {**lease, "spec": spec}


class Elector:
    """Takes, keeps and gives back the Lease for one operator process."""

    def __init__(self, client: kube.Kube, config: configs.LeaderElection, me: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kube, self.config, self.me = client, config, me or identity()
        self.clock = clock
        self._seen: tuple[Any, ...] | None = None
        self._seen_at = 0.0
        self._renewed_at: float | None = None
        self.attempted_at = clock()
        """When the last attempt to take the Lease ended (either way): a standby's liveness."""

    @property
    def holder(self) -> str | None:
        """Who held the Lease when it was last read."""
        return str(self._seen[0]) if self._seen and self._seen[0] else None

    def _free(self, lease: Mapping[str, Any]) -> bool:
        """Nobody holds it, we do, or the holder's record has not changed for duration_s."""
        holder = ((lease.get("spec") or {}).get("holderIdentity")) or ""
        record = _record(lease)
        if record != self._seen:
            self._seen, self._seen_at = record, self.clock()
        return holder in ("", self.me) or self.clock() - self._seen_at >= self.config.duration_s

    async def try_once(self) -> bool:
        """One attempt to take or renew the Lease; True while we hold it."""
        now = datetime.datetime.now(datetime.timezone.utc)
        lease = await self.kube.get_lease(self.config.namespace, self.config.name)
        if lease is None:
            fresh = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                     "metadata": {"name": self.config.name, "namespace": self.config.namespace}}
            ok = await self.kube.create_lease(claimed(fresh, self.me, self.config, now))
        elif self._free(lease):
            ok = await self.kube.replace_lease(claimed(lease, self.me, self.config, now))
        else:
            return False
        if ok:
            self._renewed_at = self.clock()
        return ok

    async def acquire(self) -> None:
        """Wait until this process holds the Lease."""
        waiting_logged = False
        while True:
            try:
                if await self.try_once():
                    log.info("leader election: %s holds Lease %s/%s", self.me, self.config.namespace,
                             self.config.name)
                    return
            except kube.KubeError as exc:
                log.warning("leader election: %s", exc)
            finally:
                self.attempted_at = self.clock()
            if not waiting_logged:
                log.info("leader election: Lease %s/%s is held by %s; waiting", self.config.namespace,
                         self.config.name, self._seen[0] if self._seen else "?")
                waiting_logged = True
            await asyncio.sleep(self.config.renew_s)

    async def hold(self) -> None:
        """Renew until a renewal is overdue by renew_deadline_s; returns when leadership is lost.

        Each attempt is cut off at the deadline: a call hanging on a half-open connection
        (its own timeout may be longer than duration_s) must not keep this holder acting
        after a candidate may have taken the Lease.
        """
        while True:
            await asyncio.sleep(self.config.renew_s)
            since = self.clock() - self._renewed_at if self._renewed_at is not None else self.config.renew_deadline_s
            try:
                if await asyncio.wait_for(self.try_once(), timeout=max(0.1, self.config.renew_deadline_s - since)):
                    continue
                log.error("leader election: %s took Lease %s/%s", self._seen[0] if self._seen else "someone",
                          self.config.namespace, self.config.name)
                return
            except kube.KubeError as exc:
                log.warning("leader election: renewing failed: %s", exc)
            except asyncio.TimeoutError:
                log.warning("leader election: no answer to the renewal before the deadline")
            if self._renewed_at is None or self.clock() - self._renewed_at >= self.config.renew_deadline_s:
                log.error("leader election: no renewal for %.0fs; giving up the lead", self.config.renew_deadline_s)
                return

    async def release(self) -> None:
        """Hand the Lease back (an empty holder) so that a successor need not wait it out."""
        try:
            lease = await self.kube.get_lease(self.config.namespace, self.config.name)
            if lease is not None and (lease.get("spec") or {}).get("holderIdentity") == self.me:
                spec = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1}
                await self.kube.replace_lease({**lease, "spec": spec})
                log.info("leader election: released Lease %s/%s", self.config.namespace, self.config.name)
        except kube.KubeError as exc:
            log.warning("leader election: releasing failed: %s", exc)

