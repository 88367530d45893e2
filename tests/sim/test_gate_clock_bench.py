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
