"""``python -m bench.backend --quick``: mesh's OpenAI backend on llama-cpp-python's server
(``python -m llama_cpp.server``, a Python package in the test extra, not an outside binary)
with the tiny model, so the benchmark never rots. Every kind of turn ran; no time is
asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.backend import __main__ as backend_bench


def test_the_quick_form_times_every_kind_of_turn(tmp_path: Path) -> None:
    out = tmp_path / "backend.json"
    assert backend_bench.main(["--quick", "--model", "tiny", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["turns"]) == set(backend_bench.KINDS)
    for kind, row in result["turns"].items():
        assert not math.isnan(row["first_token_ms"]), kind  # a token came back
        assert row["turn_ms"] >= row["first_token_ms"]
    assert result["reps"] == 1 and result["prefix_tokens"] == backend_bench.QUICK["prefix_tokens"]
