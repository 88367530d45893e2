"""The ``mesh`` command. It builds the objects; the library never imports the CLI.

Each subcommand lives in its own module exposing ``register(subparsers)``, which adds a
parser whose ``func`` default takes the parsed namespace and returns an exit status.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

# Modules under mesh.cli, each with register(subparsers).
_COMMANDS = ("demo", "serve", "client", "simulate")


def build_parser() -> argparse.ArgumentParser:
    from mesh import __version__

    parser = argparse.ArgumentParser(
        prog="mesh",
        description="A2A agent mesh on one shared llama.cpp KV pool.",
    )
    parser.add_argument("--version", action="version", version=f"mesh {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(f"mesh.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
