"""The operator process's configuration: one frozen dataclass built from the command line.

`commands` builds it; `handlers` reads it from Kopf's memo at startup. Nothing
here touches the cluster.
"""

from __future__ import annotations

import dataclasses

from . import planning


@dataclasses.dataclass(frozen=True)
class Webhook:
    """Where Kopf's admission server listens and how the apiserver reaches it."""

    port: int = 9443
    addr: str = "0.0.0.0"
    """Listening address."""
    host: str | None = None
    """Host name in the URL given to the apiserver (a Service DNS name in a cluster)."""
    certfile: str | None = None
    pkeyfile: str | None = None
    """Serving certificate and key (PEM); Kopf makes a self-signed pair when absent (needs certbuilder)."""
    cafile: str | None = None
    """CA bundle the apiserver verifies the server with (goes into caBundle)."""
    managed: str | None = None
    """Name of the ValidatingWebhookConfiguration that Kopf creates and keeps current; None:
    a configuration is installed by someone else (the Helm chart)."""


@dataclasses.dataclass(frozen=True)
class OperatorConfig:
    namespaces: tuple[str, ...] = ()
    """Namespaces to serve; empty means every namespace (cluster-wide)."""
    planning: planning.Settings = dataclasses.field(default_factory=planning.Settings)
    webhook: Webhook | None = None
    """None: no admission server (the CRD's own validation and status conditions remain)."""
    liveness: str | None = None
    """Kopf's liveness endpoint, e.g. http://0.0.0.0:8080/healthz."""
    peering: str | None = "splitfeed"
    """Kopf peering object (ClusterKopfPeering/KopfPeering) that keeps one operator active;
    None runs standalone."""
    kubeconfig: str | None = None
