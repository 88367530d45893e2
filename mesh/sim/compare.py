"""Comparing runs: the goals a comparison is judged by (issue 25; docs/gate.md), then
comparisons and sweeps of the same seeded scenario over one setting.

Goals, per phase (neighbour off / on, and the whole run), with ``hold`` the share of client
windows under the floor a run may have and still *hold the floor* (5 % light and
gate_bench, 10 % heavy): does the floor gate hold the floor; its aggregate tokens/s against
the best ``static:N`` that holds it (goal: at least 90 %); for each ``static:N``, does it
hold the floor *and* reach 90 % of the floor gate's tokens/s (the goal: none does both in
both phases); and against ``legacy`` over the whole run, the relative change of wall, p50
delivery, time under the floor and deep sub-floor beside the source system's.

``--compare KEY=V1,V2`` gives each run its own report folder (``OUT/<key>-<value>/``) and
adds its tables (``compare.md``, ``compare.json``: per neighbour phase, one row per run)
and panels (:mod:`mesh.sim.plots`) in ``OUT``. The floor sweep adds ``sweep.md``,
``sweep.json`` and ``sweep.png`` and names the sweet spot, the knee over floors: among the
floors that delivered every package and kept time under the floor at or below
``max_under``, going from the highest floor down, the last floor before the next lower one
stops adding :data:`KNEE_GAIN` to the aggregate tokens/s. (``--floor-tps auto`` finds its
knee over rows instead, from the step's shared part: :mod:`mesh.gate.decode_gate`.)
The lowest p50 delivery is reported beside it.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesh.gate.decode_gate import KNEE_GAIN
from mesh.sim.plots import write_panels, write_sweep_plot
from mesh.sim.report import (
    MIN_WINDOW_S,
    MIN_WINDOW_TOKENS,
    Summary,
    markdown_table,
    num,
    phase_summary,
    phase_table,
    summary_table,
    write_json,
)
from mesh.sim.run import write_report
from mesh.sim.scenario import SimConfig, SimRun

__all__ = [
    "COMPARE_KEYS", "SOURCE_VS_LEGACY", "CompareResult", "RunOne", "SweepResult", "apply_value",
    "goals", "goals_markdown", "lowest_p50", "parse_compare", "run_compare", "run_sweep",
    "sweet_spot"
]


# -------------------- goals ---------------------------------------------------

SOURCE_VS_LEGACY = {"wall_s": -0.12, "p50_delivery_s": -0.43, "time_under_floor": -0.52,
                    "deep_sub_floor": -0.83}
_THROUGHPUT_SHARE = 0.9


def _change(new: Any, old: Any) -> float | None:
    a, b = num(new), num(old)
    if a is None or b is None or b == 0:
        return None
    return round(a / b - 1.0, 4)


def _holds(figures: Mapping[str, Any] | None, hold: float) -> bool | None:
    share = num((figures or {}).get("windows_under_floor"))
    return None if share is None else share <= hold


def goals(policies: Sequence[str], phases: Sequence[Mapping[str, Any]],
          summaries: Sequence[Mapping[str, Any]], hold: float = 0.05) -> dict[str, Any]:
    """The goals of a ``--compare policy=...`` run: ``policies`` (values such as
    ``floor``, ``static:2``), each run's :func:`~mesh.sim.report.phase_summary` and
    summary, in the same order. Missing runs give nulls, never an error."""
    runs = dict(zip(policies, zip(phases, summaries, strict=True), strict=True))
    statics = [p for p in policies if p.startswith("static:")]
    floor = runs.get("floor")
    names = [p for p in ("off", "on") if floor and floor[0].get(p)] or ["all"]
    out: dict[str, Any] = {"hold_share": hold, "phases": {}, "statics": {}}
    for phase in [*names, "all"] if names != ["all"] else names:
        f = floor[0].get(phase) if floor else None
        holding = [s for s in statics if _holds(runs[s][0].get(phase), hold)]
        best = max(holding, key=lambda s: num(runs[s][0][phase].get("agg_tps")) or 0.0,
                   default=None)
        best_tps = num(runs[best][0][phase].get("agg_tps")) if best else None
        floor_tps = num((f or {}).get("agg_tps"))
        out["phases"][phase] = {
            "floor_windows_under_floor": (f or {}).get("windows_under_floor"),
            "floor_holds": _holds(f, hold),
            "statics_holding": holding,
            "best_holding_static": best,
            "best_holding_static_agg_tps": best_tps,
            "floor_agg_tps": floor_tps,
            "floor_share_of_best": round(floor_tps / best_tps, 4)
            if floor_tps is not None and best_tps else None,
        }
    for s in statics:
        row: dict[str, Any] = {}
        for phase in names:
            figures = runs[s][0].get(phase)
            tps = num((figures or {}).get("agg_tps"))
            floor_tps = out["phases"][phase]["floor_agg_tps"]
            row[phase] = {
                "holds": _holds(figures, hold),
                "agg_tps": tps,
                "reaches_floor_tps": None if tps is None or floor_tps is None
                else tps >= _THROUGHPUT_SHARE * floor_tps,
            }
        row["both_in_every_phase"] = all(r["holds"] and r["reaches_floor_tps"]
                                         for r in row.values())
        out["statics"][s] = row
    legacy = runs.get("legacy")
    if floor and legacy:
        out["vs_legacy"] = {
            key: {"change": _change(floor[1].get(key), legacy[1].get(key)),
                  "source": SOURCE_VS_LEGACY.get(key)}
            for key in ("wall_s", "p50_delivery_s", "time_under_floor", "deep_sub_floor",
                        "windows_under_floor", "windows_under_half_floor")
        }
    return out


def _pct(value: Any, signed: bool = False) -> str:
    v = num(value)
    if v is None:
        return "–"
    return f"{100 * v:+.1f} %" if signed else f"{100 * v:.1f} %"


def _yes(value: Any) -> str:
    return "–" if value is None else ("yes" if value else "no")


def goals_markdown(result: Mapping[str, Any]) -> str:
    """The goals as Markdown (tables; no verdict beyond the figures' own)."""
    hold = float(result["hold_share"])
    parts = [f"Holding the floor: at most {100 * hold:g} % of client windows under it.",
             markdown_table(
                 ["phase", "floor gate under the floor", "holds", "statics that hold",
                  "best of them", "floor gate tok/s / its tok/s"],
                 ([phase, _pct(g["floor_windows_under_floor"]), _yes(g["floor_holds"]),
                   ", ".join(g["statics_holding"]) or "none", g["best_holding_static"] or "–",
                   _pct(g["floor_share_of_best"])] for phase, g in result["phases"].items()),
                 "|---|---:|---|---|---|---:|")]
    if result["statics"]:
        phases = [p for p in next(iter(result["statics"].values())) if p != "both_in_every_phase"]
        parts.append(markdown_table(
            ["static", *(f"{p}: holds / ≥ 90 % of floor's tok/s" for p in phases),
             "both, every phase"],
            ([name, *(f"{_yes(row[p]['holds'])} / {_yes(row[p]['reaches_floor_tps'])}"
                      for p in phases), _yes(row["both_in_every_phase"])]
             for name, row in result["statics"].items()),
            "|---|" + "---|" * (len(phases) + 1)))
    if "vs_legacy" in result:
        parts.append(markdown_table(
            ["floor gate vs legacy (whole run)", "change", "source system"],
            ([key, _pct(g["change"], True), _pct(g["source"], True)]
             for key, g in result["vs_legacy"].items()), "|---|---:|---:|"))
    return "\n\n".join(parts)

# -------------------- comparisons and sweeps ----------------------------------

COMPARE_KEYS = ("policy", "pool", "floor", "template", "neighbour")
RunOne = Callable[[SimConfig, str], SimRun]  # (config, label) -> run


def parse_compare(text: str) -> tuple[str, list[str]]:
    """``policy=floor,legacy`` → ``("policy", ["floor", "legacy"])``; ValueError if bad."""
    key, sep, values = text.partition("=")
    key = key.strip()
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or key not in COMPARE_KEYS or len(items) < 2:
        raise ValueError(f"--compare takes KEY=V1,V2[,...] with KEY one of "
                         f"{', '.join(COMPARE_KEYS)}, got {text!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"--compare lists a value twice: {text!r}")
    return key, items


def apply_value(config: SimConfig, key: str, value: str) -> SimConfig:
    """``config`` with one compared setting replaced (validated)."""
    if key == "floor":
        changed = dataclasses.replace(config, floor_tps=float(value))
    elif key in ("policy", "pool", "template"):
        field: dict[str, Any] = {key: value}  # typed Any: replace checks each field's type
        changed = dataclasses.replace(config, **field)
    elif key == "neighbour":  # the same schedule, with and without the load
        changed = dataclasses.replace(
            config, neighbour=dataclasses.replace(config.neighbour, kind=value))
    else:
        raise ValueError(f"cannot compare over {key!r}; choose one of {COMPARE_KEYS}")
    changed.validate()
    return changed


def _report_dir(label: str) -> str:
    """``policy=static:2`` -> ``policy-static-2``: the folder of a run's report."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", label.replace("=", "-")).strip("-") or "run"


@dataclass(frozen=True)
class CompareResult:
    key: str
    values: tuple[str, ...]
    summaries: tuple[Summary, ...]
    table: Path
    plots: tuple[Path, ...]


def run_compare(config: SimConfig, key: str, values: Sequence[str], out_dir: Path,
                run_one: RunOne) -> CompareResult:
    """Run ``config`` once per value of ``key``; write every report and the comparison."""
    configs = [apply_value(config, key, v) for v in values]  # fail before any run
    runs, summaries = _run_each(configs, [f"{key}={v}" for v in values], out_dir, run_one)
    return write_comparison(key, values, runs, summaries, out_dir)


def _run_each(configs: Sequence[SimConfig], labels: Sequence[str], out_dir: Path,
              run_one: RunOne) -> tuple[list[SimRun], list[Summary]]:
    """Run each config under its label, its report in ``out_dir/<label's slug>``."""
    runs: list[SimRun] = []
    summaries: list[Summary] = []
    for cfg, label in zip(configs, labels, strict=True):
        runs.append(run_one(cfg, label))
        summaries.append(write_report(runs[-1], out_dir / _report_dir(label)).summary)
    return runs, summaries


def write_comparison(key: str, values: Sequence[str], runs: Sequence[SimRun],
                     summaries: Sequence[Summary], out_dir: Path) -> CompareResult:
    """The comparison's tables (per neighbour phase, then every metric) and its plots,
    one panel per run (:mod:`mesh.sim.plots`), from finished runs. Pure."""
    out_dir.mkdir(parents=True, exist_ok=True)
    labels = [f"{key}={v}" for v in values]
    phases = [phase_summary(r) for r in runs]
    plots = write_panels(runs, phases, out_dir)
    rows = list(zip(labels, phases, strict=True))
    neighbour = runs[0].config.neighbour if runs else None
    sections: list[str] = []
    if neighbour is not None and neighbour.enabled:
        sections += [
            f"Neighbour `{neighbour.kind}`, schedule `{neighbour.schedule}` (seed "
            f"{neighbour.seed if neighbour.seed is not None else runs[0].config.seed}), the "
            "same for every run; each run's on spans are in its report.",
            "## Neighbour off\n\n" + phase_table(rows, "off"),
            "## Neighbour on\n\n" + phase_table(rows, "on"),
        ]
    goal = None
    if key == "policy":  # heavy: the issue allows 10 % at a floor one worker holds
        hold = 0.10 if runs and runs[0].config.template == "heavy" else 0.05
        goal = goals(values, phases, summaries, hold)
        sections.append("## Goals\n\n" + goals_markdown(goal))
    source = {p["turn_start_source"] for p in phases}
    sections += [
        "## Whole run\n\n" + phase_table(rows, "all"),
        f"Turn start: {', '.join(sorted(source))} (see docs/gate.md); client windows of "
        f"at least {MIN_WINDOW_TOKENS} tokens over at least {MIN_WINDOW_S:g} s.",
        "## Every metric (whole run)\n\n"
        + summary_table(list(zip(labels, summaries, strict=True))),
    ]
    md = out_dir / "compare.md"
    md.write_text(
        f"# mesh simulate — compare {key}\n\nSame scenario (seed {runs[0].config.seed}) per "
        f"value; each run's own report is in its folder.\n\n" + "\n\n".join(sections)
        + "\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n",
        encoding="utf-8")
    write_json(out_dir / "compare.json", {
        "key": key, "values": list(values), "goals": goal,
        "runs": [{"label": lbl, "config": r.config.to_json(), "summary": s, "phases": ph,
                  "report": f"{_report_dir(lbl)}/report.json"}
                 for lbl, r, s, ph in zip(labels, runs, summaries, phases, strict=True)]})
    return CompareResult(key, tuple(values), tuple(summaries), md, tuple(plots))


def _qualifies(s: Mapping[str, Any], max_under: float) -> bool:
    return (s.get("delivered") == s.get("submitted")
            and float(s.get("time_under_floor") or 0.0) <= max_under)


def lowest_p50(floors: Sequence[float], summaries: Sequence[Mapping[str, Any]],
               max_under: float = 0.05) -> float | None:
    """The floor with the lowest p50 delivery among runs that delivered everything and
    spent at most ``max_under`` of the time under the floor; None if no run qualifies."""
    runs = [(floor, float(p50)) for floor, s in zip(floors, summaries, strict=True)
            if (p50 := s.get("p50_delivery_s")) is not None and _qualifies(s, max_under)]
    return min(runs, key=lambda run: run[1])[0] if runs else None


def sweet_spot(floors: Sequence[float], summaries: Sequence[Mapping[str, Any]],
               max_under: float = 0.05) -> float | None:
    """The knee (see the module docstring; the lowest qualifying floor if every step down
    adds :data:`KNEE_GAIN`); None if no run qualifies."""
    runs = sorted(((f, float(s.get("agg_tps") or 0.0))
                   for f, s in zip(floors, summaries, strict=True) if _qualifies(s, max_under)),
                  reverse=True)
    if not runs:
        return None
    for (floor, tps), (_, lower_tps) in itertools.pairwise(runs):
        if lower_tps < (1.0 + KNEE_GAIN) * tps:
            return floor
    return runs[-1][0]


@dataclass(frozen=True)
class SweepResult:
    floors: tuple[float, ...]
    summaries: tuple[Summary, ...]
    best: float | None
    table: Path
    plot: Path


def run_sweep(config: SimConfig, floors: Sequence[float], out_dir: Path, run_one: RunOne,
              *, max_under: float = 0.05) -> SweepResult:
    """Run ``config`` at each floor; write every report, the sweep table and its plot."""
    configs = [apply_value(config, "floor", f"{f:g}") for f in floors]
    _, summaries = _run_each(configs, [f"floor={f:g}" for f in floors], out_dir, run_one)
    return write_sweep(floors, summaries, out_dir, max_under=max_under)


def write_sweep(floors: Sequence[float], summaries: Sequence[Summary], out_dir: Path, *,
                max_under: float = 0.05) -> SweepResult:
    """The sweep's table, JSON and plot from finished runs' summaries. Pure."""
    out_dir.mkdir(parents=True, exist_ok=True)
    best = sweet_spot(floors, summaries, max_under)
    fastest = lowest_p50(floors, summaries, max_under)
    plot = write_sweep_plot(floors, summaries, out_dir / "sweep.png", best)
    table = summary_table([(f"floor {f:g}", s) for f, s in zip(floors, summaries, strict=True)])
    verdict = (
        f"Sweet spot: floor **{best:g}** tok/s — the knee: a lower floor (more rows) adds "
        f"under {100 * KNEE_GAIN:g} % to the aggregate tokens/s, among floors that "
        f"delivered every package with time under "
        f"the floor ≤ {100 * max_under:g} %. Lowest p50 delivery among them: floor "
        f"{fastest:g}." if best is not None and fastest is not None
        else f"No floor delivered every package with time under the floor ≤ {100 * max_under:g} %.")
    md = out_dir / "sweep.md"
    md.write_text(f"# mesh sweep\n\n{verdict}\n\n{table}\n\n![sweep](sweep.png)\n",
                  encoding="utf-8")
    write_json(out_dir / "sweep.json", {
        "floors": list(floors), "max_under": max_under, "sweet_spot": best,
        "rule": f"knee: the next lower floor adds < {100 * KNEE_GAIN:g} % aggregate tok/s",
        "lowest_p50": fastest, "summaries": list(summaries)})
    return SweepResult(tuple(floors), tuple(summaries), best, md, plot)
