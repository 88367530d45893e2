"""A tiny-model simulation over real HTTP: ``mesh simulate`` starts ``mesh serve``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mesh.cli import simulate
from mesh.sim.plots import PLOT_NAMES
from mesh.sim.report import SUMMARY_KEYS


def _scenario(packages: int = 3) -> list[str]:
    # One llama.cpp thread: the harness shares the machine's cores with the server.
    return [
        "--model",
        "tiny",
        "--template",
        "light",
        "--packages",
        str(packages),
        "--steps",
        "2",
        "--tokens-per-step",
        "6",
        "--seed",
        "5",
        "--serve-arg=--threads",
        "--serve-arg=1",
        "--no-progress",
    ]


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mesh")
    simulate.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return int(args.func(args))


def _schedule(doc: dict[str, object]) -> object:
    scenario = doc["scenario"]
    assert isinstance(scenario, dict)
    return scenario["packages"]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    out = tmp_path_factory.mktemp("sim") / "report"
    assert _main(["simulate", *_scenario(), "--floor-tps", "1", "--out", str(out)]) == 0
    return out, json.loads((out / "report.json").read_text(encoding="utf-8"))


def test_every_package_is_delivered_and_the_summary_is_complete(
    report: tuple[Path, dict[str, object]],
) -> None:
    out, doc = report
    summary = doc["summary"]
    assert isinstance(summary, dict)
    assert set(SUMMARY_KEYS) <= set(summary)
    assert summary["submitted"] == summary["delivered"] == 3
    assert summary["p50_delivery_s"] is not None and summary["p95_delivery_s"] is not None
    assert summary["max_workers"] >= 1
    assert summary["kv_reduction_peak"] >= 1.0
    assert summary["prefill_tokens_saved"] > 0  # shared pool: workers attached to the prefix
    assert summary["agg_tps"] > 0
    assert (out / "report.md").read_text(encoding="utf-8").startswith("# mesh simulate")
    for name in PLOT_NAMES:
        assert (out / f"{name}.png").stat().st_size > 0


def test_each_task_timeline_shows_its_turns_and_tool_calls(
    report: tuple[Path, dict[str, object]],
) -> None:
    _, doc = report
    tasks = doc["tasks"]
    assert isinstance(tasks, list) and len(tasks) == 3
    for task in tasks:
        kinds = [e["kind"] for e in task["events"]]
        assert kinds[0] == "submitted" and kinds[-1] == "completed"
        assert "admitted" in kinds
        assert [e["turn"] for e in task["events"] if e["kind"] == "turn_started"] == [1, 2]
        assert kinds.count("tool_call") == kinds.count("tool_result") == 2
        assert task["num_generated"] == 2 * 6
        times = [e["t"] for e in task["events"]]
        assert times == sorted(times)
    samples = doc["samples"]
    assert isinstance(samples, list) and samples
    assert {"floor_tps", "sessions", "kv_cells", "queue_len"} <= set(samples[0]["capacity"])


def test_the_same_seed_gives_the_same_schedule_through_the_cli(
    report: tuple[Path, dict[str, object]], tmp_path: Path
) -> None:
    _, doc = report
    out = tmp_path / "again"
    assert _main(["simulate", *_scenario(), "--policy", "none", "--out", str(out)]) == 0
    again = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert _schedule(again) == _schedule(doc)


def test_compare_pools_writes_one_table(tmp_path: Path) -> None:
    code = _main(
        ["simulate", *_scenario(2), "--compare", "pool=shared,naive", "--out", str(tmp_path)]
    )
    assert code == 0
    table = (tmp_path / "compare.md").read_text(encoding="utf-8")
    assert "| metric | pool=shared | pool=naive |" in table
    naive = json.loads((tmp_path / "pool-naive" / "report.json").read_text(encoding="utf-8"))
    assert naive["summary"]["prefill_tokens_saved"] == 0
    assert naive["summary"]["delivered"] == 2


def test_sweep_reports_each_floor_and_a_plot(tmp_path: Path) -> None:
    code = _main(
        ["sweep", *_scenario(2), "--floors", "1,2", "--max-under", "1", "--out", str(tmp_path)]
    )
    assert code == 0
    doc = json.loads((tmp_path / "sweep.json").read_text(encoding="utf-8"))
    assert doc["floors"] == [1.0, 2.0]
    assert doc["sweet_spot"] in (1.0, 2.0)  # both deliver; the knee rule picks one
    assert doc["lowest_p50"] in (1.0, 2.0) and doc["rule"].startswith("knee")
    assert (tmp_path / "sweep.png").stat().st_size > 0
    assert (tmp_path / "floor-2" / "report.json").exists()


def test_a_planned_scenario_shows_planner_and_synthesis_sessions(tmp_path: Path) -> None:
    out = tmp_path / "planned"
    assert _main(["simulate", *_scenario(2), "--plan", "--out", str(out)]) == 0
    doc = json.loads((out / "report.json").read_text(encoding="utf-8"))
    summary = doc["summary"]
    assert summary["planned"] is True and summary["delivered"] == 2
    assert summary["planner_sessions"] == summary["synthesis_sessions"] == 2
    for task in doc["tasks"]:
        keys = [e["subtask"] for e in task["events"] if e["kind"] == "admitted"]
        assert keys[0] == "plan" and keys[-1] == "synthesis" and len(keys) >= 3
    series = doc["kv_series"]
    assert any(r["planner"] for r in series) or any(r["synthesis"] for r in series)
    assert (out / "kv_cells.png").stat().st_size > 0
    # the unplanned report of the same scenario has none (scenario runs bypass planning)
    plain = tmp_path / "plain"
    assert _main(["simulate", *_scenario(2), "--out", str(plain)]) == 0
    doc = json.loads((plain / "report.json").read_text(encoding="utf-8"))
    assert doc["summary"]["planner_sessions"] == doc["summary"]["synthesis_sessions"] == 0
    assert not any(r["planner"] or r["synthesis"] for r in doc["kv_series"])


def test_a_cpu_neighbour_comes_and_goes_during_the_run(tmp_path: Path) -> None:
    out = tmp_path / "neighbour"
    argv = ["simulate", *_scenario(3), "--steps", "3", "--tokens-per-step", "16",
            "--floor-tps", "1", "--neighbour", "cpu", "--neighbour-schedule", "off:0.3,on:0.6",
            "--out", str(out)]
    assert _main(argv) == 0
    doc = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert doc["config"]["neighbour"]["kind"] == "cpu"
    on = doc["neighbour"]["on"]
    assert on and on[0]["start"] >= 0.3 and all(s["end"] > s["start"] for s in on)
    assert all(s["end"] <= doc["summary"]["wall_s"] + 1.0 for s in on)  # stopped at the end
    phases = doc["phases"]
    assert {"all", "off", "on"} <= set(phases)
    assert phases["on"]["time_s"] > 0 and phases["off"]["time_s"] > 0
    # (the tiny model's turns are too short for client windows)
    assert phases["all"]["agg_tps"] > 0 and phases["all"]["turns"] == 9
    assert phases["off"]["turns"] + phases["on"]["turns"] == 9
    assert "Neighbour `cpu`, schedule `off:0.3,on:0.6`" in (out / "report.md").read_text()
