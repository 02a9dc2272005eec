"""The operator process's configuration: one frozen dataclass built from the command line.

`commands` builds it; `handlers` reads it from Kopf's memo at startup. Nothing
here touches the cluster.
"""

from __future__ import annotations

import dataclasses

from splitfeed.trainer_client.contract import wellknown

from ..objects import planning

METRICS_PORT = 8090
"""The command line's default /metrics port (metrics.DEFAULT_PORT): here, where importing it
costs nothing, because every `splitfeed` command builds the operator's argument parser."""


@dataclasses.dataclass(frozen=True)
class Webhook:
    """Where Kopf's admission server listens and how the apiserver reaches it."""

    port: int = 9443
    addr: str = wellknown.ALL_INTERFACES
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
    cert_check_s: float = 10.0
    """How often the certificate files are re-read; the server restarts with new ones
    (a renewed Secret, cert-manager's rotation) without restarting the operator."""
    dry_run_pods: bool = True
    """Admit a job only if the apiserver accepts a pod built from its template (a dry-run
    create: the cluster's own PodSpec validation and admission)."""
    check_pod_permission: bool = False
    """Admit a job only if its requester may create pods in its namespace (a
    SubjectAccessReview): the operator creates them on the requester's behalf."""


@dataclasses.dataclass(frozen=True)
class LeaderElection:
    """One active operator: whoever holds the Lease runs; the others wait (operator.leader)."""

    namespace: str
    name: str = "splitfeed-operator"
    duration_s: float = 15.0
    """A holder that has not renewed for this long is presumed dead."""
    renew_s: float = 2.0
    """How often the holder renews (and a candidate retries)."""
    renew_deadline_s: float = 10.0
    """A holder that could not renew for this long stops, before anyone may take over."""


@dataclasses.dataclass(frozen=True)
class ApiTimeouts:
    """How long the operator waits on the apiserver: a half-open connection (a proxy or a
    node that vanished without a reset) must end in an error and a reconnect, not a hang."""

    connect_s: float = 5.0
    request_s: float = 30.0
    """Read timeout of every short call (ours through the client; Kopf's patches and events
    get connect_s + request_s in all)."""
    watch_server_s: int = 300
    """The apiserver ends each watch after this long and Kopf starts a new one. An int: it
    goes into the watch URL as timeoutSeconds, which the apiserver parses as one."""
    watch_inactivity_s: float = 70.0
    """Kopf drops a watch that delivered nothing (no event, no bookmark) for this long and
    lists and watches again: a dead stream is noticed within this bound."""


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
    """Kopf peering object (ClusterKopfPeering/KopfPeering): a higher-priority operator pauses
    this one; None runs standalone. Peering is no lock: `leader` is."""
    kubeconfig: str | None = None
    leader: LeaderElection | None = None
    """None: no leader election (one replica, or a development run)."""
    timeouts: ApiTimeouts = dataclasses.field(default_factory=ApiTimeouts)
    metrics_port: int | None = None
    """The operator's /metrics port (operator/cluster/metrics.py); None: not served. The
    command line's default is METRICS_PORT; an operator run in-process (tests) serves none."""
