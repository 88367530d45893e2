"""The report's plots (PNG, matplotlib's Agg backend; no display is ever needed).

Figures are built on :class:`matplotlib.figure.Figure` with an Agg canvas, never through
``pyplot``: no global figure state, no backend switch, nothing left open.

Every function takes a list of runs: one run gives its own plots, several (``--compare``)
overlay them, each in its own colour and labelled. Pure apart from the file written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from mesh.sim.measure import cap_num as _cap
from mesh.sim.measure import floor_of, workers
from mesh.sim.report import ROLES, kv_series
from mesh.sim.types import SimRun

__all__ = ["PLOT_NAMES", "shade_neighbour", "write_plots", "write_sweep_plot"]

PLOT_NAMES = ("tps_over_time", "workers_over_time", "kv_cells", "delivery_cdf", "tps_by_turn")
_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def _label(run: SimRun, i: int) -> str:
    return run.label or f"{run.config.policy}, {run.config.pool} pool"


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
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


def _legend(ax: Axes) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", loc="best")


def plot_tps(runs: Sequence[SimRun], path: Path) -> Path:
    fig, ax = _new("Per-worker tokens/s over time", "time (s)", "tokens/s per worker")
    single = len(runs) == 1
    if single:
        shade_neighbour(ax, runs[0])
    for i, run in enumerate(runs):
        colour = _COLOURS[i % len(_COLOURS)]
        name = _label(run, i)
        if single:  # each worker's turns, as the client saw them
            label = "worker turns (client)"
            for task in run.tasks:
                for _, start, end, tps in task.turn_rates(run.tokens_per_step):
                    ax.hlines(tps, start, end, colors="tab:gray", alpha=0.6, label=label)
                    label = "_nolegend_"
        ts = [s.t for s in run.samples]
        mins = [_cap(s.capacity, "measured_tps", "min") for s in run.samples]
        p50s = [_cap(s.capacity, "measured_tps", "p50") for s in run.samples]
        ax.plot(
            ts,
            [float("nan") if v is None else v for v in mins],
            color=colour,
            label=f"{name}: slowest worker",
        )
        ax.plot(
            ts,
            [float("nan") if v is None else v for v in p50s],
            color=colour,
            linestyle=":",
            label=f"{name}: median worker",
        )
        floor = floor_of(run)
        if floor is not None:
            ax.axhline(
                floor, color=colour, linestyle="--", linewidth=1, label=f"{name}: floor {floor:g}"
            )
    ax.set_ylim(bottom=0)
    _legend(ax)
    return _save(fig, path)


def plot_workers(runs: Sequence[SimRun], path: Path) -> Path:
    fig, ax = _new("Workers admitted and queued", "time (s)", "count")
    if len(runs) == 1:
        shade_neighbour(ax, runs[0])
    for i, run in enumerate(runs):
        colour = _COLOURS[i % len(_COLOURS)]
        ts = [s.t for s in run.samples]
        ax.step(
            ts,
            [workers(s) for s in run.samples],
            where="post",
            color=colour,
            label=f"{_label(run, i)}: admitted",
        )
        ax.step(
            ts,
            [_cap(s.capacity, "queue_len") or 0 for s in run.samples],
            where="post",
            color=colour,
            linestyle="--",
            label=f"{_label(run, i)}: queued",
        )
    _legend(ax)
    return _save(fig, path)


def plot_kv(runs: Sequence[SimRun], path: Path) -> Path:
    fig, ax = _new("KV cells: pooled vs naive equivalent", "time (s)", "KV cells")
    for i, run in enumerate(runs):
        colour = _COLOURS[i % len(_COLOURS)]
        ts = [s.t for s in run.samples]
        used = [_cap(s.capacity, "kv_cells", "used") for s in run.samples]
        naive = [_cap(s.capacity, "kv_cells", "naive_equivalent") for s in run.samples]
        ax.plot(
            ts,
            [float("nan") if v is None else v for v in used],
            color=colour,
            label=f"{_label(run, i)}: cells used",
        )
        ax.plot(
            ts,
            [float("nan") if v is None else v for v in naive],
            color=colour,
            linestyle="--",
            label=f"{_label(run, i)}: naive equivalent",
        )
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
        colour = _COLOURS[i % len(_COLOURS)]
        for role, style in styles.items():
            right.step([r["t"] for r in rows], [r[role] for r in rows], where="post",
                       color=colour, linestyle=style, alpha=0.8,
                       label=f"{_label(run, i)}: {role} sessions")
    right.set_ylim(bottom=0)
    right.yaxis.set_major_locator(MaxNLocator(integer=True))
    return right


def plot_cdf(runs: Sequence[SimRun], path: Path) -> Path:
    fig, ax = _new("Delivery time CDF", "delivery time (s)", "share of packages delivered")
    for i, run in enumerate(runs):
        times = sorted(d for t in run.tasks if (d := t.delivery_s) is not None)
        if not times:
            continue
        total = len(run.tasks)
        ax.step(
            [0.0, *times],
            [0.0, *((k + 1) / total for k in range(len(times)))],
            where="post",
            color=_COLOURS[i % len(_COLOURS)],
            label=_label(run, i),
        )
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
        parts = ax.boxplot(
            [by_turn[t] for t in turns],
            positions=[t + offset for t in turns],
            widths=width * 0.9,
            patch_artist=True,
            manage_ticks=False,
        )
        for box in parts["boxes"]:
            box.set_facecolor(_COLOURS[i % len(_COLOURS)])
            box.set_alpha(0.5)
        ax.plot([], [], color=_COLOURS[i % len(_COLOURS)], label=_label(run, i))
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
    return [
        make(runs, out_dir / f"{name}.png") for name, make in zip(PLOT_NAMES, makers, strict=True)
    ]


def write_sweep_plot(
    floors: Sequence[float],
    summaries: Sequence[Mapping[str, Any]],
    path: Path,
    best: float | None,
) -> Path:
    """Aggregate tokens/s, wall time, p50 delivery and time under the floor against the
    floor; the sweet spot (the knee) marked on each."""
    fig = _figure(7, 10)
    axes = fig.subplots(4, 1, sharex=True)
    series = (
        ("agg_tps", "aggregate tok/s"),
        ("wall_s", "wall (s)"),
        ("p50_delivery_s", "p50 delivery (s)"),
        ("time_under_floor", "time under floor (share)"),
    )
    for ax, (key, label) in zip(axes, series, strict=True):
        values = [s.get(key) for s in summaries]
        ax.plot(floors, [float("nan") if v is None else float(v) for v in values], marker="o")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if best is not None:
            ax.axvline(best, color="tab:green", linestyle="--", linewidth=1)
    axes[0].set_title("Sweep over the floor" + (f" (sweet spot, the knee: {best:g})" if best
                                                else ""))
    axes[-1].set_xlabel("floor (tokens/s per worker)")
    return _save(fig, path)
