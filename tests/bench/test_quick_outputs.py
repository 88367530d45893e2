"""No benchmark's quick form writes over a committed result: ``--quick`` without ``--out``
goes to a temporary path, the full run to its own folder's ``results/``
(``bench/<name>/results/``)."""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
BENCHES = ["a2a", "agent", "backend", "gate", "grammar", "load", "openai", "overhead", "park",
           "pool", "prefix_attention", "sampling"]


@pytest.mark.parametrize("name", BENCHES)
def test_quick_writes_to_a_temporary_path(name: str) -> None:
    bench = importlib.import_module(f"bench.{name}.__main__")
    assert bench.DEFAULT_OUT.parent == BENCH / name / "results"
    assert bench.QUICK_OUT.is_relative_to(tempfile.gettempdir())
