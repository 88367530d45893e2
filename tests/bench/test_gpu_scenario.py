"""bench/gpu_scenario/ end to end on a tiny twin of the 8B geometry (mesh rows only), and
its report: rows land in the JSON as they finish, the table and the goals come from it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.gpu_scenario import __main__ as gpu_scenario
from bench.gpu_scenario import report as gpu_scenario_report
from mesh.sim.geometry import GEOMETRIES, write_geometry_model


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import dataclasses

    g = dataclasses.replace(GEOMETRIES["llama-3.1-8b"].scaled_down(16), n_ctx_train=262144)
    return write_geometry_model(tmp_path_factory.mktemp("geo") / "twin.gguf", g,
                                qtype="q8_0")


def test_the_scenario_writes_every_section_and_skips_what_does_not_fit(
        twin: Path, tmp_path: Path) -> None:
    args = gpu_scenario.parse([
        "--model", str(twin), "--out", str(tmp_path), "--kv-budget", "4096",
        "--agent-budget", "512", "--prefixes", "512", "--ns", "1,2", "--short-ns", "200",
        "--private", "32", "--short-private", "16", "--turns", "1", "--gen", "4",
        "--tool-tokens", "8", "--task-tokens", "8", "--ttft-runs", "2", "--n-batch", "256",
        "--threads", "2", "--min-row-s", "1", "--deadline-s", "240", "--dry-run"])
    assert asyncio.run(gpu_scenario.amain(args)) == 0
    doc = json.loads((tmp_path / "gpu_scenario.json").read_text())
    rows = doc["rows"]
    by = {(r["section"], r["system"], r.get("N")): r for r in rows}
    # (4096 - 512) // 512 = 7 agents pooled; 4096 // (512 + 512) = 4 with a copy each
    assert by[("capacity", "mesh", None)]["agents"] == 7
    assert by[("capacity", "mesh naive", None)]["agents"] == 4
    assert by[("ttft", "mesh", None)]["ttft_s"] > 0
    for n in (1, 2):
        row = by[("decode", "mesh", n)]
        assert row["generated"] == n * 4 and row["aggregate_tps"] > 0, row
    assert "does not fit" in by[("decode", "mesh", 200)]["note"]
    assert not [r for r in rows if r.get("error")]
    md = (tmp_path / "gpu_scenario.md").read_text()
    assert "agents that fit 7 vs 4 = 1.75x" in md


def test_the_goals_compare_mesh_with_llama_server_at_equal_n() -> None:
    doc = {"meta": {}, "rows": [
        {"section": "capacity", "system": "mesh", "P": 131072, "S": 131072, "agents": 7,
         "kv_cells": 1 << 20},
        {"section": "capacity", "system": "llama-server", "P": 131072, "S": 131072,
         "agents": 4, "kv_cells": 1 << 20},
        {"section": "ttft", "system": "mesh", "P": 131072, "case": "new agent, prefix decoded",
         "ttft_s": 0.05},
        {"section": "ttft", "system": "llama-server", "P": 131072,
         "case": "cold slot (prefix not decoded)", "ttft_s": 40.0},
        {"section": "decode", "system": "mesh", "P": 131072, "N": 4, "S": 1024,
         "agent_tps": 30.0},
        {"section": "decode", "system": "llama-server", "P": 131072, "N": 4, "S": 1024,
         "agent_tps": 20.0},
        {"section": "decode", "system": "llama-server", "P": 131072, "N": 7, "S": 1024,
         "error": "skipped"},
    ]}
    md = gpu_scenario_report.table(doc)
    assert "agents that fit 7 vs 4 = 1.75x" in md
    assert "= 800x (goal 50x)" in md
    assert "N=4 1.50x" in md and "N=7" not in md.split("Against the goals")[1].split("\n")[2]
    assert "## Rows that did not finish" in md
