"""How the coordinator plans (:class:`AgentConfig`), checked once at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mesh.agent.plans import ACTIONS, plan_schema
from mesh.agent.request_parts import request_parts

__all__ = ["PLAN_MODES", "PLAN_STYLES", "AgentConfig"]

PLAN_MODES = ("auto", "always", "never")
# free: the model writes each subtask's instructions; guided: each subtask is one part of
# the request (mesh.agent.request_parts) and the model adds files, tools and detail.
PLAN_STYLES = ("free", "guided")


@dataclass(frozen=True)
class AgentConfig:
    """How the coordinator plans. ``history_tokens`` bounds what a follow-up's plan sees
    of the earlier conversation; ``text_max`` bounds each string of a plan (characters);
    ``style`` is one of :data:`PLAN_STYLES`; ``files`` (the project's, as the prefix names
    them) are the only file names a plan may give, when there are any."""

    plan: str = "auto"
    style: str = "free"
    files: tuple[str, ...] = ()
    max_subtasks: int = 4
    text_max: int = 240
    history_tokens: int = 512
    temperature: float = 0.0
    synthesis_max_tokens: int = 256
    actions: tuple[str, ...] = ACTIONS
    tools: tuple[str, ...] = ()
    # The instruction texts of the shared prefix (a template's own text, not the
    # project's): a synthesis or direct answer that reproduces a sentence of them is an echo.
    instructions: tuple[str, ...] = ()

    def validate(self) -> None:
        if self.plan not in PLAN_MODES:
            raise ValueError(f"plan must be one of {PLAN_MODES}, got {self.plan!r}")
        if self.style not in PLAN_STYLES:
            raise ValueError(f"style must be one of {PLAN_STYLES}, got {self.style!r}")
        if self.max_subtasks < 1:
            raise ValueError(f"max_subtasks must be >= 1, got {self.max_subtasks}")
        if self.history_tokens < 0:
            raise ValueError(f"history_tokens must be >= 0, got {self.history_tokens}")
        if self.synthesis_max_tokens < 1:
            raise ValueError("synthesis_max_tokens must be >= 1")
        plan_schema(self.max_subtasks, self.tools, self.actions, self.text_max,
                    files=self.files)  # checks

    def schema(self, message: str) -> dict[str, Any]:
        """The plan schema for ``message``: guided plans follow the request's parts."""
        parts = request_parts(message, self.max_subtasks) if self.style == "guided" else ()
        return plan_schema(self.max_subtasks, self.tools, self.actions, self.text_max,
                           files=self.files, parts=parts)
