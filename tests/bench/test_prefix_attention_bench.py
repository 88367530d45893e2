"""bench/prefix_attention/: its math on made-up points, and a tiny-model smoke."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.prefix_attention.__main__ import (
    Grid,
    analyse,
    attention_flops,
    fit_line,
    masked_cell_ratio,
    masked_cells_per_row,
    measure,
)
from mesh.engine.models import write_tiny_model


def test_fit_line_recovers_a_line() -> None:
    b0, b1, r2 = fit_line([1, 2, 4, 8], [3 + 2 * x for x in (1, 2, 4, 8)])
    assert (b0, b1, r2) == pytest.approx((3.0, 2.0, 1.0))
    assert fit_line([4, 4], [1.0, 3.0]) == (2.0, 0.0, 1.0)  # one distinct x: the mean
    with pytest.raises(ValueError, match="as many ys"):
        fit_line([1, 2], [1.0])


def test_masked_cells_are_the_other_rows_suffixes() -> None:
    assert masked_cells_per_row(1, 64) == 0
    assert masked_cells_per_row(8, 64) == 7 * 64
    # 4 flops per head element per cell: q·k and p·v
    assert attention_flops(2, 1000, 30, 9, 64) == 4.0 * 2 * 1000 * 30 * 9 * 64


def test_masked_cell_ratio_inverts_the_step_growth() -> None:
    rows, extra, slope = 4, 100, 8.0  # 8 ms per 1K prefix cells read by all 4 rows
    per_row_cell = slope / 1000 / rows
    grown = per_row_cell * rows * extra + 0.5 * per_row_cell * rows * (rows - 1) * extra
    assert masked_cell_ratio(10.0, 10.0 + grown, rows, extra, slope) == pytest.approx(0.5)
    assert masked_cell_ratio(10.0, 11.0, 1, extra, slope) is None  # no other rows


def _synthetic(k_us: dict[str, float], suffix: int, probe: int) -> list[dict[str, Any]]:
    """Steps of 5 ms + 0.5 ms a row + k µs per row per prefix (and masked) cell."""
    pts = []
    for fa, k in k_us.items():
        for rows in (1, 4, 8):
            for prefix in (1000, 2000, 4000):
                for s in (suffix, probe) if prefix == 1000 and rows > 1 else (suffix,):
                    masked = masked_cells_per_row(rows, s)
                    cells = prefix + s + masked  # each row reads these
                    step = 5 + 0.5 * rows + k / 1000 * rows * cells
                    pts.append({"model": "m", "kv": "f16", "fa": fa, "prefix": prefix,
                                "rows": rows, "suffix": s, "step_ms": step,
                                "masked_cells_per_row": masked, "flops_floor_ms": 0.1})
    return pts


def test_analyse_fits_the_prefix_term_and_picks_the_best_path() -> None:
    pts = _synthetic({"on": 6.0, "off": 2.0}, suffix=64, probe=256)
    pts.append({"model": "m", "kv": "q8_0", "fa": "off", "prefix": 1000, "rows": 1,
                "suffix": 64, "step_ms": None, "na": "needs flash attention"})
    out = analyse(pts, 64)
    fits = {(f["fa"], f["rows"]): f for f in out["fits"]}
    assert fits[("on", 8)]["us_per_row_per_1k"] == pytest.approx(6000.0)
    assert fits[("off", 4)]["us_per_row_per_1k"] == pytest.approx(2000.0)
    assert all(f["kv"] == "f16" for f in out["fits"])  # n/a points are not fitted
    split = {sp["fa"]: sp for sp in out["split"]}
    assert split["on"]["per_row_ms_per_1k"] == pytest.approx(6.0)
    assert split["on"]["per_step_ms_per_1k"] == pytest.approx(0.0, abs=1e-9)
    assert split["off"]["gate_e_s"] == pytest.approx(2e-6)  # s per row per cell
    ratios = [m["masked_cell_ratio"] for m in out["masked_probes"]]
    assert len(ratios) == 4 and ratios == pytest.approx([1.0] * 4)
    best = {(b["prefix"], b["rows"]): b for b in out["best"]}
    assert {b["best_fa"] for b in out["best"]} == {"off"}
    assert best[(4000, 8)]["fa_on_vs_off"] > 1
    assert best[(4000, 1)]["gain_masked"] == pytest.approx(1.0)  # one row masks nothing
    assert best[(1000, 8)]["gain_masked"] > best[(1000, 4)]["gain_masked"] > 1.0
    assert best[(4000, 8)]["gain_ideal"] > best[(4000, 8)]["gain_masked"]
    share = [p["prefix_share"] for p in pts if p["fa"] == "off" and p["rows"] == 8
             and p["suffix"] == 64]
    assert share == sorted(share) and 0 < share[0] < share[-1] < 1


def test_a_noisy_fit_is_clamped_to_the_step() -> None:
    pts: list[dict[str, Any]] = [
        {"model": "m", "kv": "f16", "fa": "on", "prefix": p, "rows": 8, "suffix": 64,
         "step_ms": ms, "masked_cells_per_row": 448, "flops_floor_ms": 0.0}
        for p, ms in ((1000, 1.0), (2000, 50.0), (4000, 2.0))]
    out = analyse(pts, 64)
    for p in pts:
        assert 0 <= p["prefix_ms"] + p["masked_ms"] <= p["step_ms"] + 1e-12
    assert not out["best"][0]["fit_ok"]


def test_tiny_model_smoke(tmp_path: Path) -> None:
    # head size 32: q8_0 rows are whole blocks, so q8_0 with flash attention runs
    path = write_tiny_model(tmp_path / "tiny.gguf", n_embd=128, n_head=4, n_head_kv=2)
    grid = Grid(prefixes=(64, 128), rows=(1, 3), suffix=8, probe_suffix=24,
                fa=("on", "off"), kv=("f16", "q8_0"), steps=2, threads=1)
    pts = measure(path, "tiny", grid)
    na = [p for p in pts if p["step_ms"] is None]
    assert {(p["kv"], p["fa"]) for p in na} == {("q8_0", "off")}  # a quantized V needs FA
    ok = [p for p in pts if p["step_ms"] is not None]
    # 3 (kv, fa) pairs × 2 prefixes × 2 row counts, plus one probe per pair at P=64, R=3
    assert len(ok) == 3 * 2 * 2 + 3
    assert all(p["step_ms"] > 0 and len(p["steps_ms"]) == 2 for p in ok)
    assert all(p["cells_used"] == p["prefix"] + p["rows"] * p["suffix"] for p in ok)
    assert all(p["flops_floor_ms"] > 0 for p in ok)
    out = analyse(pts, 8)
    assert len(out["fits"]) == 3 * 2 and len(out["masked_probes"]) == 3
    assert {b["best_fa"] for b in out["best"] if b["kv"] == "q8_0"} == {"on"}
