"""``parking_over_time.png`` of an ``idle-agents`` run (or any run in which a session was
parked): one panel per quantity on one time axis — sessions (attached, resident, parked),
cells (in the cache, parked), parked host MB, and the workers' tokens/s (client turns, the
slowest and median decoding worker, the floor). The figures are :mod:`mesh.sim.idle`'s.
Pure apart from the file written.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.ticker import MaxNLocator

from mesh.sim.idle import MB, has_parking, parking_series
from mesh.sim.measure import cap_num, floor_of
from mesh.sim.plots import _figure, shade_neighbour
from mesh.sim.types import SimRun

__all__ = ["PARKING_PLOT", "parking_plots", "plot_parking"]

PARKING_PLOT = "parking_over_time"
_NAN = float("nan")


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

    label = "worker turns (client)"
    for task in run.tasks:
        for _, start, end, rate in task.turn_rates(run.tokens_per_step):
            tps.hlines(rate, start, end, colors="tab:gray", alpha=0.6, label=label)
            label = "_nolegend_"
    for key, style, name in (("min", "-", "slowest decoding worker"),
                             ("p50", ":", "median decoding worker")):
        values = [cap_num(s.capacity, "measured_tps", key) for s in run.samples]
        tps.plot([s.t for s in run.samples], [_NAN if v is None else v for v in values],
                 color="tab:green", linestyle=style, label=name)
    floor = floor_of(run)
    if floor is not None:
        tps.axhline(floor, color="black", linestyle="--", linewidth=1, label=f"floor {floor:g}")
    tps.set_ylabel("tokens/s per worker")
    tps.set_title("Workers' tokens/s", fontsize="medium")
    tps.set_xlabel("time (s)")
    for ax in axes:
        ax.set_ylim(bottom=0)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def parking_plots(runs: Sequence[SimRun], out_dir: Path) -> list[Path]:
    """``parking_over_time.png`` for a single run with parking data (none otherwise)."""
    if len(runs) != 1 or not has_parking(runs[0]):
        return []
    return [plot_parking(runs[0], out_dir / f"{PARKING_PLOT}.png")]
