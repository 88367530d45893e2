"""``python -m bench.grammar --quick`` on the tiny model, for the worker's tool grammar and the
coordinator's plan grammar, so the benchmark never rots: every sampler variant ran and
reported its tokens and redraws. No time is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.grammar import __main__ as grammar_bench


@pytest.mark.parametrize("grammar", ["tool", "plan"])
def test_the_quick_form_runs_every_variant(tmp_path: Path, grammar: str) -> None:
    out = tmp_path / "grammar.json"
    assert grammar_bench.main(["--model", "tiny", "--quick", "--grammar", grammar,
                               "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["grammar_kind"] == grammar and result["repeats"] == 1
    assert set(result["summary"]) == {"none", "grammar-first", "draw-check"}
    for kind, row in result["summary"].items():
        assert row["tokens"] > 0, kind
        assert row["full_redraws"] <= row["redraws"] <= row["tokens"]
    assert result["summary"]["none"]["redraws"] == 0  # no grammar, nothing to redraw
    assert result["grammar"]  # the GBNF the run sampled under
