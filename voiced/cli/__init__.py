"""`voiced` command line: one module per sub-command, each with `register(subparsers)`.

A sub-command's module sets `func` on its parser; `func(args) -> int` is the exit status.
Heavy imports (torch, grpc) happen inside `func`, so `voiced --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Sub-command modules, in the order `voiced --help` lists them.
COMMANDS = ["serve", "doctor", "transcribe", "eval", "speak", "voices", "models", "engines", "bench"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voiced", description="Real-time voice agent daemon.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"voiced.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose + 1, 2) if args.verbose else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except CliError as e:
        print(f"voiced {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        from voiced.extras import missing_extra

        missing = missing_extra(e)
        if missing is None:
            raise
        print(f"voiced {args.command}: error: {missing}", file=sys.stderr)
        return 2


class CliError(Exception):
    """An error to print as one clear line (no traceback) and exit with status 2."""
