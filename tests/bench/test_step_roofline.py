"""bench/step_roofline/: its formulas and analysis on made-up numbers, and the quick form
end to end on the tiny model (the real pool, the compiled helper, the child process)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from bench.step_roofline.__main__ import (
    PARTS,
    Plan,
    Shape,
    analyse,
    attention_work,
    classify,
    limit_ms,
    main,
    prefill_parts,
    profile_parts,
    weights_work,
)

SHAPE = Shape(arch="llama", n_layer=30, n_embd=576, n_head=9, n_head_kv=3, head_dim=64,
              n_ff=1536, n_vocab=49152, block_weights=106_168_320, block_bytes=66_355_200,
              out_weights=28_311_552, out_bytes=30_081_024, tied_output=True, types={})
PEAKS = {"threads": 2, "int8_gops_all": 200.0, "fma_gflops_all": 100.0, "read_gbs_all": 20.0,
         "llc_read_gbs_all": 50.0}


def test_work_formulas() -> None:
    ops, nbytes = weights_work(SHAPE, 8)
    assert ops == 2 * 8 * (106_168_320 + 28_311_552)
    assert nbytes == 66_355_200 + 30_081_024  # each weight read once a step
    assert weights_work(SHAPE, 256, output_rows=0) == (2 * 256 * 106_168_320, 66_355_200)
    flops, kv = attention_work(SHAPE, 8, 1000, 1000)
    assert flops == 4 * 8 * 1000 * 30 * 9 * 64
    assert kv == 1000 * 2 * 30 * 3 * 64 * 2  # K and V, f16


def test_limit_is_the_slower_of_compute_and_memory() -> None:
    ms, bound = limit_ms(2e9, 1e9, 100.0, 20.0)
    assert ms == pytest.approx(50.0) and bound == "memory"
    ms, bound = limit_ms(2e10, 1e6, 100.0, 20.0)
    assert ms == pytest.approx(200.0) and bound == "compute"
    assert limit_ms(0.0, 0.0, None, None) == (None, "")


def _rec(op: str, ns: int, src0: str = "", graph: int = 0, **kw: Any) -> dict[str, Any]:
    return {"op": op, "ns": ns, "src0": src0, "graph": graph, "name": "",
            "ne": [0] * 4, "s0ne": kw.get("s0ne", [0] * 4), "s1ne": kw.get("s1ne", [0] * 4),
            "s0bytes": kw.get("s0bytes", 0), "s1bytes": 0}


def test_profile_classifies_nodes_and_takes_off_the_dispatch() -> None:
    assert classify(_rec("MUL_MAT", 1, "blk.0.attn_q.weight")) == "weights"
    assert classify(_rec("MUL_MAT", 1, "cache_k_l0 (view)")) == "attention"
    assert classify(_rec("FLASH_ATTN_EXT", 1)) == "attention"
    assert classify(_rec("RMS_NORM", 1)) == "other"
    assert classify(_rec("VIEW", 1)) == "noop"
    recs = []
    for g in range(2):  # two graphs, 1 µs of dispatch on every node
        recs += [_rec("VIEW", 1000, graph=g), _rec("RESHAPE", 1000, graph=g),
                 _rec("MUL_MAT", 5_001_000, "blk.0.ffn_up.weight", graph=g,
                      s0ne=[576, 1536, 1, 1], s1ne=[576, 8, 1, 1], s0bytes=500_000),
                 _rec("FLASH_ATTN_EXT", 2_001_000, graph=g), _rec("ADD", 1_001_000, graph=g)]
    prof = profile_parts(recs)
    assert prof["graphs"] == 2 and prof["node_overhead_us"] == pytest.approx(1.0)
    assert (prof["weights_ms"], prof["attention_ms"], prof["other_ms"]) == pytest.approx(
        (5.0, 2.0, 1.0))
    assert prof["weights_gops"] == pytest.approx(2 * 576 * 1536 * 8 / 1e9)
    assert prof["weights_gbytes"] == pytest.approx(5e-4)


def _point(prefix: int, rows: int, suffix: int, attn_ms: float, probe: bool = False,
           ) -> dict[str, Any]:
    """A step of 10 ms of weights, 1 ms of other ops and ``attn_ms`` of attention, run
    under a profile that doubles everything (the scale takes it back)."""
    compute = 10.0 + 1.0 + attn_ms
    profile = {"graphs": 1, "weights_ms": 20.0, "attention_ms": 2 * attn_ms,
               "other_ms": 2.0}
    return {"prefix": prefix, "rows": rows, "suffix": suffix, "own_cells": suffix + 4.0,
            "compute_ms": compute, "decode_ms": compute + 0.5, "period_ms": compute + 1.5,
            "sample_ms": 0.25, "profile": profile, "probe": probe}


def test_analysis_splits_a_step_into_its_parts() -> None:
    # attention: 2 ms per 1K prefix cells per row + 0.01 ms per private row-cell
    def attn(p: int, n: int, s: int) -> float:
        return 2.0 * n * p / 1000 + 0.01 * n * s

    points = [_point(p, n, 64, attn(p, n, 64)) for n in (1, 8) for p in (256, 1024, 4096)]
    points.append(_point(256, 8, 128, attn(256, 8, 128), probe=True))
    plan = Plan(prefixes=(1024, 4096), base_prefix=256, rows=(1, 8), suffix=64,
                probe_suffix=128, probe_rows=(8,), steps=8, profile_steps=2, threads=2)
    out = analyse({"points": points, "prefills": []}, SHAPE, PEAKS, plan)
    assert out["prefix_slopes"]["8"]["ms_per_1k"] == pytest.approx(16.0)
    assert out["suffix_probes"]["8"]["ms_per_row_cell"] == pytest.approx(0.01)
    assert {(d["prefix"], d["rows"]) for d in out["decode"]} == {
        (p, n) for n in (1, 8) for p in (1024, 4096)}  # the base prefix is not reported
    d = next(d for d in out["decode"] if d["prefix"] == 4096 and d["rows"] == 8)
    parts = d["parts"]
    assert set(parts) == set(PARTS)
    assert parts["weights"]["ms"] == pytest.approx(10.0)
    assert parts["prefix_attn"]["ms"] == pytest.approx(2.0 * 8 * 4.096)
    assert parts["suffix_attn"]["ms"] == pytest.approx(0.01 * 8 * 64)
    assert parts["other_ops"]["ms"] == pytest.approx(1.0)
    assert parts["sampling"]["ms"] == 0.25
    assert parts["host_llama"]["ms"] == pytest.approx(0.5)
    assert parts["host_mesh"]["ms"] == pytest.approx(0.75)
    assert sum(p["share"] for p in parts.values()) == pytest.approx(1.0)
    assert d["suffix_attn_probe_ms"] == pytest.approx(0.01 * 8 * 68)
    w = parts["weights"]  # 8.6 GOP in 10 ms against 200 GOP/s: 43 ms at the limit
    assert w["achieved_gops_s"] == pytest.approx(weights_work(SHAPE, 8)[0] / 1e7)
    assert w["x_limit"] == pytest.approx(10.0 / max(w["gops"] / 200 * 1e3,
                                                    w["gbytes"] / 20 * 1e3))
    assert out["farthest"][0]["x_limit"] >= out["farthest"][-1]["x_limit"]


def test_prefill_parts_fit_the_chunks_over_position() -> None:
    # chunks of 256: 30 ms of weights + 6 of other + 0.01 ms per earlier cell, 2 ms host
    chunks = []
    for i in range(6):
        start = 256 * i
        compute = 36.0 + 0.01 * start + (500.0 if i == 0 else 0.0)  # a cold first chunk
        chunks.append({"start": start, "tokens": 256, "compute_ms": compute,
                       "wall_ms": None if i == 0 else compute + 2.0, "graphs": 1,
                       "profiled": i == 1})
    prefill = {"prefix": 1536, "chunk": 256, "start_s": 1.0, "chunks": chunks,
               "profile": {"graphs": 1, "weights_ms": 60.0, "attention_ms": 2.0 * 2.56 + 4,
                           "other_ms": 12.0}}
    out = prefill_parts(prefill, SHAPE, PEAKS)
    assert out is not None
    assert out["chunk_fit"]["ms_per_cell"] == pytest.approx(0.01)
    assert out["first_chunk_extra_ms"] == pytest.approx(500.0)
    assert out["parts"]["host"]["ms"] == pytest.approx(12.0)  # 2 ms a chunk
    assert out["tok_s"] == pytest.approx(1536 / out["wall_ms"] * 1e3)
    short = {**prefill, "chunks": chunks[:2]}
    assert prefill_parts(short, SHAPE, PEAKS) is None  # nothing to fit


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_quick_form_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "roofline.json"
    assert main(["--quick", "--out", str(out), "--work-dir", str(tmp_path / "work")]) == 0
    doc = json.loads(out.read_text())
    assert out.with_suffix(".png").is_file()
    assert "decode step: where the time goes" in capsys.readouterr().out
    peaks = doc["peaks"]
    assert peaks["fma_gflops_core"] > 0 and peaks["read_gbs_all"] > 0
    plan = doc["plan"]
    for p in doc["points"]:
        assert p["steps"] == plan["steps"]  # every timed step was one graph, timed
        assert p["graphs"] == p["steps"]
        assert 0 < p["compute_ms"] <= p["decode_ms"] <= p["period_ms"]
        assert p["profile"]["graphs"] == plan["profile_steps"]
    decode = doc["analysis"]["decode"]
    assert {(d["prefix"], d["rows"]) for d in decode} == {
        (p, n) for p in plan["prefixes_run"] for n in plan["rows"]}
    for d in decode:
        assert set(d["parts"]) == set(PARTS)
        assert all(part["ms"] >= 0 for part in d["parts"].values())
    assert doc["analysis"]["prefill"]  # the largest prefix is several chunks
    build = doc["build"]
    assert build["flash_attn"] in ("on", "off", "auto")
    assert "mesh_default" in build["repack"]["self"]
    assert doc["sampling"]["grammar_tokens"] > 0
    assert "loadavg" in doc["meta"]["machine_before"]
