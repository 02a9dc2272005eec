"""`splitfeed operator`: the command that runs the Kopf operator.

Registered through the `splitfeed.commands` entry point (pyproject.toml); the
dispatcher in trainer_client.cli calls `operator(add_parser, name)` to configure
the sub-parser and later `run(args)`. Kopf is imported only when the operator
actually runs, so `splitfeed --help` stays cheap.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from . import configs, planning


def operator(add_parser: Any, name: str) -> argparse.ArgumentParser:
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
    peer = p.add_mutually_exclusive_group()
    peer.add_argument("--peering", default="splitfeed", metavar="NAME",
                      help="Kopf peering object keeping a single active operator (default: splitfeed)")
    peer.add_argument("--standalone", action="store_true", help="no peering (one replica only!)")
    w = p.add_argument_group("admission webhook (off unless --webhook-port is given)")
    w.add_argument("--webhook-port", type=int, help="serve validating webhooks on this port")
    w.add_argument("--webhook-addr", default="0.0.0.0", help="listening address (default 0.0.0.0)")
    w.add_argument("--webhook-host", help="host name the apiserver uses in the webhook URL")
    w.add_argument("--webhook-cert", help="serving certificate (PEM)")
    w.add_argument("--webhook-key", help="serving private key (PEM)")
    w.add_argument("--webhook-ca", help="CA bundle for the webhook configuration's caBundle")
    w.add_argument("--webhook-managed", metavar="NAME",
                   help="let Kopf create and maintain a ValidatingWebhookConfiguration of this name")
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> configs.OperatorConfig:
    webhook = None
    if args.webhook_port is not None:
        webhook = configs.Webhook(
            port=args.webhook_port, addr=args.webhook_addr, host=args.webhook_host,
            certfile=args.webhook_cert, pkeyfile=args.webhook_key, cafile=args.webhook_ca,
            managed=args.webhook_managed)
    return configs.OperatorConfig(
        namespaces=() if args.all_namespaces else tuple(args.namespace),
        planning=planning.Settings.from_env(os.environ, sidecar_mode=args.sidecar_mode,
                                            sidecar_image=args.sidecar_image),
        webhook=webhook,
        liveness=args.liveness,
        peering=None if args.standalone else args.peering,
        kubeconfig=args.kubeconfig,
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if config.kubeconfig:
        os.environ["KUBECONFIG"] = config.kubeconfig  # for Kopf's own login as well
    import kopf

    from . import handlers  # noqa: F401  (registers the handlers)
    if config.webhook is not None:
        from . import webhooks

        webhooks.register(kopf.get_default_registry())

    asyncio.run(kopf.operator(
        clusterwide=not config.namespaces,
        namespaces=config.namespaces,
        standalone=config.peering is None,
        peering_name=config.peering,
        liveness_endpoint=config.liveness,
        memo=kopf.Memo(config=config),
    ))
    return 0
