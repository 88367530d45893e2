"""``python -m bench.task_store --quick`` runs end to end on the throwaway PostgreSQL: both
coordinators answer every call, and the JSON says what was measured (never how fast)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.task_store.__main__ import CALLS, STORES, main


def test_the_quick_bench_measures_every_call_on_both_stores(tmp_path: Path, pg_url: str) -> None:
    out = tmp_path / "task_store.json"
    assert main(["--quick", "--out", str(out), "--postgres", pg_url]) == 0
    doc = json.loads(out.read_text())
    assert doc["num_calls"] == 20
    assert set(doc["results"]) == set(STORES)
    for store in STORES:
        for call in CALLS:
            row = doc["results"][store][call]
            assert row["num_calls"] == 20, (store, call)
            assert row["p50_ms"] is not None and row["p95_ms"] >= row["p50_ms"]
    assert "given (--postgres)" in doc["stores"]["postgres"]
