"""The worker the coordinator runs for each subtask: a scenario or the agent loop.

A subtask whose params carry ``scenario`` (the simulation harness sends these) runs on a
:class:`~mesh.worker.simulated.ScenarioWorker`; anything else runs the template's agent loop
(:class:`~mesh.worker.loop.AgentWorker`) with the given tools. One instance per subtask.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mesh.engine.types import Engine
from mesh.template.chat import ChatFormat
from mesh.template.loader import Template
from mesh.worker.loop import AgentWorker
from mesh.worker.simulated import ScenarioWorker
from mesh.worker.tools import ToolFn
from mesh.worker.types import Emit, Subtask, Worker, WorkerResult

__all__ = ["DispatchWorker"]


@dataclass
class DispatchWorker:
    engine: Engine
    template: Template
    tools: Mapping[str, ToolFn]
    chat: ChatFormat | None = None  # the model's chat format (default: plain)

    async def run(self, subtask: Subtask, emit: Emit) -> WorkerResult:
        worker: Worker
        if subtask.params.get("scenario"):
            worker = ScenarioWorker(self.engine, self.template)
        else:
            worker = AgentWorker(self.engine, self.template, self.tools, chat=self.chat)
        return await worker.run(subtask, emit)
