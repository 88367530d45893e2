"""The simulation harness: a seeded scenario driven over real A2A, and its report.

``plan_scenario`` (what each package does) → ``run_simulation`` (start or target a
coordinator, submit every package, sample ``/capacity``; with a :class:`Neighbour`, a
second tenant that comes and goes on a seeded schedule) → ``write_report`` (JSON, Markdown,
plots; per neighbour phase, :func:`phase_summary`); ``run_compare`` and ``run_sweep``
repeat the same scenario over one setting.
"""

from __future__ import annotations

from mesh.sim.compare import run_compare, run_sweep, sweet_spot
from mesh.sim.neighbour import Neighbour
from mesh.sim.phases import phase_summary
from mesh.sim.report import SUMMARY_KEYS, summarize
from mesh.sim.run import ReportFiles, plan_for, run_simulation, write_report
from mesh.sim.scenario import PackagePlan, Scenario, plan_scenario
from mesh.sim.server import ServerError, ServerProcess
from mesh.sim.types import (
    NeighbourConfig,
    PhaseRecord,
    Sample,
    SimConfig,
    SimRun,
    TaskEvent,
    TaskTimeline,
)

__all__ = [
    "SUMMARY_KEYS",
    "Neighbour",
    "NeighbourConfig",
    "PackagePlan",
    "PhaseRecord",
    "ReportFiles",
    "Sample",
    "Scenario",
    "ServerError",
    "ServerProcess",
    "SimConfig",
    "SimRun",
    "TaskEvent",
    "TaskTimeline",
    "phase_summary",
    "plan_for",
    "plan_scenario",
    "run_compare",
    "run_simulation",
    "run_sweep",
    "summarize",
    "sweet_spot",
    "write_report",
]
