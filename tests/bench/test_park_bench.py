"""``python -m bench.park --quick`` on the tiny model, so the benchmark never rots: every
mode served every agent, parking let more agents attach than the cache holds, and the resume
cost was measured for both ways back. This covers mesh's side only: the ``--llama-server``
row needs llama.cpp's server binary (``bench/park/llama_server.py``), which the suite does not
build; its sizing is checked here without it. No time is asserted."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from bench.park import __main__ as park_bench
from bench.park.llama_server import llama_server_slots


def test_the_quick_form_serves_every_agent_in_every_mode(tmp_path: Path) -> None:
    out = tmp_path / "park.json"
    assert asyncio.run(park_bench.main(["--model", "tiny", "--quick", "--out", str(out)])) == 0
    result = json.loads(out.read_text())
    resident = result["meta"]["geometry"]["resident"]
    runs = {(r["mode"], r["agents"]): r for r in result["runs"]}
    assert set(runs) == {(m, n) for m in ("none", "recompute", "swap") for n in (7, 14)}
    for (mode, n), r in runs.items():
        assert r["served"] == n and not r["failed"], (mode, n, r["failed"])
    assert runs[("none", 14)]["max_attached_at_once"] <= resident  # without parking: waits
    for mode in ("recompute", "swap"):  # with it: more agents attached than sequence ids
        assert runs[(mode, 14)]["max_attached_at_once"] > resident
        assert runs[(mode, 14)]["parks"] > 0 and runs[(mode, 14)]["resumes"] > 0
    assert runs[("swap", 14)]["swaps"] > 0 and runs[("swap", 14)]["resume_tokens"] == 0
    assert runs[("recompute", 14)]["resume_tokens"] > 0
    assert {c["mode"] for c in result["resume_cost"]} == {"recompute", "swap"}


def test_llama_servers_slots_hold_whole_contexts_in_the_same_kv_budget() -> None:
    g = park_bench.Geometry(prefix=4096, suffix=1024, resident=7, turns=4, gen=32, idle_s=5.0)
    slots, ctx = llama_server_slots(g)
    assert ctx == 4096 + 7 * 1024 + 64
    assert slots == 2 and slots * (4096 + 1024 + 64) <= ctx  # docs/parking.md: -np 2
