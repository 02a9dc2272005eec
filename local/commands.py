"""The `splitfeed local` subcommand: a whole StreamingJob on this machine.

Registered through the `splitfeed.commands` entry points like every layer's commands; the
run itself (local/running.py) is imported only when the command runs, so `splitfeed --help`
stays fast. It needs the sidecar's extra, as the sidecars it starts do.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from splitfeed.sidecar import commands
from splitfeed.trainer_client import cli
from splitfeed.trainer_client.contract import wellknown, specs


def local(add_parser: commands.AddParser, name: str) -> None:
    cli.require_extra(commands.EXTRA, *commands.SERVING, "yaml", "tqdm")
    p = add_parser(name, help="run a StreamingJob's ranks as local processes")
    p.add_argument("-f", "--file", required=True, help=commands.MANIFEST_HELP)
    p.add_argument("--replicas", type=int, help="override spec.replicas")
    p.add_argument("--resume", choices=wellknown.RESUMES, default=wellknown.RESUME_LATEST)
    p.add_argument("--storage-options-dir", type=Path, help=commands.STORAGE_OPTIONS_HELP)
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--scale-at", action="append", default=[], metavar="STEP:REPLICAS",
                   help="rescale live once global step STEP is reached (repeatable)")
    p.add_argument("--rescale", choices=specs.RESCALES, default=specs.RECREATE,
                   help="how a rescale changes the world: new processes for every replica (recreate), "
                        "or the ones that stay keep running (inPlace; trainers run under `splitfeed run`)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- CMD ARGS... (default: the trainer container's command)")
    p.set_defaults(func=_local)


def _local(args: argparse.Namespace) -> int:
    from . import running as launching

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    job = commands.parse_job_file(args.file, args.replicas)
    scale_at = [launching.parse_scale_at(text) for text in args.scale_at]
    return launching.run(job, command=command or None, resume=args.resume,
                         storage_options_dir=args.storage_options_dir, progress=not args.quiet,
                         scale_at=scale_at, in_place=args.rescale == specs.IN_PLACE)
