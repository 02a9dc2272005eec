"""The `splitfeed` command: one entry point for every process, in pods and locally.

Subcommands are registered by the layers that own them through the
`splitfeed.commands` entry-point group (see pyproject.toml), so this
dispatcher, which lives in the lowest layer, never imports lancedb or kopf.
Each entry point is a function that configures an argparse sub-parser and sets
`func` (called with the parsed namespace, returning an exit code).
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Sequence
from importlib.metadata import entry_points

from . import errors


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitfeed",
        description="Feed LanceDB tables to elastic GPU training, deterministically.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for ep in sorted(entry_points(group="splitfeed.commands"), key=lambda e: e.name):
        try:
            configure = ep.load()
        except ImportError as exc:
            # One layer's missing dependency must not take the other commands down.
            _unavailable(sub.add_parser, ep.name, exc)
            continue
        configure(sub.add_parser, ep.name)
    return parser


def _unavailable(add_parser, name: str, exc: ImportError) -> None:  # type: ignore[no-untyped-def]
    def fail(_args: argparse.Namespace) -> int:
        raise errors.UserError(f"the {name!r} command cannot load: {exc}")

    add_parser(name, help=f"(unavailable: {exc})").set_defaults(func=fail)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args) or 0)
    except errors.UserError as exc:
        # Bad input is the user's to fix: say what and how in one line, no traceback;
        # the underlying chain (a storage library's, say) only when asked for.
        if args.verbose and exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        print(f"splitfeed {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
