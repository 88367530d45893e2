"""No benchmark's quick form writes over a committed result: ``--quick`` without ``--out``
goes to a temporary path, the full run to ``bench/results/``."""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
BENCHES = ["a2a_bench", "backend_bench", "gate_bench", "grammar_bench", "load_bench",
           "openai_bench", "overhead_bench", "park_bench", "pool_bench",
           "prefix_attention_bench", "sampling_bench"]


@pytest.mark.parametrize("name", BENCHES)
def test_quick_writes_to_a_temporary_path(name: str) -> None:
    bench = importlib.import_module(f"bench.{name}")
    assert bench.DEFAULT_OUT.parent == RESULTS
    assert bench.QUICK_OUT.is_relative_to(tempfile.gettempdir())
