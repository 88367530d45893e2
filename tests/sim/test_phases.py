"""Per-phase figures from synthetic runs: spans, attribution, windows, turn starts, tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mesh.sim.compare import write_comparison
from mesh.sim.plots import PANEL_NAMES
from mesh.sim.report import (
    chunk_tokens,
    client_windows,
    phase_of,
    phase_summary,
    phase_table,
    spans,
    summarize,
    turn_starts,
)
from mesh.sim.run import write_report
from mesh.sim.scenario import (
    NeighbourConfig,
    PhaseRecord,
    Sample,
    SimConfig,
    SimRun,
    TaskEvent,
    TaskTimeline,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CPU = NeighbourConfig(kind="cpu", schedule="off:4,on:4")


def _cap(workers: int, min_tps: float, waiting: int = 0) -> dict[str, Any]:
    return {"floor_tps": 10.0, "tickets": workers, "queue_len": 0,
            "sessions": {"total": workers, "decoding": workers, "prefilling": 0},
            "measured_tps": {"min": min_tps, "p50": min_tps},
            "turns": {"running": workers, "waiting": waiting}}


def _turn(turn: int, t0: float, gaps: list[float], chars: list[int]) -> list[TaskEvent]:
    """A turn: turn_started at t0, a first chunk 0.5 s later, then chunks at ``gaps``."""
    events = [TaskEvent(t0, "turn_started", turn=turn)]
    t = t0 + 0.5
    events.append(TaskEvent(t, "text", chars=chars[0]))
    for gap, c in zip(gaps, chars[1:], strict=True):
        t += gap
        events.append(TaskEvent(t, "text", chars=c))
    events.append(TaskEvent(t, "tool_call", turn=turn))
    return events


def make_run(neighbour: NeighbourConfig = CPU, label: str = "") -> SimRun:
    """Two packages, 20 tokens a turn; 5 chunks of 4 chars each per turn (4 tokens each,
    so windows of 8 tokens span two gaps). Turn 1 at 0.0 (gaps 0.2 s: 20 tok/s), turn 2 at
    5.0 (gaps 0.8 s: 5 tok/s). The neighbour is on from 4 to 8 s."""
    run = SimRun(SimConfig(floor_tps=10.0, neighbour=neighbour), {"steps": 2, "plan": False},
                 20, label=label)
    for package in range(2):
        tl = TaskTimeline(package, task_id=f"t{package}", submitted_t=0.0)
        tl.events = [TaskEvent(0.0, "submitted"), TaskEvent(0.0, "admitted"),
                     *_turn(1, 0.0, [0.2] * 4, [4] * 5), *_turn(2, 5.0, [0.8] * 4, [4] * 5)]
        end = 3.0 if package == 0 else 9.0
        tl.events.append(TaskEvent(end, "completed"))
        tl.done_t, tl.state, tl.num_generated = end, "completed", 40
        run.tasks.append(tl)
    run.samples = [Sample(float(t), _cap(2, 5.0 if 4 <= t < 8 else 20.0, waiting=t // 4))
                   for t in range(10)]
    run.wall_s = 10.0
    run.neighbour_phases = [PhaseRecord(4.0, 8.0)]
    return run


def test_spans_cover_the_run_and_attribute_times() -> None:
    run = make_run()
    cut = spans(run)
    assert [(s.state, s.start, s.end) for s in cut] == [
        ("off", 0.0, 4.0), ("on", 4.0, 8.0), ("off", 8.0, 10.0)]
    assert [phase_of(cut, t) for t in (0.0, 3.99, 4.0, 7.99, 8.0, 12.0)] == [
        "off", "off", "on", "on", "off", "off"]
    assert spans(make_run(NeighbourConfig())) == []  # no neighbour, no phases


def test_client_windows_leave_out_the_first_chunk_and_estimate_tokens() -> None:
    windows = client_windows(make_run())
    # per task: turn 1 two windows of 8 tokens over 0.4 s; turn 2 two over 1.6 s
    assert len(windows) == 8
    assert sorted({round(w.tps, 6) for w in windows}) == [5.0, 20.0]
    assert {round(w.t, 6) for w in windows if w.tps == pytest.approx(20.0)} == {0.5, 0.9}
    tokens = chunk_tokens(make_run())
    assert sum(n for _, n in tokens) == pytest.approx(80.0)  # 2 tasks x 2 turns x 20


def test_a_window_spans_enough_time_for_the_stamps_jitter() -> None:
    """Chunks 10 ms apart (a fast model, or two chunks read at once): 8 tokens take 20 ms,
    too short to time; each window runs on until it spans 0.25 s."""
    run = make_run(NeighbourConfig())
    task = run.tasks[0]
    task.events = [*_turn(1, 0.0, [0.01] * 60, [4] * 61)]  # 61 chunks, 20 tokens in all
    run.tasks = [task]
    windows = client_windows(run)
    assert windows and all(w.tps == pytest.approx(20 / 61 / 0.01, rel=0.1) for w in windows)
    assert len(windows) == 2  # 60 gaps of 10 ms: two windows of 26 gaps (0.26 s)


def test_one_token_per_chunk_is_counted_exactly_whatever_its_characters() -> None:
    """A slow turn (each token its own chunk, 0.125 s apart: 8 tok/s) of tokens 1 to 12
    characters long: every window is 8 tokens over 1 s, not a rate scaled by characters."""
    run = make_run(NeighbourConfig())
    chars = [1, 12, 2, 11, 3, 10, 1, 12, 2, 11, 3, 10, 1, 12, 2, 11, 3, 10, 1, 12]
    task = run.tasks[0]
    task.events = [*_turn(1, 0.0, [0.125] * 19, chars)]  # 20 chunks, 20 tokens
    run.tasks = [task]
    windows = client_windows(run)
    assert len(windows) == 2
    assert all(w.tps == pytest.approx(8.0) for w in windows)
    assert [n for _, n in chunk_tokens(run)] == [1.0] * 20


def test_no_window_spans_a_pause_of_the_decode_gate() -> None:
    """A turn paused for 3 s mid-way (shed: waiting, not decoding): the windows before
    and after are timed; none spans the pause."""
    run = make_run(NeighbourConfig())
    task = run.tasks[0]
    events = _turn(1, 0.0, [0.2, 0.2, 3.2, 0.2, 0.2, 0.2, 0.2], [4] * 8)
    events.insert(4, TaskEvent(3.5, "paused", turn=1))  # between the 3rd and 4th chunk
    task.events = events
    run.tasks = [task]
    windows = client_windows(run)
    # 20 tokens over 8 chunks: 2.5 tokens every 0.2 s = 12.5 tok/s, the pause left out
    # (spanning it, a window would read ~2.8 tok/s)
    assert windows and all(w.tps == pytest.approx(12.5) for w in windows)


def test_turn_starts_come_from_the_gate_when_events_carry_it() -> None:
    run = make_run()
    starts, source = turn_starts(run)
    assert source == "client" and sorted(s for _, s in starts) == [0.5] * 4
    run.tasks[0].events.append(TaskEvent(5.9, "tool_call", turn=2, wait_s=0.25))
    starts, source = turn_starts(run)
    assert (source, starts) == ("gate", [(5.0, 0.25)])


def test_phase_summary_attributes_each_observation_to_its_phase() -> None:
    ph = phase_summary(make_run())
    assert [s["state"] for s in ph["spans"]] == ["off", "on", "off"]
    off, on, whole = ph["off"], ph["on"], ph["all"]
    assert (off["time_s"], on["time_s"], whole["time_s"]) == (6.0, 4.0, 10.0)
    # windows: the fast turn is off, the slow one on (floor 10)
    assert (off["windows"], on["windows"]) == (4, 4)
    assert (off["windows_under_floor"], on["windows_under_floor"]) == (0.0, 1.0)
    assert on["windows_under_half_floor"] == 0.0  # 5 tok/s is not under 5
    assert whole["windows_under_floor"] == 0.5
    # deliveries by their end: 3.0 is off, 9.0 is off too (after the neighbour stopped)
    assert (off["delivered"], on["delivered"]) == (2, 0)
    assert on["p50_delivery_s"] is None and off["p50_delivery_s"] == pytest.approx(6.0)
    # samples 0-3 and 8-9 off (20 tok/s), 4-7 on (5 tok/s, under the floor)
    assert (off["samples_under_floor"], on["samples_under_floor"]) == (0.0, 1.0)
    assert on["mean_waiting"] == pytest.approx(1.0) and off["mean_waiting"] == pytest.approx(
        (0 * 4 + 2 * 2) / 6, abs=1e-3)
    # tokens by chunk arrival: turn 1 (0.5-1.3 s) off, turn 2 (5.5-8.7 s): 4 chunks on
    assert on["agg_tps"] == pytest.approx(2 * 4 * 4 / 4.0)
    assert whole["agg_tps"] == pytest.approx(80 / 10.0)
    assert (on["mean_workers"], on["max_workers"], on["mean_running"]) == (2.0, 2, 2.0)
    # turn starts: turn 1 at 0 (off), turn 2 at 5 (on)
    assert (off["turns"], on["turns"]) == (2, 2)


def test_a_run_without_a_neighbour_has_only_the_whole_run() -> None:
    ph = phase_summary(make_run(NeighbourConfig()))
    assert "on" not in ph and "off" not in ph and ph["all"]["windows"] == 8


def test_the_per_phase_table_has_a_row_per_run() -> None:
    rows = [("policy=floor", phase_summary(make_run())),
            ("policy=none", phase_summary(make_run(NeighbourConfig())))]
    table = phase_table(rows, "on")
    lines = table.splitlines()
    assert lines[0].startswith("| run | time (s) | delivered |")
    assert "windows < floor" in lines[0] and "turn start p95 (s)" in lines[0]
    assert lines[2].startswith("| policy=floor | 4.00 | 0 |") and "| 100.0 % |" in lines[2]
    assert lines[3] == "| policy=none |" + " – |" * (len(lines[2].split("|")) - 3)


def test_the_summary_and_the_report_carry_the_phases(tmp_path: Path) -> None:
    run = make_run()
    s = summarize(run)
    assert s["windows_under_floor"] == 0.5 and s["turn_start_p50_s"] == 0.5
    assert s["turn_start_source"] == "client"
    files = write_report(run, tmp_path)
    doc = json.loads(files.json.read_text())
    assert doc["phases"]["on"]["windows_under_floor"] == 1.0
    assert doc["neighbour"]["on"] == [{"start": 4.0, "end": 8.0}]
    md = files.markdown.read_text()
    assert "Neighbour `cpu`, schedule `off:4,on:4`: on 4.0–8.0 s" in md
    assert "| on | 4.00 |" in md


def test_the_comparison_writes_per_phase_tables_and_one_panel_per_run(tmp_path: Path) -> None:
    runs = [make_run(label="policy=floor"), make_run(label="policy=static:2")]
    result = write_comparison("policy", ["floor", "static:2"], runs,
                              [summarize(r) for r in runs], tmp_path)
    md = result.table.read_text()
    for heading in ("## Neighbour off", "## Neighbour on", "## Whole run", "## Goals"):
        assert heading in md
    assert sum(line.startswith("| policy=static:2 |") for line in md.splitlines()) == 3
    assert [p.stem for p in result.plots] == list(PANEL_NAMES)
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in result.plots)
    doc = json.loads((tmp_path / "compare.json").read_text())
    assert doc["runs"][1]["phases"]["off"]["windows_under_floor"] == 0.0
    assert doc["goals"]["phases"]["on"]["floor_holds"] is False
