"""The ``idle-agents`` scenario's readings (issue 28): resident and parked sessions and
cells over time, from the ``/capacity`` samples' ``parking`` block, and its plot.

* :func:`parking_series` — per sample: attached, resident and parked sessions; resident
  cells (``kv_cells.used``, the shared prefix included), parked cells (the suffix tokens
  parked sessions hold off the cache), parked host bytes (swapped suffixes);
* :func:`parking_summary` — peaks, the share of samples with a parked session, the
  server's park/resume/swap totals, and what was lost: packages not delivered and
  delivered packages short of their planned tokens;
* :func:`parking_lines` — the Markdown report's paragraph; the plot is
  :func:`mesh.sim.idle_plot.plot_parking`.

Samples without a ``parking`` block (an engine that does not park, an older server) read
as zeros, so the figures exist for every run; the plot and the report's paragraph are
written for an ``idle-agents`` run and for any run in which a session was parked. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mesh.sim.measure import cap_num
from mesh.sim.types import SimRun

__all__ = ["MB", "has_parking", "parking_lines", "parking_series", "parking_summary"]

MB = 1e6


def has_parking(run: SimRun) -> bool:
    """Whether ``run`` is an ``idle-agents`` run or the server parked a session in it."""
    return run.config.idle_agents or any(
        (cap_num(s.capacity, "parking", "parks") or 0) > 0 for s in run.samples)


def parking_series(run: SimRun) -> list[dict[str, Any]]:
    """One row per sample: ``t``, ``attached``, ``resident``, ``parked`` (sessions),
    ``resident_cells``, ``parked_cells``, ``total_cells``, ``parked_bytes``."""
    rows: list[dict[str, Any]] = []
    for s in run.samples:
        cap = s.capacity
        attached = int(cap_num(cap, "sessions", "total") or 0)
        parked = int(cap_num(cap, "parking", "parked") or 0)
        resident = cap_num(cap, "parking", "resident")
        rows.append({
            "t": s.t,
            "attached": attached,
            "resident": attached - parked if resident is None else int(resident),
            "parked": parked,
            "resident_cells": int(cap_num(cap, "kv_cells", "used") or 0),
            "parked_cells": int(cap_num(cap, "parking", "parked_tokens") or 0),
            "total_cells": int(cap_num(cap, "kv_cells", "total") or 0),
            "parked_bytes": int(cap_num(cap, "parking", "parked_bytes") or 0),
        })
    return rows


def _last(run: SimRun, key: str) -> int:
    """The server's running total ``parking.key`` at the last sample that has it."""
    for s in reversed(run.samples):
        value = cap_num(s.capacity, "parking", key)
        if value is not None:
            return int(value)
    return 0


def _planned_tokens(run: SimRun) -> dict[int, int]:
    """Each package's planned tokens (its steps' ``tokens``), by package index."""
    out: dict[int, int] = {}
    for p in run.scenario.get("packages", []) or []:
        out[int(p["index"])] = sum(int(step["tokens"]) for step in p.get("steps", []))
    return out


def parking_summary(run: SimRun) -> dict[str, Any]:
    """The run's parking figures (see the module docstring); all zeros without parking."""
    rows = parking_series(run)
    planned = _planned_tokens(run)
    short = [t.package for t in run.tasks if t.is_delivered
             and t.num_generated < planned.get(t.package, 0)]
    return {
        "attached_peak": max((r["attached"] for r in rows), default=0),
        "resident_peak": max((r["resident"] for r in rows), default=0),
        "parked_peak": max((r["parked"] for r in rows), default=0),
        "parked_samples": sum(1 for r in rows if r["parked"] > 0),
        "parked_share": round(sum(1 for r in rows if r["parked"] > 0) / len(rows), 4)
        if rows else 0.0,
        "parked_cells_peak": max((r["parked_cells"] for r in rows), default=0),
        "parked_bytes_peak": max((r["parked_bytes"] for r in rows), default=0),
        "parks": _last(run, "parks"),
        "resumes": _last(run, "resumes"),
        "swaps": _last(run, "swaps"),
        "resume_tokens": _last(run, "resume_tokens"),
        "max_attached": _last(run, "max_attached"),
        "lost_packages": sum(1 for t in run.tasks if not t.is_delivered),
        "short_packages": short,
    }


def parking_lines(run: SimRun, figures: Mapping[str, Any]) -> list[str]:
    """The Markdown report's parking paragraph (none for a run without parking data)."""
    if not has_parking(run):
        return []
    short = figures["short_packages"]
    return [
        f"Parking: up to {figures['parked_peak']} of {figures['attached_peak']} attached "
        f"sessions parked ({100 * figures['parked_share']:.1f} % of samples with one), "
        f"{figures['resident_peak']} resident at most; {figures['parks']} parks "
        f"({figures['swaps']} swapped), {figures['resumes']} resumes "
        f"({figures['resume_tokens']} tokens re-prefilled); parked cells peak "
        f"{figures['parked_cells_peak']}, host {figures['parked_bytes_peak'] / MB:.1f} MB. "
        f"Lost: {figures['lost_packages']} packages undelivered, "
        f"{len(short)} delivered short of their tokens"
        + (f" ({', '.join(map(str, short))})." if short else "."),
        "",
    ]
