"""``python -m bench.gate --quick`` on the tiny model, so the benchmark never rots: the
decision latency, both policies' runs at the client, the projection, the goals and the cells
term are all there. (tests/sim/test_gate_bench_phases.py checks the per-phase arithmetic on a
synthetic trace.) No time or tokens/s is asserted."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gate import __main__ as gate_bench


def test_the_quick_form_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "gate.json"
    assert gate_bench.main(["--model", "tiny", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["decide_latency"]) == {"sessions_0", "sessions_4", "sessions_16"}
    assert result["floor_tps"] > 0 and result["neighbour"] is None
    runs = {r["policy"]: r for r in result["runs"]}
    assert set(runs) == {"floor", "none"}
    for policy, r in runs.items():
        assert r["requests"] == gate_bench.QUICK["slots"], policy
        assert 0 < r["admitted"] <= r["requests"] and r["turns"] > 0, policy
        assert set(r["phases"]) == {"all"}  # no neighbour: the whole run only
    assert runs["floor"]["prefill_budget"] and not runs["none"]["prefill_budget"]
    assert "phases" in result["goals"]
    assert [c["idle_private_tokens"] for c in result["cells_term"]] == [
        0, gate_bench.QUICK["idle_private"]]
