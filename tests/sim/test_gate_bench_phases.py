"""bench/gate/'s per-phase figures from a synthetic trace (no engine)."""

from __future__ import annotations

import pytest

from bench.gate.__main__ import Trace, _phase_figures, bench_goals
from mesh.sim.scenario import PhaseRecord


def test_every_observation_lands_in_its_phase() -> None:
    t0 = 1000.0
    trace = Trace()
    # windows: 12 tok/s while off (0-2 s, 4-6 s), 4 tok/s while on (2-4 s); floor 10
    trace.windows = [(t0 + t, 4.0 if 2 <= t < 4 else 12.0, 3) for t in (0.5, 1.5, 2.5, 3.5,
                                                                          4.5, 5.5)]
    trace.waits = [(t0 + 0.2, 0.0), (t0 + 2.2, 0.8), (t0 + 3.0, 1.2), (t0 + 5.0, 0.1)]
    trace.token_times = [t0 + k * 0.1 for k in range(60)]  # 10 tok/s all along
    trace.load = [(t0 + t, 3 if t < 2 else 2, 2.0) for t in (0.5, 1.5, 2.5, 3.5, 4.5)]
    f = _phase_figures(trace, t0, 6.0, 10.0, [PhaseRecord(2.0, 4.0)])
    assert set(f) == {"all", "off", "on"}
    assert (f["off"]["time_s"], f["on"]["time_s"]) == (4.0, 2.0)
    assert (f["off"]["windows"], f["on"]["windows"]) == (4, 2)
    assert (f["off"]["share_below_floor"], f["on"]["share_below_floor"]) == (0.0, 1.0)
    assert f["on"]["share_below_half_floor"] == 1.0 and f["all"]["share_below_floor"] == 1 / 3
    assert f["on"]["turn_wait_p50_s"] == pytest.approx(1.0)
    assert f["off"]["turn_wait_p95_s"] == pytest.approx(0.095)
    assert f["on"]["agg_tps"] == pytest.approx(10.0) and f["off"]["agg_tps"] == pytest.approx(10.0)
    assert (f["off"]["max_workers"], f["on"]["mean_workers"]) == (3, 2)
    # no neighbour: the whole run only
    assert set(_phase_figures(trace, t0, 6.0, 10.0, [])) == {"all"}


def test_bench_goals_read_the_runs() -> None:
    def run(policy: str, off: float, on: float) -> dict[str, object]:
        return {"policy": policy, "share_below_floor": (off + on) / 2,
                "share_below_half_floor": 0.0,
                "phases": {"all": {"share_below_floor": (off + on) / 2, "agg_tps": 10.0},
                           "off": {"share_below_floor": off, "agg_tps": 12.0},
                           "on": {"share_below_floor": on, "agg_tps": 8.0}}}

    g = bench_goals([run("floor", 0.02, 0.04), run("static:2", 0.01, 0.3),
                     run("legacy", 0.9, 0.9)])
    assert g["phases"]["off"]["floor_holds"] and g["phases"]["on"]["floor_holds"]
    assert g["phases"]["on"]["statics_holding"] == []
    assert g["vs_legacy"]["windows_under_floor"]["change"] == pytest.approx(0.03 / 0.9 - 1,
                                                                            abs=1e-4)
