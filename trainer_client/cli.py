"""The `splitfeed` command: one entry point for every process, in pods and locally.

Subcommands are registered by the layers that own them through the
`splitfeed.commands` entry-point group (see pyproject.toml), so this
dispatcher, which lives in the lowest layer, never imports lancedb or kopf.
Each entry point is a function that configures an argparse sub-parser and sets
`func` (called with the parsed namespace, returning an exit code). A command whose
optional dependencies are not installed (`pip install splitfeed` is the trainer client
alone) says so from `require_extra`, and the dispatcher offers it as unavailable: running
it, `--help` included, prints one line naming the extra to install.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import traceback
from collections.abc import Sequence
from importlib.metadata import entry_points

from .contract import errors, versions


def require_extra(extra: str, *modules: str) -> None:
    """MissingExtra unless every top-level module in `modules` is installed (looked up, not imported)."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        names = " and ".join([", ".join(missing[:-1]), missing[-1]] if len(missing) > 1 else missing)
        raise errors.MissingExtra(f"needs {names}, which {'is' if len(missing) == 1 else 'are'} not "
                                  f"installed: pip install 'splitfeed[{extra}]'")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitfeed",
        description="Feed LanceDB tables to elastic GPU training, deterministically.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=versions.version_line(),
                        help="print the splitfeed version and its wire protocol version")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for ep in sorted(entry_points(group="splitfeed.commands"), key=lambda e: e.name):
        try:
            ep.load()(sub.add_parser, ep.name)
        except ImportError as exc:
            # One layer's missing dependency must not take the other commands down.
            _unavailable(sub.add_parser, ep.name, exc)
    return parser


def _unavailable(add_parser, name: str, exc: ImportError) -> None:  # type: ignore[no-untyped-def]
    """`name` as a command that only says why it cannot run, whatever its arguments (--help too)."""
    why = str(exc) if isinstance(exc, errors.MissingExtra) else f"cannot load: {exc}"

    def fail(_args: argparse.Namespace) -> int:
        raise errors.UserError(why)

    p = add_parser(name, help=f"(unavailable: {why})", add_help=False)
    p.add_argument("-h", "--help", action=_SayWhy, nargs=0, default=why, help=argparse.SUPPRESS)
    p.set_defaults(func=fail, unavailable=True)


class _SayWhy(argparse.Action):
    """The --help of a command that cannot run: why not, in the one line `main` prints errors in."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        parser.exit(2, f"{parser.prog}: error: {self.default}\n")


def main(argv: Sequence[str] | None = None) -> int:
    if list(sys.argv[1:] if argv is None else argv) == ["--version"]:
        print(versions.version_line())  # before the commands' modules are looked at
        return 0
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "unavailable", False):  # an unavailable command ignores its arguments
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
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
