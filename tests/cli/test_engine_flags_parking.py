"""The parking flags reach the engine's config."""

from __future__ import annotations

import argparse

import pytest

from mesh.cli.compose import add_engine_flags, engine_options
from mesh.engine.config import GIB


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    return p.parse_args(list(argv))


def test_parking_flags_default_to_swap_within_a_gib() -> None:
    opts = engine_options(parse())
    assert opts["park_memory"] == GIB and opts["max_attached"] is None
    assert opts["park_idle_s"] is None


def test_parking_flags_are_passed_through() -> None:
    opts = engine_options(parse("--max-attached", "40", "--park-idle", "30",
                                "--park-memory", "0"))
    assert (opts["max_attached"], opts["park_idle_s"], opts["park_memory"]) == (40, 30.0, 0)


def test_negative_park_memory_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--park-memory"):
        engine_options(parse("--park-memory", "-1"))
