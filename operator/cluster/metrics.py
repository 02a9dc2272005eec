"""The operator's Prometheus metrics, counted from what reconciling already reports.

Counting events and outcomes at the handler edge keeps the decision code
(`rescaling`, pure) free of instrumentation: every rescale, restart and drain
timeout is already an event with a fixed reason, and a rescale's latency is
`status.lastRescale.latencySeconds` (operator/cluster/live.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from splitfeed.trainer_client.contract import wellknown

from . import configs

log = logging.getLogger(__name__)

DEFAULT_PORT = configs.METRICS_PORT
RESCALE_BUCKETS_S = (5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0)
REASONS = {
    "RescaleComplete": "rescales",
    "WorldRestarted": "restarts",
    "CheckpointTimeout": "drain_timeouts",
}
"""Event reasons (operator/lifecycle/rescaling.py) -> the counter they bump."""


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ("namespace", "job")
        self.reconciles = Counter("splitfeed_operator_reconciles", "Reconcile passes, by outcome.",
                                  (*labels, "outcome"), registry=self.registry)
        self.rescales = Counter("splitfeed_operator_rescales", "Rescales completed.", labels,
                                registry=self.registry)
        self.restarts = Counter("splitfeed_operator_world_restarts", "Worlds restarted after a failure.",
                                labels, registry=self.registry)
        self.drain_timeouts = Counter("splitfeed_operator_drain_timeouts",
                                      "Drains whose checkpoint did not come within spec.checkpoint.timeoutSeconds.",
                                      labels, registry=self.registry)
        self.steps_redone = Counter("splitfeed_operator_steps_redone",
                                    "Global steps trained again: a world's last step past the resume step of "
                                    "the world that replaced it (a rescale's status.lastRescale.stepsRedone, "
                                    "a restart's StepsRedone event).",
                                    labels, registry=self.registry)
        self.rescale_seconds = Histogram("splitfeed_operator_rescale_seconds",
                                         "From a rescale's request to the new world's first batch.", labels,
                                         buckets=RESCALE_BUCKETS_S, registry=self.registry)
        self.port: int | None = None

    def serve(self, port: int, addr: str = wellknown.ALL_INTERFACES) -> int | None:
        """Serve /metrics; a taken port is a warning, never a reason to stop the operator."""
        try:
            server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            log.warning("cannot serve /metrics on port %s: %s", port, exc)
            return None
        self.port = int(server.server_address[1])
        return self.port

    def reconciled(self, namespace: str, job: str, outcome: str, reasons: Iterable[str]) -> None:
        self.reconciles.labels(namespace, job, outcome).inc()
        for reason in reasons:
            counter = REASONS.get(reason)
            if counter is not None:
                getattr(self, counter).labels(namespace, job).inc()

    def redone(self, namespace: str, job: str, steps: int) -> None:
        """Steps a world that replaced a failed one trains again (operator/cluster/live.py, StepsRedone)."""
        if steps > 0:
            self.steps_redone.labels(namespace, job).inc(steps)

    def rescaled(self, namespace: str, job: str, patch: Mapping[str, Any]) -> None:
        report = patch.get("lastRescale") or {}
        latency = report.get("latencySeconds")
        if isinstance(latency, (int, float)):
            self.rescale_seconds.labels(namespace, job).observe(float(latency))
            redone = report.get("stepsRedone")
            # Created at 0 with the rescale's first report: a series a dashboard sees before any loss.
            self.steps_redone.labels(namespace, job).inc(redone if isinstance(redone, int) and redone > 0 else 0)
