"""`splitfeed operator`: the command that runs the Kopf operator.

Registered through the `splitfeed.commands` entry point (pyproject.toml); the
dispatcher in trainer_client.cli calls `operator(add_parser, name)` to configure
the sub-parser and later `run(args)`. Kopf is imported only when the operator
actually runs, so `splitfeed --help` stays cheap.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any

from splitfeed.trainer_client import cli
from splitfeed.trainer_client.contract import wellknown

from .cluster import configs
from .objects import planning, policies

if TYPE_CHECKING:
    from .cluster import kube, leader

log = logging.getLogger(__name__)


def operator(add_parser: Any, name: str) -> argparse.ArgumentParser:
    cli.require_extra("operator", "kopf", "kubernetes", "prometheus_client")
    p: argparse.ArgumentParser = add_parser(
        name, help="run the StreamingJob operator (Kopf)",
        description="Reconcile StreamingJobs into worlds of GPU pods with the loader sidecar.")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="serve this namespace (repeatable; glob patterns as Kopf accepts)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="serve every namespace (default)")
    p.add_argument("--sidecar-mode", choices=["native", "container"], default="native",
                   help="native: initContainer with restartPolicy Always (Kubernetes >= 1.29); "
                        "container: a plain container (older clusters)")
    p.add_argument("--sidecar-image", help="loader image for every job, overriding spec.sidecar.image "
                   "(defaults for jobs that name none: $SPLITFEED_SIDECAR_IMAGE, _SHM_SIZE, _PREFETCH_BATCHES)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster)")
    p.add_argument("--liveness", metavar="URL", help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--metrics-port", type=int, default=configs.METRICS_PORT, metavar="PORT",
                   help=f"serve Prometheus /metrics on this port (default {configs.METRICS_PORT}; 0: off)")
    peer = p.add_mutually_exclusive_group()
    peer.add_argument("--peering", default="splitfeed", metavar="NAME",
                      help="Kopf peering object keeping a single active operator (default: splitfeed)")
    peer.add_argument("--standalone", action="store_true", help="no peering (one replica only!)")
    le = p.add_argument_group("leader election (exactly one active operator)")
    le.add_argument("--leader-elect", action="store_true",
                    help="run only while holding a coordination.k8s.io Lease (the chart turns this on)")
    le.add_argument("--leader-election-namespace", metavar="NS",
                    help="namespace of the Lease (default: $SPLITFEED_OPERATOR_NAMESPACE)")
    le.add_argument("--leader-election-lease", default="splitfeed-operator", metavar="NAME",
                    help="name of the Lease (default: splitfeed-operator)")
    t = p.add_argument_group("API timeouts (a half-open connection ends in an error and a reconnect)")
    t.add_argument("--api-timeout", type=float, default=configs.ApiTimeouts.request_s, metavar="S",
                   help="read timeout of every short API call (default 30)")
    t.add_argument("--watch-timeout", type=float, default=configs.ApiTimeouts.watch_inactivity_s, metavar="S",
                   help="a watch that delivers nothing, not even a bookmark, for this long is dropped "
                        "and started again (default 70; the apiserver sends a bookmark every minute)")
    f = p.add_argument_group("failure policy")
    f.add_argument("--restart-backoff", type=float, default=planning.Settings.restart_backoff_s, metavar="S",
                   help="seconds before a failed world's successor starts, doubled per restart "
                        "(default 10; at most --restart-backoff-max)")
    f.add_argument("--restart-backoff-max", type=float, default=planning.Settings.restart_backoff_max_s,
                   metavar="S", help="cap of the back-off (default 360)")
    f.add_argument("--stall-timeout", type=float, default=planning.Settings.stall_timeout_s, metavar="S",
                   help="a world whose pods have not all run for this long is marked Stalled (default 900)")
    _network_policy_arguments(p)
    _webhook_arguments(p)
    p.set_defaults(func=run)
    return p


def _network_policy_arguments(p: argparse.ArgumentParser) -> None:
    """Each job's NetworkPolicy (operator/objects/policies.py; off unless --network-policy is given)."""
    n = p.add_argument_group("network policy (off unless --network-policy is given; docs/security.md)")
    n.add_argument("--network-policy", action="store_true",
                   help="give each job a NetworkPolicy admitting its own pods, the operator (coordinator "
                        "ports) and the metrics peers (metrics ports), and nothing else (the chart turns it on)")
    n.add_argument("--network-policy-operator-from", metavar="JSON",
                   help="JSON list of NetworkPolicyPeers matching the operator's pods (needed with "
                        "--network-policy; [] admits none)")
    n.add_argument("--network-policy-metrics-from", metavar="JSON",
                   help="JSON list of NetworkPolicyPeers that may scrape the sidecars' /metrics "
                        "(default []: nobody)")


def _webhook_arguments(p: argparse.ArgumentParser) -> None:
    """The admission webhook's options (off unless --webhook-port is given)."""
    w = p.add_argument_group("admission webhook (off unless --webhook-port is given)")
    w.add_argument("--webhook-port", type=int, help="serve validating webhooks on this port")
    w.add_argument("--webhook-addr", default=wellknown.ALL_INTERFACES,
                   help=f"listening address (default {wellknown.ALL_INTERFACES})")
    w.add_argument("--webhook-host", help="host name the apiserver uses in the webhook URL")
    w.add_argument("--webhook-cert", help="serving certificate (PEM)")
    w.add_argument("--webhook-key", help="serving private key (PEM)")
    w.add_argument("--webhook-ca", help="CA bundle for the webhook configuration's caBundle")
    w.add_argument("--webhook-managed", metavar="NAME",
                   help="let Kopf create and maintain a ValidatingWebhookConfiguration of this name")
    w.add_argument("--webhook-cert-check", type=float, default=10.0, metavar="S",
                   help="re-read the certificate files this often; new ones are served at once (default 10)")
    w.add_argument("--no-webhook-dry-run", dest="webhook_dry_run", action="store_false",
                   help="do not ask the apiserver to dry-run a pod of each job's template at admission")
    w.add_argument("--webhook-check-pod-permission", action="store_true",
                   help="admit a job only if its requester may create pods in its namespace "
                        "(a SubjectAccessReview)")


def config_from_args(args: argparse.Namespace) -> configs.OperatorConfig:
    webhook = None
    if args.webhook_port is not None:
        webhook = configs.Webhook(
            port=args.webhook_port, addr=args.webhook_addr, host=args.webhook_host,
            certfile=args.webhook_cert, pkeyfile=args.webhook_key, cafile=args.webhook_ca,
            managed=args.webhook_managed, cert_check_s=args.webhook_cert_check,
            dry_run_pods=args.webhook_dry_run, check_pod_permission=args.webhook_check_pod_permission)
    leader = None
    if args.leader_elect:
        namespace = args.leader_election_namespace or os.environ.get("SPLITFEED_OPERATOR_NAMESPACE")
        if not namespace:
            raise SystemExit("--leader-elect needs --leader-election-namespace or $SPLITFEED_OPERATOR_NAMESPACE")
        leader = configs.LeaderElection(namespace=namespace, name=args.leader_election_lease)
    network_policy = None
    if args.network_policy:
        network_policy = policies.parse(args.network_policy_operator_from, args.network_policy_metrics_from)
    return configs.OperatorConfig(
        namespaces=() if args.all_namespaces else tuple(args.namespace),
        planning=planning.Settings.from_env(os.environ, sidecar_mode=args.sidecar_mode,
                                            sidecar_image=args.sidecar_image,
                                            restart_backoff_s=args.restart_backoff,
                                            restart_backoff_max_s=args.restart_backoff_max,
                                            stall_timeout_s=args.stall_timeout,
                                            network_policy=network_policy),
        webhook=webhook,
        liveness=args.liveness,
        peering=None if args.standalone else args.peering,
        kubeconfig=args.kubeconfig,
        leader=leader,
        timeouts=configs.ApiTimeouts(request_s=args.api_timeout, watch_inactivity_s=args.watch_timeout),
        metrics_port=args.metrics_port or None,
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if config.kubeconfig:
        os.environ["KUBECONFIG"] = config.kubeconfig  # for Kopf's own login as well
    check_credentials(config.kubeconfig)
    import kopf

    from .cluster import handlers
    if config.webhook is not None:
        from .cluster import webhooks

        webhooks.register(kopf.get_default_registry())
    return asyncio.run(_main(config))


def check_credentials(kubeconfig: str | None) -> None:
    """Fail at once, in one line, without a way to reach a cluster.

    Kopf would log the client's traceback and retry its startup every minute; a
    user who ran `splitfeed operator` on a laptop wants to know what to set.
    """
    from kubernetes.config.config_exception import ConfigException

    from splitfeed.trainer_client.contract import errors

    from .cluster import kube

    try:
        kube.Kube.connect(kubeconfig).close()
    except (ConfigException, OSError, ValueError) as exc:
        path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
        where = (f"the kubeconfig at {path} cannot be used" if os.path.exists(path)
                 else f"no kubeconfig at {path} and not in a pod")
        raise errors.UserError(
            f"no way to reach a Kubernetes API server: {where} ({exc}); set --kubeconfig or "
            "KUBECONFIG, or run the operator in the cluster (helm install charts/splitfeed)") from exc


async def _main(config: configs.OperatorConfig) -> int:
    """Kopf, behind the leader Lease when one is configured; 1 when the lead was lost."""
    import kopf

    def operator(stop: asyncio.Event | None = None) -> Any:
        return kopf.operator(
            clusterwide=not config.namespaces,
            namespaces=config.namespaces,
            standalone=config.peering is None,
            peering_name=config.peering,
            liveness_endpoint=config.liveness,
            memo=kopf.Memo(config=config),
            stop_flag=stop,
        )

    if config.leader is None:
        await operator()
        return 0
    from .cluster import kube, leader

    client = kube.Kube.connect(config.kubeconfig, (config.timeouts.connect_s, config.timeouts.request_s))
    elector = leader.Elector(client, config.leader)
    leading = False
    try:
        await _stand_by(config, client, elector)
        leading = True
        stop = asyncio.Event()
        running = asyncio.create_task(operator(stop))
        holding = asyncio.create_task(elector.hold())
        await asyncio.wait({running, holding}, return_when=asyncio.FIRST_COMPLETED)
        if holding.done():
            leading = False
            log.error("leader election lost: stopping the operator (its pod restarts as a candidate)")
            stop.set()
            await asyncio.wait({running}, timeout=30)
            return 1
        holding.cancel()
        await running  # re-raises what stopped Kopf
        return 0
    finally:
        if leading:
            await elector.release()  # a successor need not wait the Lease out
        client.close()


async def _stand_by(config: configs.OperatorConfig, client: "kube.Kube", elector: "leader.Elector") -> None:
    """Wait for the Lease, answering the liveness probe meanwhile (Kopf serves it only once it runs)."""
    if config.liveness is None or config.leader is None:
        await elector.acquire()
        return
    from .cluster import standby

    # An attempt is at most a read and a write, each bounded by the client's request timeout.
    max_quiet_s = config.leader.renew_s + 3 * sum(client.timeout)
    probe = standby.StandbyProbe(config.liveness, lambda: elector.attempted_at, lambda: elector.holder,
                                 f"{config.leader.namespace}/{config.leader.name}", max_quiet_s,
                                 clock=elector.clock)
    await probe.start()
    try:
        await elector.acquire()
    finally:
        await probe.stop()  # Kopf's own health server binds the same address next
