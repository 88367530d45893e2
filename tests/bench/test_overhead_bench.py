"""``python -m bench.overhead --quick`` on the tiny model, so the benchmark never rots: both
steps (Python and native) ran every session count, and each row's parts add up. No time is
asserted; the parts are checked as accounting (host and the engine loop outside the step are
never negative, now that the counters are read before the hold is released)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.overhead import __main__ as overhead_bench


def test_the_quick_form_runs_both_steps_at_every_n(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    assert overhead_bench.main(["--model", "tiny", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["complete"] and result["meta"]["native_used"]["python"] is False
    rows = {(r["mode"], r["N"]): r for r in result["rows"]}
    assert set(rows) == {(m, n) for m in ("python", "native") for n in (1, 4)}
    for (mode, n), r in rows.items():
        assert r["tokens"] == n * result["meta"]["tokens"], (mode, n)
        assert r["steps"] >= result["meta"]["tokens"]  # one token per session per step at most
        assert r["host_ms"] >= 0 and r["other_ms"] >= 0, (mode, n)
        assert r["wall_ms"] == pytest.approx(r["decode_ms"] + r["host_ms"] + r["other_ms"],
                                             abs=0.01)
        assert (r["sample_ms"] is None) == (mode == "python" or not
                                            result["meta"]["native_used"]["native"])
