"""``python -m bench.a2a --quick``: trivial tasks through the whole A2A stack (a child
coordinator on a fake instant worker), so the benchmark never rots. Every phase ran and
every task completed; no time is asserted."""

from __future__ import annotations

import json
from pathlib import Path

from bench.a2a import __main__ as a2a_bench


def test_the_quick_form_runs_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "a2a.json"
    assert a2a_bench.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for phase in ("latency_raw_jsonrpc", "latency_sdk_client", "throughput"):
        assert result[phase]["num_tasks"] > 0, phase
        assert result[phase]["p50_ms"] is not None
    assert result["throughput"]["concurrency"] == a2a_bench.QUICK["concurrency"]
    assert set(result["met"]) == set(result["targets"]) == {"tasks_per_s", "p50_overhead_ms"}

