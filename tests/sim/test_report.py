"""Report writing is pure: synthetic runs in, files and a complete summary out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mesh.sim.compare import (
    apply_value,
    lowest_p50,
    parse_compare,
    sweet_spot,
    write_comparison,
    write_sweep,
)
from mesh.sim.plots import PANEL_NAMES, PLOT_NAMES
from mesh.sim.report import SUMMARY_KEYS, percentile, summarize
from mesh.sim.run import write_report
from mesh.sim.scenario import Sample, SimConfig, SimRun, TaskEvent, TaskTimeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _cap(workers: int, queue: int, decoding: int, min_tps: float | None) -> dict[str, Any]:
    return {
        "floor_tps": 4.0,
        "policy": "floor",
        "sessions": {"total": workers, "prefilling": 0, "decoding": decoding, "idle": 0},
        "tickets": workers,
        "measured_tps": {"count": workers, "min": min_tps, "p50": min_tps},
        "queue_len": queue,
        "kv_cells": {
            "used": 100 + 10 * workers,
            "total": 4096,
            "prefix": 100,
            "naive_equivalent": 110 * workers,
            "reduction": (110 * workers) / (100 + 10 * workers) if workers else 1.0,
        },
    }


def _task(package: int, start: float, end: float | None, state: str = "completed") -> TaskTimeline:
    t = TaskTimeline(package, task_id=f"t{package}", submitted_t=start)
    t.events = [
        TaskEvent(start, "submitted"),
        TaskEvent(start + 0.1, "admitted"),
        TaskEvent(start + 0.1, "turn_started", turn=1),
        TaskEvent(start + 0.5, "tool_call", turn=1),
        TaskEvent(start + 0.7, "turn_started", turn=2),
        TaskEvent(start + 0.9, "tool_call", turn=2),
    ]
    if end is not None:
        t.events.append(TaskEvent(end, state))
        t.done_t, t.state = end, state
        t.num_generated = 16 if state == "completed" else 0
    return t


def make_run(pool: str = "shared", label: str = "") -> SimRun:
    run = SimRun(SimConfig(pool=pool, floor_tps=4.0), {"steps": 2, "packages": []}, 8)
    caps = [(0, 0, 0, None), (2, 1, 2, 5.0), (2, 1, 2, 3.0), (2, 0, 1, 1.0), (1, 0, 0, 9.0)]
    run.samples = [Sample(0.25 * i, _cap(*c)) for i, c in enumerate(caps)]
    run.tasks = [_task(0, 0.0, 1.0), _task(1, 0.0, 2.0), _task(2, 0.0, None)]
    run.tasks[2].state, run.tasks[2].done_t = "error", 2.5
    run.wall_s = 2.5
    run.server = {"url": "http://127.0.0.1:1"}
    run.label = label
    return run


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0], 95) == pytest.approx(1.95)


def test_summary_has_every_key_with_the_defined_values() -> None:
    s = summarize(make_run())
    assert set(SUMMARY_KEYS) <= set(s)
    assert s["submitted"] == 3 and s["delivered"] == 2 and s["failed"] == 1
    assert s["p50_delivery_s"] == pytest.approx(1.5)
    assert s["p95_delivery_s"] == pytest.approx(1.95)
    assert s["max_workers"] == 2
    assert s["mean_workers"] == pytest.approx(1.4)
    # Samples with a decoding worker: min 5, 3, 1 against floor 4.
    assert s["time_under_floor"] == pytest.approx(2 / 3, abs=1e-4)
    assert s["deep_sub_floor"] == pytest.approx(1 / 3, abs=1e-4)
    assert s["agg_tps"] == pytest.approx(32 / 2.5)
    assert s["kv_reduction_peak"] == pytest.approx(220 / 120, abs=1e-3)
    assert s["prefill_tokens_saved"] == 100 * 3  # three workers attached to 100 cells
    assert summarize(make_run(pool="naive"))["prefill_tokens_saved"] == 0


def test_an_empty_run_summarizes_without_error() -> None:
    run = SimRun(SimConfig(), {}, 8)
    s = summarize(run)
    assert set(SUMMARY_KEYS) <= set(s)
    assert s["p50_delivery_s"] is None and s["kv_reduction_peak"] is None
    assert s["time_under_floor"] == 0.0


def test_turn_rates_come_from_turn_start_to_tool_call() -> None:
    rates = _task(0, 0.0, 1.0).turn_rates(8)
    assert [(turn, round(tps, 6)) for turn, _, _, tps in rates] == [(1, 20.0), (2, 40.0)]


def test_write_report_writes_json_markdown_and_plots(tmp_path: Path) -> None:
    files = write_report(make_run(), tmp_path / "out")
    doc = json.loads(files.json.read_text(encoding="utf-8"))
    assert set(SUMMARY_KEYS) <= set(doc["summary"])
    assert {"config", "samples", "tasks", "scenario", "server"} <= set(doc)
    assert len(doc["samples"]) == 5 and doc["samples"][1]["capacity"]["tickets"] == 2
    assert [e["kind"] for e in doc["tasks"][0]["events"]][-1] == "completed"
    md = files.markdown.read_text(encoding="utf-8")
    assert "| p50 delivery (s) | 1.50 |" in md
    assert [p.stem for p in files.plots] == list(PLOT_NAMES)
    for p in files.plots:
        assert p.read_bytes().startswith(PNG_MAGIC)


def test_comparison_puts_runs_side_by_side(tmp_path: Path) -> None:
    runs = [make_run("shared", "pool=shared"), make_run("naive", "pool=naive")]
    result = write_comparison(
        "pool", ["shared", "naive"], runs, [summarize(r) for r in runs], tmp_path
    )
    table = result.table.read_text(encoding="utf-8")
    assert "| metric | pool=shared | pool=naive |" in table
    assert "| prefill tokens saved | 300 | 0 |" in table
    doc = json.loads((tmp_path / "compare.json").read_text(encoding="utf-8"))
    assert [r["label"] for r in doc["runs"]] == ["pool=shared", "pool=naive"]
    assert [p.stem for p in result.plots] == list(PANEL_NAMES)
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in result.plots)


def test_sweet_spot_is_the_knee_within_the_floor_budget() -> None:
    base = {"submitted": 4, "delivered": 4}
    summaries = [
        {**base, "p50_delivery_s": 9.0, "agg_tps": 30.0, "time_under_floor": 0.0},  # 2
        {**base, "p50_delivery_s": 5.0, "agg_tps": 28.5, "time_under_floor": 0.02},  # 4
        {**base, "p50_delivery_s": 6.0, "agg_tps": 25.0, "time_under_floor": 0.0},  # 6
        {**base, "p50_delivery_s": 8.0, "agg_tps": 20.0, "time_under_floor": 0.0},  # 8
        {**base, "p50_delivery_s": 3.0, "agg_tps": 40.0, "time_under_floor": 0.30},  # 1
        {**base, "delivered": 3, "p50_delivery_s": 1.0, "agg_tps": 50.0,
         "time_under_floor": 0.0},  # 0.5: lost one
    ]
    floors = [2, 4, 6, 8, 1, 0.5]
    # From 8 down: 20 -> 25 (+25 %) -> 28.5 (+14 %) -> 30 (+5 %): the knee is 4; the
    # floors under it are out (too often under the floor, or a package lost).
    assert sweet_spot(floors, summaries) == 4
    assert lowest_p50(floors, summaries) == 4
    assert sweet_spot([6, 8], summaries[2:4]) == 6  # every step adds 10 %: the lowest
    assert sweet_spot([1], summaries[4:5]) is None


def test_write_sweep_names_the_sweet_spot(tmp_path: Path) -> None:
    runs = [make_run(), make_run()]
    for run in runs:
        run.tasks.pop()  # every package delivered
    result = write_sweep([2.0, 4.0], [summarize(r) for r in runs], tmp_path, max_under=1.0)
    # The same aggregate at both floors: the lower one adds nothing, the knee is 4.
    assert result.best == 4.0
    assert "Sweet spot: floor **4**" in result.table.read_text(encoding="utf-8")
    assert result.plot.read_bytes().startswith(PNG_MAGIC)
    doc = json.loads((tmp_path / "sweep.json").read_text(encoding="utf-8"))
    assert doc["sweet_spot"] == 4.0 and len(doc["summaries"]) == 2


def test_parse_compare() -> None:
    assert parse_compare("policy=floor,legacy") == ("policy", ["floor", "legacy"])
    assert parse_compare("pool=shared, naive") == ("pool", ["shared", "naive"])
    for bad in ("policy=floor", "speed=1,2", "policy", "pool=shared,shared"):
        with pytest.raises(ValueError, match="--compare"):
            parse_compare(bad)


def test_apply_value_validates() -> None:
    config = SimConfig()
    assert apply_value(config, "floor", "6").floor_tps == 6.0
    assert apply_value(config, "policy", "static:3").policy == "static:3"
    with pytest.raises(ValueError, match="pool must be"):
        apply_value(config, "pool", "bogus")
    with pytest.raises(ValueError, match="policy must be"):
        apply_value(config, "policy", "static")
    assert apply_value(config, "policy", "projection").policy == "projection"
    assert apply_value(config, "neighbour", "cpu").neighbour.kind == "cpu"
    with pytest.raises(ValueError, match="neighbour must be one of"):
        apply_value(config, "neighbour", "gpu")


def _planned_task(package: int, start: float) -> TaskTimeline:
    t = TaskTimeline(package, task_id=f"t{package}", submitted_t=start)
    t.events = [
        TaskEvent(start, "submitted"),
        TaskEvent(start + 0.1, "admitted", subtask="plan"),
        TaskEvent(start + 0.6, "plan"),
        TaskEvent(start + 0.6, "admitted", subtask="p1"),
        TaskEvent(start + 0.7, "turn_started", turn=1, subtask="p1"),
        TaskEvent(start + 1.1, "admitted", subtask="synthesis"),
        TaskEvent(start + 1.4, "completed"),
    ]
    t.done_t, t.state, t.num_generated = start + 1.4, "completed", 12
    return t


def test_a_planned_run_shows_its_planner_and_synthesis_sessions(tmp_path: Path) -> None:
    from mesh.sim.report import kv_series, role_spans

    run = make_run()
    run.scenario["plan"] = True
    run.tasks = [_planned_task(0, 0.0), _planned_task(1, 0.5)]
    run.samples.append(Sample(1.25, _cap(1, 0, 1, 5.0)))
    assert role_spans(run.tasks[0]) == [("planner", 0.1, 0.6), ("synthesis", 1.1, 1.4)]
    series = kv_series(run)
    assert [r["t"] for r in series] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]
    assert [r["planner"] for r in series] == [0, 1, 1, 1, 1, 0]  # 0.1-0.6 and 0.6-1.1
    assert [r["synthesis"] for r in series] == [0, 0, 0, 0, 0, 1]  # 1.1-1.4 and 1.6-1.9
    assert series[1]["used"] == 120 and series[1]["naive"] == 220
    s = summarize(run)
    assert (s["planned"], s["planner_sessions"], s["synthesis_sessions"]) == (True, 2, 2)
    assert s["prefill_tokens_saved"] == 100 * 6  # planner, worker and synthesis per task
    files = write_report(run, tmp_path / "planned")
    doc = json.loads(files.json.read_text())
    assert doc["kv_series"] == series
    assert (tmp_path / "planned" / "kv_cells.png").read_bytes().startswith(PNG_MAGIC)
    assert "2 planner and 2 synthesis sessions ran" in files.markdown.read_text()
    # an unplanned run has no coordinator sessions in its series
    assert not any(r["planner"] or r["synthesis"] for r in kv_series(make_run()))
