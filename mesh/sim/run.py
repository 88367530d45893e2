"""One simulation run end to end: plan, (start a server,) drive, stop; then its report."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from mesh.sim.driver import OnProgress, drive
from mesh.sim.plots import write_plots
from mesh.sim.report import Summary, report_document, summarize, write_json, write_markdown
from mesh.sim.scenario import Scenario, plan_scenario
from mesh.sim.server import ServerCommand, ServerProcess
from mesh.sim.types import SimConfig, SimRun
from mesh.template.loader import load_template

__all__ = ["ReportFiles", "plan_for", "run_simulation", "write_report"]


@dataclass(frozen=True)
class ReportFiles:
    json: Path
    markdown: Path
    plots: tuple[Path, ...]
    summary: Summary


def plan_for(config: SimConfig) -> Scenario:
    """The scenario ``config`` asks for (the template's defaults fill what it leaves out)."""
    spec = load_template(config.template).manifest.scenario
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
    if config.url is not None:
        run = asyncio.run(drive(config.url, config, scenario, on_progress=on_progress))
        run.server["started_here"] = False
    else:
        with ServerProcess(config, command=server_command) as url:
            run = asyncio.run(drive(url, config, scenario, on_progress=on_progress))
        run.server["started_here"] = True
    run.label = label
    return run


def write_report(run: SimRun, out_dir: Path) -> ReportFiles:
    """``report.json``, ``report.md`` and the plots of one run, in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(run)
    plots = write_plots([run], out_dir)
    json_path = write_json(out_dir / "report.json", report_document(run, summary))
    md_path = write_markdown(out_dir / "report.md", run, summary, plots)
    return ReportFiles(json_path, md_path, tuple(plots), summary)
