"""Workers: a subtask run as a multi-turn agent loop on one pool session.

:class:`AgentWorker` runs the template's turn loop with real tools (:class:`ProjectTools`,
:func:`delegate_tool`); :class:`ScenarioWorker` runs a seeded scenario (real generation,
scripted tool calls). Both implement :class:`~mesh.worker.types.Worker`.
"""

from mesh.worker.dispatch import DispatchWorker
from mesh.worker.loop import AgentWorker, WorkerLimits
from mesh.worker.simulated import ScenarioParams, ScenarioWorker, StepPlan, plan_schedule
from mesh.worker.stream import WorkerFailed
from mesh.worker.toolcalls import ParsedTurn, ToolCall, parse_turn
from mesh.worker.tools import ProjectTools, ToolError, ToolFn, delegate_tool

__all__ = [
    "AgentWorker",
    "DispatchWorker",
    "ParsedTurn",
    "ProjectTools",
    "ScenarioParams",
    "ScenarioWorker",
    "StepPlan",
    "ToolCall",
    "ToolError",
    "ToolFn",
    "WorkerFailed",
    "WorkerLimits",
    "delegate_tool",
    "parse_turn",
    "plan_schedule",
]
