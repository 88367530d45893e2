"""The same seeded scenario several times: ``--compare KEY=V1,V2`` and the floor sweep.

Each run gets its own report folder (``OUT/<key>-<value>/``); the comparison adds its
tables (``compare.md``, ``compare.json``: per neighbour phase, one row per run) and its
plots, one panel per run (:mod:`mesh.sim.panels`), in ``OUT``.
The sweep adds ``sweep.md``, ``sweep.json`` and ``sweep.png`` and names the sweet spot
by the decode gate's own knee rule (``--floor-tps auto``): among the floors that
delivered every package and kept time under the floor at or below ``max_under``, going
from the highest floor down (fewer rows to more), the last floor before the next lower
one stops adding :data:`KNEE_GAIN` to the aggregate tokens/s. The lowest p50 delivery is
reported beside it.
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
from mesh.sim.goals import goals, goals_markdown
from mesh.sim.panels import write_panels
from mesh.sim.phases import MIN_WINDOW_S, MIN_WINDOW_TOKENS, phase_summary, phase_table
from mesh.sim.plots import write_sweep_plot
from mesh.sim.report import Summary, summary_table, write_json
from mesh.sim.run import write_report
from mesh.sim.types import SimConfig, SimRun

__all__ = [
    "COMPARE_KEYS",
    "CompareResult",
    "RunOne",
    "SweepResult",
    "apply_value",
    "lowest_p50",
    "parse_compare",
    "run_compare",
    "run_sweep",
    "sweet_spot",
]

COMPARE_KEYS = ("policy", "pool", "floor", "template", "neighbour")
RunOne = Callable[[SimConfig, str], SimRun]  # (config, label) -> run


def parse_compare(text: str) -> tuple[str, list[str]]:
    """``policy=floor,legacy`` → ``("policy", ["floor", "legacy"])``; ValueError if bad."""
    key, sep, values = text.partition("=")
    key = key.strip()
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or key not in COMPARE_KEYS or len(items) < 2:
        raise ValueError(
            f"--compare takes KEY=V1,V2[,...] with KEY one of {', '.join(COMPARE_KEYS)}, "
            f"got {text!r}"
        )
    if len(set(items)) != len(items):
        raise ValueError(f"--compare lists a value twice: {text!r}")
    return key, items


def apply_value(config: SimConfig, key: str, value: str) -> SimConfig:
    """``config`` with one compared setting replaced (validated)."""
    if key == "floor":
        changed = dataclasses.replace(config, floor_tps=float(value))
    elif key == "policy":
        changed = dataclasses.replace(config, policy=value)
    elif key == "pool":
        changed = dataclasses.replace(config, pool=value)
    elif key == "template":
        changed = dataclasses.replace(config, template=value)
    elif key == "neighbour":  # the same schedule, with and without the load
        changed = dataclasses.replace(
            config, neighbour=dataclasses.replace(config.neighbour, kind=value))
    else:
        raise ValueError(f"cannot compare over {key!r}; choose one of {COMPARE_KEYS}")
    changed.validate()
    return changed


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "run"


@dataclass(frozen=True)
class CompareResult:
    key: str
    values: tuple[str, ...]
    summaries: tuple[Summary, ...]
    table: Path
    plots: tuple[Path, ...]


def run_compare(
    config: SimConfig, key: str, values: Sequence[str], out_dir: Path, run_one: RunOne
) -> CompareResult:
    """Run ``config`` once per value of ``key``; write every report and the comparison."""
    configs = [apply_value(config, key, v) for v in values]  # fail before any run
    runs: list[SimRun] = []
    summaries: list[Summary] = []
    for value, cfg in zip(values, configs, strict=True):
        run = run_one(cfg, f"{key}={value}")
        runs.append(run)
        summaries.append(write_report(run, out_dir / _slug(f"{key}-{value}")).summary)
    return write_comparison(key, values, runs, summaries, out_dir)


def write_comparison(
    key: str,
    values: Sequence[str],
    runs: Sequence[SimRun],
    summaries: Sequence[Summary],
    out_dir: Path,
) -> CompareResult:
    """The comparison's tables (per neighbour phase, then every metric) and its plots,
    one panel per run (:mod:`mesh.sim.panels`), from finished runs. Pure."""
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
        f"value; each run's own report is in its folder.\n\n"
        + "\n\n".join(sections)
        + "\n\n"
        + "\n".join(f"![{p.stem}]({p.name})" for p in plots)
        + "\n",
        encoding="utf-8",
    )
    write_json(
        out_dir / "compare.json",
        {
            "key": key,
            "values": list(values),
            "runs": [
                {
                    "label": lbl,
                    "config": r.config.to_json(),
                    "summary": s,
                    "phases": ph,
                    "report": f"{_slug(lbl.replace('=', '-'))}/report.json",
                }
                for lbl, r, s, ph in zip(labels, runs, summaries, phases, strict=True)
            ],
            "goals": goal,
        },
    )
    return CompareResult(key, tuple(values), tuple(summaries), md, tuple(plots))


def _qualifies(s: Mapping[str, Any], max_under: float) -> bool:
    return (s.get("delivered") == s.get("submitted")
            and float(s.get("time_under_floor") or 0.0) <= max_under)


def lowest_p50(
    floors: Sequence[float], summaries: Sequence[Mapping[str, Any]], max_under: float = 0.05
) -> float | None:
    """The floor with the lowest p50 delivery among runs that delivered everything and
    spent at most ``max_under`` of the time under the floor; None if no run qualifies."""
    best: tuple[float, float] | None = None
    for floor, s in zip(floors, summaries, strict=True):
        p50 = s.get("p50_delivery_s")
        if p50 is None or not _qualifies(s, max_under):
            continue
        if best is None or float(p50) < best[1]:
            best = (floor, float(p50))
    return None if best is None else best[0]


def sweet_spot(
    floors: Sequence[float], summaries: Sequence[Mapping[str, Any]], max_under: float = 0.05
) -> float | None:
    """The knee (see the module docstring): walking the qualifying floors from the highest
    down, the floor whose next lower one adds under :data:`KNEE_GAIN` to the aggregate
    tokens/s (or the lowest qualifying floor if every step adds that much); None if no
    run qualifies."""
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


def run_sweep(
    config: SimConfig,
    floors: Sequence[float],
    out_dir: Path,
    run_one: RunOne,
    *,
    max_under: float = 0.05,
) -> SweepResult:
    """Run ``config`` at each floor; write every report, the sweep table and its plot."""
    configs = [apply_value(config, "floor", f"{f:g}") for f in floors]
    summaries: list[Summary] = []
    for floor, cfg in zip(floors, configs, strict=True):
        run = run_one(cfg, f"floor={floor:g}")
        summaries.append(write_report(run, out_dir / _slug(f"floor-{floor:g}")).summary)
    return write_sweep(floors, summaries, out_dir, max_under=max_under)


def write_sweep(
    floors: Sequence[float],
    summaries: Sequence[Summary],
    out_dir: Path,
    *,
    max_under: float = 0.05,
) -> SweepResult:
    """The sweep's table, JSON and plot from finished runs' summaries. Pure."""
    out_dir.mkdir(parents=True, exist_ok=True)
    best = sweet_spot(floors, summaries, max_under)
    fastest = lowest_p50(floors, summaries, max_under)
    plot = write_sweep_plot(floors, summaries, out_dir / "sweep.png", best)
    table = summary_table([(f"floor {f:g}", s) for f, s in zip(floors, summaries, strict=True)])
    verdict = (
        f"Sweet spot: floor **{best:g}** tok/s — the knee: a lower floor (more rows) adds "
        f"under {100 * KNEE_GAIN:g} % to the aggregate tokens/s (the rule of "
        f"`--floor-tps auto`), among floors that delivered every package with time under "
        f"the floor ≤ {100 * max_under:g} %. Lowest p50 delivery among them: floor "
        f"{fastest:g}."
        if best is not None and fastest is not None
        else f"No floor delivered every package with time under the floor ≤ {100 * max_under:g} %."
    )
    md = out_dir / "sweep.md"
    md.write_text(
        f"# mesh sweep\n\n{verdict}\n\n{table}\n\n![sweep](sweep.png)\n", encoding="utf-8"
    )
    write_json(
        out_dir / "sweep.json",
        {
            "floors": list(floors),
            "max_under": max_under,
            "sweet_spot": best,
            "rule": f"knee: the next lower floor adds < {100 * KNEE_GAIN:g} % aggregate tok/s",
            "lowest_p50": fastest,
            "summaries": list(summaries),
        },
    )
    return SweepResult(tuple(floors), tuple(summaries), best, md, plot)
