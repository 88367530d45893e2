"""One simulation run end to end: plan, (start a server,) drive, stop; then its report."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path

from mesh.sim.driver import OnProgress, drive
from mesh.sim.idle_plot import parking_plots
from mesh.sim.neighbour import Neighbour
from mesh.sim.plots import write_plots
from mesh.sim.report import Summary, report_document, summarize, write_json, write_markdown
from mesh.sim.scenario import Scenario, plan_scenario
from mesh.sim.server import ServerCommand, ServerProcess
from mesh.sim.types import SimConfig, SimRun
from mesh.template.loader import load_template

__all__ = ["ReportFiles", "neighbour_for", "plan_for", "run_simulation", "write_report"]


@dataclass(frozen=True)
class ReportFiles:
    json: Path
    markdown: Path
    plots: tuple[Path, ...]
    summary: Summary


def plan_for(config: SimConfig) -> Scenario:
    """The scenario ``config`` asks for (the template's defaults fill what it leaves out)."""
    spec = load_template(config.template).manifest.scenario
    if config.idle_agents:  # many agents, long seeded idle gaps, never planned
        idle = config.idle
        packages = config.packages if config.packages is not None else idle.default_agents()
        return plan_scenario(spec, config.seed, packages=packages, steps=config.steps,
                             tokens_per_step=config.tokens_per_step, plan=False,
                             tool_latency_s=idle.tool_latency())
    return plan_scenario(
        spec,
        config.seed,
        packages=config.packages,
        steps=config.steps,
        tokens_per_step=config.tokens_per_step,
        plan=config.plan,
    )


def run_simulation(
    config: SimConfig,
    *,
    on_progress: OnProgress | None = None,
    server_command: ServerCommand | None = None,
    label: str = "",
) -> SimRun:
    """Run ``config`` once: against ``config.url``, or a ``mesh serve`` started for it.

    Raises ``ValueError`` for a bad config and :class:`~mesh.sim.server.ServerError` if
    the server does not come up; the server is stopped in every case.
    """
    config.validate()
    scenario = plan_for(config)
    with contextlib.ExitStack() as stack:
        neighbour = neighbour_for(config)
        if neighbour is not None:  # before the server: its start-up is not the run's
            stack.enter_context(neighbour)
        if config.url is not None:
            url = config.url
        else:
            url = stack.enter_context(ServerProcess(config, command=server_command))
        run = asyncio.run(drive(url, config, scenario, on_progress=on_progress,
                                neighbour=neighbour))
    run.server["started_here"] = config.url is None
    run.label = label
    return run


def neighbour_for(config: SimConfig) -> Neighbour | None:
    """The neighbour ``config`` asks for (not set up yet), or None."""
    if not config.neighbour.enabled:
        return None
    return Neighbour(config.neighbour, config.seed, config.model,
                     startup_timeout_s=config.startup_timeout_s)


def write_report(run: SimRun, out_dir: Path) -> ReportFiles:
    """``report.json``, ``report.md`` and the plots of one run, in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(run)
    plots = write_plots([run], out_dir) + parking_plots([run], out_dir)
    json_path = write_json(out_dir / "report.json", report_document(run, summary))
    md_path = write_markdown(out_dir / "report.md", run, summary, plots)
    return ReportFiles(json_path, md_path, tuple(plots), summary)
