"""``mesh simulate --scenario idle-agents`` (issue 28): more agents than resident slots,
each a tool loop with long seeded idle gaps, on a server that parks idle sessions."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from mesh.cli import simulate
from mesh.sim.plots import PARKING_PLOT
from mesh.sim.processes import serve_command
from mesh.sim.report import parking_series, parking_summary
from mesh.sim.scenario import IdleAgentsConfig, Sample, SimConfig, SimRun, TaskTimeline, plan_for


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mesh")
    simulate.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_the_scenario_draws_long_seeded_gaps_and_four_agents_per_slot() -> None:
    idle = IdleAgentsConfig(resident=3, idle_s=6.0, idle_min_s=2.0)
    config = SimConfig(scenario="idle-agents", idle=idle, steps=4)
    scenario = plan_for(config)
    assert len(scenario.packages) == 12  # 4 x resident
    gaps = [s.latency_s for p in scenario.packages for s in p.steps]
    assert min(gaps) >= 2.0 and max(gaps) <= 60.0
    assert sorted(gaps)[len(gaps) // 2] > 3.0  # around the 6 s median, not the template's
    assert plan_for(config) == scenario  # seeded
    default = plan_for(SimConfig(steps=4))
    assert max(s.latency_s for p in default.packages for s in p.steps) <= 6.0


def test_the_server_started_here_parks_with_fewer_slots_than_agents(tmp_path: Path) -> None:
    idle = IdleAgentsConfig(resident=2, park_idle_s=0.5, park_memory_gib=0.0)
    cmd = serve_command(SimConfig(scenario="idle-agents", idle=idle, packages=7), 1, tmp_path)
    at = cmd.index("--max-sessions")
    assert cmd[at:at + 8] == ["--max-sessions", "2", "--max-attached", "7", "--park-idle",
                              "0.5", "--park-memory", "0"]
    assert "--park-idle" not in serve_command(SimConfig(), 1, tmp_path)


@pytest.mark.parametrize(("config", "match"), [
    (SimConfig(scenario="idle"), "scenario must be one of"),
    (SimConfig(scenario="idle-agents", idle=IdleAgentsConfig(resident=0)), "--resident"),
    (SimConfig(scenario="idle-agents", idle=IdleAgentsConfig(idle_s=90.0)), "<= 60 s"),
    (SimConfig(scenario="idle-agents", plan=True), "drop --plan"),
])
def test_bad_settings_name_the_fix(config: SimConfig, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        config.validate()


def _cap(total: int, parked: int, parks: int) -> dict[str, Any]:
    return {"sessions": {"total": total}, "kv_cells": {"used": 100 + 10 * (total - parked),
                                                       "total": 400},
            "parking": {"resident": total - parked, "parked": parked, "parked_tokens": 10 * parked,
                        "parks": parks, "resumes": parks, "swaps": 0, "resume_tokens": 0,
                        "parked_bytes": 0, "max_attached": 8}}


def test_the_summary_counts_parked_samples_and_short_packages() -> None:
    scenario = {"packages": [{"index": i, "steps": [{"tokens": 4}, {"tokens": 4}]}
                             for i in range(3)]}
    run = SimRun(SimConfig(scenario="idle-agents"), scenario, 4)
    run.samples = [Sample(0.0, _cap(3, 0, 0)), Sample(1.0, _cap(3, 2, 2)),
                   Sample(2.0, _cap(1, 1, 3))]
    run.tasks = [TaskTimeline(0, state="completed", submitted_t=0.0, done_t=2.0, num_generated=8),
                 TaskTimeline(1, state="completed", submitted_t=0.0, done_t=2.0, num_generated=5),
                 TaskTimeline(2, state="error")]
    rows = parking_series(run)
    assert [(r["resident"], r["parked"]) for r in rows] == [(3, 0), (1, 2), (0, 1)]
    assert rows[1]["parked_cells"] == 20
    figures = parking_summary(run)
    assert figures["parked_samples"] == 2 and figures["parked_peak"] == 2
    assert figures["parks"] == 3 and figures["max_attached"] == 8
    assert figures["lost_packages"] == 1 and figures["short_packages"] == [1]


def test_a_tiny_idle_agents_run_parks_and_loses_nothing(tmp_path: Path) -> None:
    """Five agents on two resident slots, 1 s idle gaps, parked after 0.2 s idle."""
    out = tmp_path / "report"
    argv = ["simulate", "--model", "tiny", "--scenario", "idle-agents", "--resident", "2",
            "--packages", "5", "--steps", "2", "--tokens-per-step", "4", "--idle", "1",
            "--idle-sigma", "0.2", "--park-idle", "0.2", "--seed", "3", "--floor-tps", "1",
            "--serve-arg=--threads", "--serve-arg=1", "--no-progress", "--out", str(out)]
    assert _main(argv) == 0
    doc = json.loads((out / "report.json").read_text(encoding="utf-8"))
    summary = doc["summary"]
    assert summary["submitted"] == summary["delivered"] == 5
    parking = summary["parking"]
    assert parking["parked_samples"] > 0 and parking["parks"] > 0
    assert parking["resident_peak"] <= 2 < parking["attached_peak"]
    assert parking["lost_packages"] == 0 and parking["short_packages"] == []
    assert all(t["num_generated"] == 2 * 4 for t in doc["tasks"])
    assert any(row["parked"] > 0 for row in doc["parking_series"])
    assert (out / f"{PARKING_PLOT}.png").stat().st_size > 0
    assert "Parking: up to" in (out / "report.md").read_text(encoding="utf-8")
