"""Issue 25's goals, read off a policy comparison's figures. Pure.

Per phase (neighbour off / on, and the whole run), with ``hold`` the share of client
windows under the floor a run may have and still *hold the floor* (5 % light and
gate_bench, 10 % heavy):

* does the floor gate hold the floor;
* its aggregate tokens/s against the best ``static:N`` among those that hold the floor
  (goal: at least 90 %);
* for each ``static:N``: does it hold the floor, and does it also reach 90 % of the floor
  gate's aggregate tokens/s — *both*; the goal is that none does both in both phases;
* against ``legacy`` over the whole run: wall, p50 delivery, time under the floor (samples
  and client windows) and deep sub-floor, as relative changes beside the source system's
  (−12 %, −43 %, −52 %, −83 %).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["SOURCE_VS_LEGACY", "goals", "goals_markdown"]

SOURCE_VS_LEGACY = {"wall_s": -0.12, "p50_delivery_s": -0.43, "time_under_floor": -0.52,
                    "deep_sub_floor": -0.83}
_THROUGHPUT_SHARE = 0.9


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


def _change(new: Any, old: Any) -> float | None:
    a, b = _num(new), _num(old)
    if a is None or b is None or b == 0:
        return None
    return round(a / b - 1.0, 4)


def _holds(figures: Mapping[str, Any] | None, hold: float) -> bool | None:
    share = _num((figures or {}).get("windows_under_floor"))
    return None if share is None else share <= hold


def goals(policies: Sequence[str], phases: Sequence[Mapping[str, Any]],
          summaries: Sequence[Mapping[str, Any]], hold: float = 0.05) -> dict[str, Any]:
    """The goals of a ``--compare policy=...`` run: ``policies`` (values such as
    ``floor``, ``static:2``), each run's :func:`~mesh.sim.phases.phase_summary` and
    summary, in the same order. Missing runs give nulls, never an error."""
    runs = dict(zip(policies, zip(phases, summaries, strict=True), strict=True))
    statics = [p for p in policies if p.startswith("static:")]
    floor = runs.get("floor")
    names = [p for p in ("off", "on") if floor and floor[0].get(p)] or ["all"]
    out: dict[str, Any] = {"hold_share": hold, "phases": {}, "statics": {}}
    for phase in [*names, "all"] if names != ["all"] else names:
        f = floor[0].get(phase) if floor else None
        holding = [s for s in statics if _holds(runs[s][0].get(phase), hold)]
        best = max(holding, key=lambda s: _num(runs[s][0][phase].get("agg_tps")) or 0.0,
                   default=None)
        best_tps = _num(runs[best][0][phase].get("agg_tps")) if best else None
        floor_tps = _num((f or {}).get("agg_tps"))
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
            tps = _num((figures or {}).get("agg_tps"))
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
    v = _num(value)
    if v is None:
        return "–"
    return f"{100 * v:+.1f} %" if signed else f"{100 * v:.1f} %"


def _yes(value: Any) -> str:
    return "–" if value is None else ("yes" if value else "no")


def goals_markdown(result: Mapping[str, Any]) -> str:
    """The goals as Markdown (tables; no verdict beyond the figures' own)."""
    hold = float(result["hold_share"])
    lines = [f"Holding the floor: at most {100 * hold:g} % of client windows under it.", "",
             "| phase | floor gate under the floor | holds | statics that hold | best of "
             "them | floor gate tok/s / its tok/s |", "|---|---:|---|---|---|---:|"]
    for phase, g in result["phases"].items():
        lines.append(
            f"| {phase} | {_pct(g['floor_windows_under_floor'])} | {_yes(g['floor_holds'])} "
            f"| {', '.join(g['statics_holding']) or 'none'} "
            f"| {g['best_holding_static'] or '–'} | {_pct(g['floor_share_of_best'])} |")
    if result["statics"]:
        phases = [p for p in next(iter(result["statics"].values())) if p != "both_in_every_phase"]
        lines += ["", "| static | " + " | ".join(
            f"{p}: holds / ≥ 90 % of floor's tok/s" for p in phases) + " | both, every phase |",
            "|---|" + "---|" * (len(phases) + 1)]
        for name, row in result["statics"].items():
            cells = [f"{_yes(row[p]['holds'])} / {_yes(row[p]['reaches_floor_tps'])}"
                     for p in phases]
            lines.append(f"| {name} | " + " | ".join(cells)
                         + f" | {_yes(row['both_in_every_phase'])} |")
    if "vs_legacy" in result:
        lines += ["", "| floor gate vs legacy (whole run) | change | source system |",
                  "|---|---:|---:|"]
        for key, g in result["vs_legacy"].items():
            lines.append(f"| {key} | {_pct(g['change'], True)} | "
                         f"{_pct(g['source'], True) if g['source'] is not None else '–'} |")
    return "\n".join(lines)
