"""The ``mesh`` command. It builds the objects; the library never imports the CLI.

Each subcommand lives in its own module exposing ``register(subparsers)``, which adds a
parser whose ``func`` default takes the parsed namespace and returns an exit status.

Errors a user can cause (a bad flag, a server that is not there or refuses, a 4xx) are one
line on stderr naming the fix and a non-zero exit (2 for a bad flag), in one style:
``mesh COMMAND: message`` (``mesh: message`` before a command is known); ``--debug``
(before or after the subcommand) lets the traceback through instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["main"]

# Modules under mesh.cli, each with register(subparsers).
_COMMANDS = ("demo", "serve", "client", "simulate")

_DEBUG_HELP = "print the traceback of an error instead of one line"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the help to read (argparse's
    own prints the whole usage first: dozens of lines for ``mesh serve``), in the style of
    every ``mesh`` error: ``mesh COMMAND: message``. Subcommand parsers are of the same
    class (argparse makes them with ``type(parent)``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    return _build()[0]


def _build() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``mesh`` parser and its subcommands' parsers by name."""
    from mesh import __version__

    parser = _Parser(
        prog="mesh",
        description="A2A agent mesh on one shared llama.cpp KV pool.",
    )
    parser.add_argument("--version", action="version", version=f"mesh {__version__}")
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(f"mesh.cli.{name}").register(sub)
    for command in sub.choices.values():
        # SUPPRESS: a --debug before the subcommand is not reset by the subparser's default.
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help=_DEBUG_HELP)
    return parser, dict(sub.choices)


def main(argv: Sequence[str] | None = None) -> int:
    parser, commands = _build()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "func", None) is None:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.print_help()
        return 2
    if extra:  # name the subcommand whose help lists the flags
        commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"mesh {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the one place an unexpected error becomes one line
        if args.debug:
            raise
        from mesh.cli.client import describe

        print(f"mesh {args.command}: {describe(exc, getattr(args, 'url', None))}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
