"""bench/gate_clock/'s quick form on the tiny model: it runs, and its summary holds the
ratios to legacy from the same run (the figures themselves are the benchmark's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_the_quick_form_runs_and_summarizes(tmp_path: Path) -> None:
    root = tmp_path / "gc"
    done = subprocess.run(
        [sys.executable, "-m", "bench.gate_clock", "--quick", "--model", "tiny",
         "--policies", "floor,legacy", "--root", str(root)],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    table = json.loads((root / "summary.json").read_text(encoding="utf-8"))
    legacy = table["quick"]["legacy"]
    assert legacy["wall_s_vs_legacy"]["median"] == 1.0
    floor = table["quick"]["floor"]
    assert floor["wall_s"]["n"] == 1 and floor["p50_delivery_s_vs_legacy"]["median"] > 0
    assert "| floor | 1 |" in (root / "summary.md").read_text(encoding="utf-8")
    bound = floor["p50_bound_vs_legacy"]["median"]
    assert 0 < bound <= 1.0 + 1e-9  # no order beats shortest first at the best rate


def test_the_order_bound_is_shortest_first_at_the_rate() -> None:
    from bench.gate_clock.__main__ import order_bound

    # 24 equal packages of 64 tokens at 16 tok/s: the 12th done at 48 s, the 13th at 52 s
    assert order_bound([64] * 24, 16.0) == 50.0
    # shortest first: 10, then 10 + 20, then 10 + 20 + 30 tokens, at 10 tok/s
    assert order_bound([30, 10, 20], 10.0) == 3.0
    assert order_bound([], 10.0) is None and order_bound([5], 0.0) is None
