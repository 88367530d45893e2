"""Issue 25's goals read off synthetic per-phase figures."""

from __future__ import annotations

from typing import Any

import pytest

from mesh.sim.compare import goals, goals_markdown


def _ph(off: tuple[float, float], on: tuple[float, float]) -> dict[str, Any]:
    """(share of windows under the floor, agg tok/s) off and on."""
    return {
        "off": {"windows_under_floor": off[0], "agg_tps": off[1]},
        "on": {"windows_under_floor": on[0], "agg_tps": on[1]},
        "all": {"windows_under_floor": (off[0] + on[0]) / 2, "agg_tps": (off[1] + on[1]) / 2},
    }


POLICIES = ["floor", "legacy", "static:1", "static:2", "static:4"]
PHASES = [
    _ph((0.03, 20.0), (0.04, 11.0)),  # floor: holds in both, adapts
    _ph((0.90, 30.0), (1.00, 25.0)),  # legacy
    _ph((0.00, 12.0), (0.02, 10.0)),  # static:1 holds in both, too slow off
    _ph((0.04, 21.0), (0.40, 14.0)),  # static:2 holds off only
    _ph((0.50, 28.0), (0.90, 16.0)),  # static:4 never holds
]
SUMMARIES = [
    {"wall_s": 88.0, "p50_delivery_s": 40.0, "time_under_floor": 0.10, "deep_sub_floor": 0.02,
     "windows_under_floor": 0.035, "windows_under_half_floor": 0.01},
    {"wall_s": 100.0, "p50_delivery_s": 80.0, "time_under_floor": 0.95, "deep_sub_floor": 0.5,
     "windows_under_floor": 0.95, "windows_under_half_floor": 0.6},
    {}, {}, {},
]


def test_the_goals_per_phase() -> None:
    g = goals(POLICIES, PHASES, SUMMARIES, hold=0.05)
    off, on = g["phases"]["off"], g["phases"]["on"]
    assert off["floor_holds"] and on["floor_holds"]
    assert off["statics_holding"] == ["static:1", "static:2"]
    assert off["best_holding_static"] == "static:2"
    assert off["floor_share_of_best"] == pytest.approx(20 / 21, abs=1e-4)
    assert on["statics_holding"] == ["static:1"]
    assert on["floor_share_of_best"] == pytest.approx(11 / 10, abs=1e-4)
    # static:1 holds in both but is under 90 % of the floor gate's tok/s off: not both
    s1 = g["statics"]["static:1"]
    assert s1["off"] == {"holds": True, "agg_tps": 12.0, "reaches_floor_tps": False}
    assert s1["on"]["holds"] and s1["on"]["reaches_floor_tps"]
    assert not any(r["both_in_every_phase"] for r in g["statics"].values())
    vs = g["vs_legacy"]
    assert vs["wall_s"] == {"change": -0.12, "source": -0.12}
    assert vs["p50_delivery_s"]["change"] == pytest.approx(-0.5)
    assert vs["windows_under_floor"]["source"] is None


def test_a_static_that_does_both_is_named() -> None:
    phases = list(PHASES)
    phases[2] = _ph((0.0, 19.0), (0.0, 10.5))
    g = goals(POLICIES, phases, SUMMARIES)
    assert g["statics"]["static:1"]["both_in_every_phase"] is True
    md = goals_markdown(g)
    assert "| static:1 | yes / yes | yes / yes | yes |" in md


def test_the_markdown_has_a_row_per_phase_and_the_legacy_deltas() -> None:
    md = goals_markdown(goals(POLICIES, PHASES, SUMMARIES))
    assert "| off | 3.0 % | yes | static:1, static:2 | static:2 | 95.2 % |" in md
    assert "| on | 4.0 % | yes | static:1 | static:1 | 110.0 % |" in md
    assert "| wall_s | -12.0 % | -12.0 % |" in md


def test_without_a_neighbour_or_a_floor_run_nothing_breaks() -> None:
    whole = [{"all": p["all"]} for p in PHASES]
    g = goals(POLICIES, whole, SUMMARIES)
    assert list(g["phases"]) == ["all"]
    g = goals(["static:1", "static:2"], whole[2:4], SUMMARIES[2:4])
    assert g["phases"]["all"]["floor_holds"] is None and "vs_legacy" not in g
    goals_markdown(g)
