"""``mesh serve``'s engine flags parsed as the CLI parses them, for the engine's tests."""

from __future__ import annotations

import argparse

from mesh.cli.compose import add_engine_flags

__all__ = ["parse"]


def parse(*argv: str) -> argparse.Namespace:
    """``argv`` through the engine flags plus the two pool sizes they read."""
    p = argparse.ArgumentParser()
    p.add_argument("--max-sessions", type=int, default=16)
    p.add_argument("--session-budget", type=int, default=2048)
    add_engine_flags(p)
    return p.parse_args(list(argv))
