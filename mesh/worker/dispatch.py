"""The worker the coordinator runs for each subtask: a scenario or the agent loop.

A subtask whose params carry ``scenario`` (the simulation harness sends these) runs on a
:class:`~mesh.worker.simulated.ScenarioWorker`; anything else runs the template's agent loop
(:class:`~mesh.worker.loop.AgentWorker`) with the given tools. One instance per subtask.

Scenario params are honoured only when the operator turned simulation on
(``simulation=True``: ``mesh serve --simulation``, or the server ``mesh simulate`` starts);
otherwise such a subtask fails with the fix. The coordinator's door check refuses them
first (-32602), so this is the second line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mesh.engine.interface import Engine
from mesh.template.chat import ChatFormat
from mesh.template.loader import Template
from mesh.worker.grammar import ProjectPaths
from mesh.worker.loop import AgentWorker, WorkerFailed
from mesh.worker.simulated import ScenarioWorker
from mesh.worker.tools import DelegateTool, ToolFn
from mesh.worker.types import Emit, Subtask, Worker, WorkerResult

__all__ = ["DispatchWorker"]


@dataclass
class DispatchWorker:
    engine: Engine
    template: Template
    tools: Mapping[str, ToolFn]
    chat: ChatFormat | None = None  # the model's chat format (default: plain)
    simulation: bool = False
    paths: ProjectPaths | None = None  # the project's paths tool calls may name
    first_call: bool = False  # a worker's first turn must call a tool

    async def run(self, subtask: Subtask, emit: Emit) -> WorkerResult:
        worker: Worker
        if subtask.params.get("scenario"):
            if not self.simulation:
                raise WorkerFailed("scenario params are off on this server; start it with "
                                   "`mesh serve --simulation` (or use `mesh simulate`)")
            worker = ScenarioWorker(self.engine, self.template)
        else:
            tools = {name: tool.for_hops(subtask.hops) if isinstance(tool, DelegateTool)
                     else tool for name, tool in self.tools.items()}
            worker = AgentWorker(self.engine, self.template, tools, chat=self.chat,
                                 paths=self.paths, first_call=self.first_call)
        return await worker.run(subtask, emit)
