"""The plots people look at (PNG, matplotlib's Agg backend): a run's plots, the comparison
panels and the idle-agents plot. Figures are built on :class:`matplotlib.figure.Figure` with
an Agg canvas, never through ``pyplot``: no global figure state, nothing left open. Pure
apart from the files written.

* A run's plots (:data:`PLOT_NAMES`) take a list of runs: one run gives its own plots,
  several overlay them, each in its own colour and labelled.
* The comparison's panels (:data:`PANEL_NAMES`): one panel per run on shared axes, the
  neighbour's "on" spans shaded, and per-phase bars (docs/gate.md, *Plots*).
* ``parking_over_time.png`` of an ``idle-agents`` run (or any run in which a session was
  parked): sessions, cells, parked host MB and the workers' tokens/s on one time axis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from mesh.sim.report import (
    MB,
    ROLES,
    cap_num,
    client_windows,
    floor_of,
    has_parking,
    kv_series,
    parking_series,
    percentile,
    workers,
)
from mesh.sim.scenario import SimRun

__all__ = [
    "PANEL_NAMES", "PARKING_PLOT", "PLOT_NAMES", "parking_plots", "plot_parking", "plot_phases",
    "plot_tps_by_run", "plot_workers_by_run", "shade_neighbour", "write_panels", "write_plots",
    "write_sweep_plot"
]


# -------------------- run plots -----------------------------------------------

PLOT_NAMES = ("tps_over_time", "workers_over_time", "kv_cells", "delivery_cdf", "tps_by_turn")
_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
_NAN = float("nan")


def _label(run: SimRun) -> str:
    return run.label or f"{run.config.policy}, {run.config.pool} pool"


def _colour(i: int) -> str:
    return _COLOURS[i % len(_COLOURS)]


def _first(label: str, k: int) -> str:
    """``label`` on the first panel only (the figure's one legend)."""
    return label if k == 0 else "_nolegend_"


def _series(run: SimRun, *keys: str) -> list[float]:
    """``cap_num(sample, *keys)`` of every sample, NaN where missing (a gap in the line)."""
    return [_NAN if (v := cap_num(s.capacity, *keys)) is None else v for s in run.samples]


def _client_turns(ax: Axes, run: SimRun) -> None:
    """Each worker turn's tokens/s as the client saw it, a grey line over the turn."""
    label = "worker turns (client)"
    for task in run.tasks:
        for _, start, end, tps in task.turn_rates(run.tokens_per_step):
            ax.hlines(tps, start, end, colors="tab:gray", alpha=0.6, label=label)
            label = "_nolegend_"


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path, rect: tuple[float, float, float, float] | None = None
          ) -> Path:
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=100)
    return path


def shade_neighbour(ax: Axes, run: SimRun, label: bool = True) -> None:
    """Shade the spans in which ``run``'s neighbour was on (nothing without one)."""
    for k, rec in enumerate(run.neighbour_phases):
        ax.axvspan(rec.start, rec.end, color="tab:red", alpha=0.12, linewidth=0,
                   label="neighbour on" if label and k == 0 else "_nolegend_")


def _new(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Axes]:
    fig = _figure(8, 4.5)
    ax = fig.subplots()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _legend(ax: Axes, loc: Literal["best", "upper right"] = "best") -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", loc=loc)


def _figure_legend(fig: Figure, axes: Sequence[Axes], ncol: int = 5) -> None:
    """One legend under the panels, each label once from the first panel that has it."""
    handles: dict[str, Any] = {}
    for ax in axes:
        for h, lbl in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lbl, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=ncol,
               fontsize="small")


def plot_tps(runs: Sequence[SimRun], path: Path) -> Path:
    fig, ax = _new("Per-worker tokens/s over time", "time (s)", "tokens/s per worker")
    single = len(runs) == 1
    if single:
        shade_neighbour(ax, runs[0])
    for i, run in enumerate(runs):
        colour, name, ts = _colour(i), _label(run), [s.t for s in run.samples]
        if single:
            _client_turns(ax, run)
        ax.plot(ts, _series(run, "measured_tps", "min"), color=colour,
                label=f"{name}: slowest worker")
        ax.plot(ts, _series(run, "measured_tps", "p50"), color=colour, linestyle=":",
                label=f"{name}: median worker")
        floor = floor_of(run)
        if floor is not None:
            ax.axhline(floor, color=colour, linestyle="--", linewidth=1,
                       label=f"{name}: floor {floor:g}")
    ax.set_ylim(bottom=0)
    _legend(ax)
    return _save(fig, path)


def plot_workers(runs: Sequence[SimRun], path: Path) -> Path:
    fig, ax = _new("Workers admitted and queued", "time (s)", "count")
    if len(runs) == 1:
        shade_neighbour(ax, runs[0])
    for i, run in enumerate(runs):
        ts = [s.t for s in run.samples]
        ax.step(ts, [workers(s) for s in run.samples], where="post", color=_colour(i),
                label=f"{_label(run)}: admitted")
        ax.step(ts, [cap_num(s.capacity, "queue_len") or 0 for s in run.samples],
                where="post", color=_colour(i), linestyle="--", label=f"{_label(run)}: queued")
    _legend(ax)
    return _save(fig, path)


def plot_kv(runs: Sequence[SimRun], path: Path) -> Path:
    fig, ax = _new("KV cells: pooled vs naive equivalent", "time (s)", "KV cells")
    for i, run in enumerate(runs):
        ts = [s.t for s in run.samples]
        ax.plot(ts, _series(run, "kv_cells", "used"), color=_colour(i),
                label=f"{_label(run)}: cells used")
        ax.plot(ts, _series(run, "kv_cells", "naive_equivalent"), color=_colour(i),
                linestyle="--", label=f"{_label(run)}: naive equivalent")
    ax.set_ylim(bottom=0)
    right = _coordinator_sessions(ax, runs)
    if right is None:
        _legend(ax)
    else:  # one legend for both axes
        cells, sessions = ax.get_legend_handles_labels(), right.get_legend_handles_labels()
        ax.legend(cells[0] + sessions[0], cells[1] + sessions[1], fontsize="small", loc="best")
    return _save(fig, path)


def _coordinator_sessions(ax: Axes, runs: Sequence[SimRun]) -> Axes | None:
    """The planner and synthesis sessions live (a planned scenario's) on a second axis;
    None when no run had any."""
    series = [kv_series(run) for run in runs]
    if not any(row[role] for rows in series for row in rows for role in ROLES.values()):
        return None
    right = ax.twinx()
    right.set_ylabel("coordinator sessions live")
    styles = {"planner": ":", "synthesis": "-."}
    for i, (run, rows) in enumerate(zip(runs, series, strict=True)):
        for role, style in styles.items():
            right.step([r["t"] for r in rows], [r[role] for r in rows], where="post",
                       color=_colour(i), linestyle=style, alpha=0.8,
                       label=f"{_label(run)}: {role} sessions")
    right.set_ylim(bottom=0)
    right.yaxis.set_major_locator(MaxNLocator(integer=True))
    return right


def plot_cdf(runs: Sequence[SimRun], path: Path) -> Path:
    fig, ax = _new("Delivery time CDF", "delivery time (s)", "share of packages delivered")
    for i, run in enumerate(runs):
        times = sorted(d for t in run.tasks if (d := t.delivery_s) is not None)
        if not times:
            continue
        shares = [(k + 1) / len(run.tasks) for k in range(len(times))]
        ax.step([0.0, *times], [0.0, *shares], where="post", color=_colour(i),
                label=_label(run))
    ax.set_ylim(0, 1.02)
    _legend(ax)
    return _save(fig, path)


def plot_turns(runs: Sequence[SimRun], path: Path) -> Path:
    fig, ax = _new("Tokens/s by turn (client-observed)", "turn", "tokens/s")
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        by_turn: dict[int, list[float]] = {}
        for task in run.tasks:
            for turn, _, _, tps in task.turn_rates(run.tokens_per_step):
                by_turn.setdefault(turn, []).append(tps)
        if not by_turn:
            continue
        turns = sorted(by_turn)
        offset = (i - (len(runs) - 1) / 2) * width
        parts = ax.boxplot([by_turn[t] for t in turns], positions=[t + offset for t in turns],
                           widths=width * 0.9, patch_artist=True, manage_ticks=False)
        for box in parts["boxes"]:
            box.set_facecolor(_colour(i))
            box.set_alpha(0.5)
        ax.plot([], [], color=_colour(i), label=_label(run))
        ax.set_xticks(turns)
    floor = floor_of(runs[0]) if runs else None
    if floor is not None:
        ax.axhline(floor, color="black", linestyle="--", linewidth=1, label=f"floor {floor:g}")
    ax.set_ylim(bottom=0)
    _legend(ax)
    return _save(fig, path)


def write_plots(runs: Sequence[SimRun], out_dir: Path) -> list[Path]:
    """Every plot of :data:`PLOT_NAMES` for ``runs``, as ``out_dir/<name>.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    makers = (plot_tps, plot_workers, plot_kv, plot_cdf, plot_turns)
    return [make(runs, out_dir / f"{name}.png")
            for name, make in zip(PLOT_NAMES, makers, strict=True)]


def write_sweep_plot(floors: Sequence[float], summaries: Sequence[Mapping[str, Any]],
                     path: Path, best: float | None) -> Path:
    """Aggregate tokens/s, wall time, p50 delivery and time under the floor against the
    floor; the sweet spot (the knee) marked on each."""
    fig = _figure(7, 10)
    axes = fig.subplots(4, 1, sharex=True)
    series = (("agg_tps", "aggregate tok/s"), ("wall_s", "wall (s)"),
              ("p50_delivery_s", "p50 delivery (s)"),
              ("time_under_floor", "time under floor (share)"))
    for ax, (key, label) in zip(axes, series, strict=True):
        values = [s.get(key) for s in summaries]
        ax.plot(floors, [_NAN if v is None else float(v) for v in values], marker="o")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if best is not None:
            ax.axvline(best, color="tab:green", linestyle="--", linewidth=1)
    axes[0].set_title("Sweep over the floor" + (f" (sweet spot, the knee: {best:g})" if best
                                                else ""))
    axes[-1].set_xlabel("floor (tokens/s per worker)")
    return _save(fig, path)

# -------------------- comparison panels ---------------------------------------

PANEL_NAMES = ("tps_by_run", "workers_by_run", "phases")


def _grid(runs: Sequence[SimRun], title: str, ylabel: str) -> tuple[Figure, list[Axes]]:
    """One panel per run, the neighbour's "on" spans shaded (labelled on the first)."""
    n = len(runs)
    cols = 1 if n == 1 else 2
    rows = math.ceil(n / cols)
    fig = _figure(6.5 * cols, 2.6 * rows + 0.6)
    grid = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False)
    axes: list[Axes] = [ax for row in grid for ax in row]
    for ax in axes[n:]:
        ax.set_visible(False)
    for k, (ax, run) in enumerate(zip(axes, runs, strict=False)):
        shade_neighbour(ax, run, label=k == 0)
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
    fig, axes = _grid(runs, "Client windows (dots) and the slowest worker (line), "
                      "tokens/s; neighbour on shaded", "tokens/s")
    for k, (ax, run, summary) in enumerate(zip(axes, runs, summaries, strict=True)):
        windows = client_windows(run)
        ax.plot([w.t for w in windows], [w.tps for w in windows], ".", color="tab:gray",
                markersize=3, alpha=0.5, label=_first("client window", k))
        ax.plot([s.t for s in run.samples], _series(run, "measured_tps", "min"),
                color="tab:blue", linewidth=1, label=_first("slowest worker", k))
        floor = floor_of(run)
        if floor is not None:
            ax.axhline(floor, color="black", linestyle="--", linewidth=1,
                       label=_first("floor", k))
            ax.axhline(floor / 2, color="black", linestyle=":", linewidth=1,
                       label=_first("floor / 2", k))
        under = (summary.get("all") or {}).get("windows_under_floor")
        note = "" if under is None else f" — {100 * under:.1f} % of windows < floor"
        ax.set_title(_name(run) + note, fontsize="medium")
        ax.set_ylim(bottom=0)
    if axes:  # a robust top: a few outlying windows must not flatten every panel
        rates = [w.tps for r in runs for w in client_windows(r)]
        top = percentile(rates, 98) or 0.0
        floors = [f for r in runs if (f := floor_of(r)) is not None]
        axes[0].set_ylim(0, max([top * 1.1, *(2.5 * f for f in floors), 1.0]))
        _figure_legend(fig, axes)
    return _save(fig, path, (0, 0.04, 1, 1))


def plot_workers_by_run(runs: Sequence[SimRun], path: Path) -> Path:
    fig, axes = _grid(runs, "Workers admitted, turns running and waiting; neighbour on "
                      "shaded", "count")
    for k, (ax, run) in enumerate(zip(axes, runs, strict=True)):
        ts = [s.t for s in run.samples]
        ax.step(ts, [workers(s) for s in run.samples], where="post", color="tab:blue",
                linewidth=3, alpha=0.5, label=_first("workers", k))
        running = _series(run, "turns", "running")
        if any(not math.isnan(v) for v in running):
            ax.step(ts, running, where="post", color="tab:green",
                    label=_first("turns running", k))
            ax.step(ts, _series(run, "turns", "waiting"), where="post", color="tab:orange",
                    linestyle="--", label=_first("turns waiting", k))
        else:
            ax.step(ts, [cap_num(s.capacity, "queue_len") or 0 for s in run.samples],
                    where="post", color="tab:orange", linestyle="--",
                    label=_first("tasks queued", k))
        ax.set_title(_name(run), fontsize="medium")
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if axes:  # the first panel may lack a series another has
        _figure_legend(fig, axes)
    return _save(fig, path, (0, 0.04, 1, 1))


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
    _figure_legend(fig, axes, ncol=len(phases))
    return _save(fig, path, (0, 0.06, 1, 1))


def write_panels(runs: Sequence[SimRun], summaries: Sequence[Mapping[str, Any]],
                 out_dir: Path) -> list[Path]:
    """The comparison's plots (:data:`PANEL_NAMES`) of ``runs`` and their
    :func:`~mesh.sim.report.phase_summary` results, in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [plot_tps_by_run(runs, summaries, out_dir / "tps_by_run.png"),
            plot_workers_by_run(runs, out_dir / "workers_by_run.png"),
            plot_phases(runs, summaries, out_dir / "phases.png")]


# -------------------- the idle-agents plot ------------------------------------

PARKING_PLOT = "parking_over_time"


def plot_parking(run: SimRun, path: Path) -> Path:
    """``parking_over_time.png``: sessions, cells, parked host MB and the workers' tokens/s,
    one panel each, over the run's time."""
    rows = parking_series(run)
    ts = [r["t"] for r in rows]
    fig = _figure(9, 10)
    axes = fig.subplots(4, 1, sharex=True)
    sessions, cells, host, tps = axes
    for ax in axes:
        ax.grid(True, alpha=0.3)
        shade_neighbour(ax, run, label=ax is tps)

    sessions.step(ts, [r["attached"] for r in rows], where="post", color="tab:gray",
                  linewidth=3, alpha=0.5, label="attached")
    sessions.step(ts, [r["resident"] for r in rows], where="post", color="tab:blue",
                  label="resident (holding a sequence id)")
    sessions.step(ts, [r["parked"] for r in rows], where="post", color="tab:orange",
                  label="parked (off the KV cache)")
    if run.config.idle_agents:
        sessions.axhline(run.config.idle.resident, color="tab:blue", linestyle=":",
                         linewidth=1, label=f"resident slots ({run.config.idle.resident})")
    sessions.set_ylabel("sessions")
    sessions.set_title("Sessions: attached = resident + parked", fontsize="medium")
    sessions.yaxis.set_major_locator(MaxNLocator(integer=True))

    cells.plot(ts, [r["resident_cells"] for r in rows], color="tab:blue",
               label="in the cache (prefix + resident suffixes)")
    cells.plot(ts, [r["parked_cells"] for r in rows], color="tab:orange",
               label="parked suffix tokens")
    top = max((r["total_cells"] for r in rows), default=0)
    if top:
        cells.axhline(top, color="black", linestyle="--", linewidth=1, label=f"KV cells {top}")
    cells.set_ylabel("KV cells / tokens")
    cells.set_title("Cells", fontsize="medium")

    host.plot(ts, [r["parked_bytes"] / MB for r in rows], color="tab:purple",
              label="swapped suffixes in host RAM")
    host.set_ylabel("host MB")
    host.set_title("Parked host memory (swap; recompute holds none)", fontsize="medium")

    _client_turns(tps, run)
    for key, style, name in (("min", "-", "slowest decoding worker"),
                             ("p50", ":", "median decoding worker")):
        tps.plot([s.t for s in run.samples], _series(run, "measured_tps", key),
                 color="tab:green", linestyle=style, label=name)
    floor = floor_of(run)
    if floor is not None:
        tps.axhline(floor, color="black", linestyle="--", linewidth=1, label=f"floor {floor:g}")
    tps.set_ylabel("tokens/s per worker")
    tps.set_title("Workers' tokens/s", fontsize="medium")
    tps.set_xlabel("time (s)")
    for ax in axes:
        ax.set_ylim(bottom=0)
        _legend(ax, "upper right")
    return _save(fig, path)


def parking_plots(runs: Sequence[SimRun], out_dir: Path) -> list[Path]:
    """``parking_over_time.png`` for a single run with parking data (none otherwise)."""
    if len(runs) != 1 or not has_parking(runs[0]):
        return []
    return [plot_parking(runs[0], out_dir / f"{PARKING_PLOT}.png")]
