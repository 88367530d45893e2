"""The comparison's plots: one panel per run (small multiples on shared axes), the
neighbour's "on" spans shaded, and per-phase bars. Pure apart from the files written.

* ``tps_by_run.png`` — per run: every client window (dots), the slowest worker ``/capacity``
  measured (line), the floor (dashed) and half of it (dotted);
* ``workers_by_run.png`` — per run: workers admitted, turns running and turns waiting
  (or the task queue where the server has no turn gate);
* ``phases.png`` — per metric one panel, per run a bar for each phase (off / on, or the
  whole run without a neighbour): windows under the floor, aggregate tokens/s, turn-start
  p95 and p50 delivery.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from mesh.sim.measure import cap_num as _cap
from mesh.sim.measure import floor_of, percentile, workers
from mesh.sim.phases import client_windows
from mesh.sim.plots import _figure, shade_neighbour
from mesh.sim.types import SimRun

__all__ = ["PANEL_NAMES", "plot_phases", "plot_tps_by_run", "plot_workers_by_run",
           "write_panels"]

PANEL_NAMES = ("tps_by_run", "workers_by_run", "phases")
_NAN = float("nan")


def _grid(n: int, title: str, ylabel: str) -> tuple[Figure, list[Axes]]:
    cols = 1 if n == 1 else 2
    rows = math.ceil(n / cols)
    fig = _figure(6.5 * cols, 2.6 * rows + 0.6)
    grid = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False)
    axes: list[Axes] = [ax for row in grid for ax in row]
    for ax in axes[n:]:
        ax.set_visible(False)
    for k, ax in enumerate(axes[:n]):
        ax.grid(True, alpha=0.3)
        if k % cols == 0:
            ax.set_ylabel(ylabel)
        if k >= n - cols:
            ax.set_xlabel("time (s)")
    fig.suptitle(title)
    return fig, axes[:n]


def _name(run: SimRun) -> str:
    return run.label or run.config.policy


def plot_tps_by_run(runs: Sequence[SimRun], summaries: Sequence[Mapping[str, Any]],
                    path: Path) -> Path:
    fig, axes = _grid(len(runs), "Client windows (dots) and the slowest worker (line), "
                      "tokens/s; neighbour on shaded", "tokens/s")
    for k, (ax, run, summary) in enumerate(zip(axes, runs, summaries, strict=True)):
        shade_neighbour(ax, run, label=k == 0)
        windows = client_windows(run)
        ax.plot([w.t for w in windows], [w.tps for w in windows], ".", color="tab:gray",
                markersize=3, alpha=0.5, label="client window" if k == 0 else "_nolegend_")
        mins = [_cap(s.capacity, "measured_tps", "min") for s in run.samples]
        ax.plot([s.t for s in run.samples], [_NAN if v is None else v for v in mins],
                color="tab:blue", linewidth=1,
                label="slowest worker" if k == 0 else "_nolegend_")
        floor = floor_of(run)
        if floor is not None:
            ax.axhline(floor, color="black", linestyle="--", linewidth=1,
                       label="floor" if k == 0 else "_nolegend_")
            ax.axhline(floor / 2, color="black", linestyle=":", linewidth=1,
                       label="floor / 2" if k == 0 else "_nolegend_")
        under = (summary.get("all") or {}).get("windows_under_floor")
        note = "" if under is None else f" — {100 * under:.1f} % of windows < floor"
        ax.set_title(_name(run) + note, fontsize="medium")
        ax.set_ylim(bottom=0)
    if axes:  # a robust top: a few outlying windows must not flatten every panel
        rates = [w.tps for r in runs for w in client_windows(r)]
        top = percentile(rates, 98) or 0.0
        floors = [f for r in runs if (f := floor_of(r)) is not None]
        axes[0].set_ylim(0, max([top * 1.1, *(2.5 * f for f in floors), 1.0]))
        fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=5,
                   fontsize="small")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    return path


def plot_workers_by_run(runs: Sequence[SimRun], path: Path) -> Path:
    fig, axes = _grid(len(runs), "Workers admitted, turns running and waiting; neighbour on "
                      "shaded", "count")
    for k, (ax, run) in enumerate(zip(axes, runs, strict=True)):
        shade_neighbour(ax, run, label=k == 0)
        ts = [s.t for s in run.samples]
        first = k == 0
        ax.step(ts, [workers(s) for s in run.samples], where="post", color="tab:blue",
                linewidth=3, alpha=0.5, label="workers" if first else "_nolegend_")
        running = [_cap(s.capacity, "turns", "running") for s in run.samples]
        waiting = [_cap(s.capacity, "turns", "waiting") for s in run.samples]
        if any(v is not None for v in running):
            ax.step(ts, [_NAN if v is None else v for v in running], where="post",
                    color="tab:green", label="turns running" if first else "_nolegend_")
            ax.step(ts, [_NAN if v is None else v for v in waiting], where="post",
                    color="tab:orange", linestyle="--",
                    label="turns waiting" if first else "_nolegend_")
        else:
            ax.step(ts, [_cap(s.capacity, "queue_len") or 0 for s in run.samples],
                    where="post", color="tab:orange", linestyle="--",
                    label="tasks queued" if first else "_nolegend_")
        ax.set_title(_name(run), fontsize="medium")
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if axes:
        handles: dict[str, Any] = {}
        for ax in axes:  # the first panel may lack a series another has
            for h, lbl in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(lbl, h)
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=5,
                   fontsize="small")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    return path


_BARS = (
    ("windows_under_floor", "client windows under the floor (%)", 100.0),
    ("agg_tps", "aggregate tokens/s", 1.0),
    ("turn_start_p95_s", "turn start p95 (s)", 1.0),
    ("p50_delivery_s", "p50 delivery (s)", 1.0),
)
_PHASE_STYLE = {"off": ("neighbour off", "tab:blue"), "on": ("neighbour on", "tab:red"),
                "all": ("whole run", "tab:blue")}


def plot_phases(runs: Sequence[SimRun], summaries: Sequence[Mapping[str, Any]],
                path: Path) -> Path:
    phases = ["off", "on"] if any(s.get("on") for s in summaries) else ["all"]
    fig = _figure(12, 1.2 + 0.45 * len(runs) * len(phases) + 1.5)
    axes = fig.subplots(1, len(_BARS), sharey=True)
    names = [_name(r) for r in runs]
    height = 0.8 / len(phases)
    for ax, (key, title, scale) in zip(axes, _BARS, strict=True):
        for j, phase in enumerate(phases):
            label, colour = _PHASE_STYLE[phase]
            values = [(s.get(phase) or {}).get(key) for s in summaries]
            ys = [i + (j - (len(phases) - 1) / 2) * height for i in range(len(runs))]
            ax.barh(ys, [_NAN if v is None else scale * float(v) for v in values],
                    height=height, color=colour, alpha=0.75, label=label)
        ax.set_title(title, fontsize="medium")
        ax.grid(True, axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(runs)), names)
    axes[0].invert_yaxis()
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(phases),
               fontsize="small")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=100)
    return path


def write_panels(runs: Sequence[SimRun], summaries: Sequence[Mapping[str, Any]],
                 out_dir: Path) -> list[Path]:
    """The comparison's plots (:data:`PANEL_NAMES`) of ``runs`` and their
    :func:`~mesh.sim.phases.phase_summary` results, in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        plot_tps_by_run(runs, summaries, out_dir / "tps_by_run.png"),
        plot_workers_by_run(runs, out_dir / "workers_by_run.png"),
        plot_phases(runs, summaries, out_dir / "phases.png"),
    ]

