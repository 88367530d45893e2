"""The template manifest (``template.toml``): pydantic models, strict about unknown fields.

A template is a folder: ``template.toml`` plus the text/Jinja files it names. The manifest
declares four things, each one table:

* ``[prefix]``: how the immutable project prefix is composed (ordered ``sections``), its
  token target and which project files are eligible;
* ``[tool_calls]`` and ``[turns]``: the tool-call syntax and the turn format of a worker;
* ``[tools]`` and ``[[skills]]``: which tools a worker has and the agent card's skills;
* ``[scenario]``: defaults of the simulated courier scenario.

Every model forbids unknown keys, so a typo is an error naming the field, never a silently
ignored setting. Validation here does no I/O; :mod:`mesh.template.loader` checks that the
files named exist.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "TOOL_NAMES",
    "Distribution",
    "FilesSection",
    "FixedDist",
    "LogNormalDist",
    "Manifest",
    "OutlineSection",
    "PrefixSpec",
    "ScenarioSpec",
    "Section",
    "Skill",
    "TemplateError",
    "TextSection",
    "ToolCallSyntax",
    "ToolsSpec",
    "TreeSection",
    "TurnSpec",
    "UniformDist",
]

TOOL_NAMES = ("list_files", "read_file", "grep", "delegate")
ToolName = Literal["list_files", "read_file", "grep", "delegate"]


class TemplateError(ValueError):
    """A template (or a prefix directory) is malformed. Names the file and, if any, field.

    A ``ValueError``: it is bad input, and callers that report bad input (``mesh serve``
    prints ``ValueError`` and exits 2) report this one too instead of a traceback.
    """

    def __init__(self, file: Path | str, field: str | None, message: str) -> None:
        self.file = str(file)
        self.field = field
        self.message = message
        where = f"{self.file}: {field}" if field else self.file
        super().__init__(f"{where}: {message}")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


NonEmpty = Annotated[str, Field(min_length=1)]
Share = Annotated[float, Field(gt=0.0, le=1.0)]

# --------------------------------------------------------------------------- prefix


class TextSection(_Model):
    """A template file rendered with Jinja (system prompt, tool docs, guidelines)."""

    kind: Literal["text"]
    file: NonEmpty


class TreeSection(_Model):
    """The project's file tree, sorted, at most ``max_entries`` lines."""

    kind: Literal["tree"]
    title: NonEmpty = "Project tree"
    max_entries: int = Field(200, ge=1)
    share: Share = 1.0  # most of the target this section may take


class OutlineSection(_Model):
    """The project outline: one line for every file the scan sees (path, size, summary,
    top-level names with line numbers; :func:`mesh.template.outline.file_entry`), at most
    ``max_definitions`` names a line. Over the section's share, the folders the project
    names least (:func:`mesh.template.outline.reference_counts`) are folded into one line
    each (how many files, how large) until it fits."""

    kind: Literal["outline"]
    title: NonEmpty = "Project outline"
    exclude: list[NonEmpty] = []
    max_definitions: int = Field(6, ge=0)
    share: Share = 1.0


class FilesSection(_Model):
    """Project files matching ``include``, full or outlined: in pattern order, or with
    ``order = "referenced"`` the files the project names most first.

    ``required`` files must exist (else the prefix build fails naming them); a file that is
    matched but binary, too large or over the budget is skipped and listed.
    """

    kind: Literal["files"]
    title: NonEmpty
    include: list[NonEmpty] = Field(min_length=1)
    exclude: list[NonEmpty] = []
    required: list[NonEmpty] = []
    mode: Literal["full", "outline"] = "full"
    order: Literal["pattern", "referenced"] = "pattern"
    max_tokens_per_file: int = Field(2000, ge=16)
    share: Share = 1.0


Section = Annotated[TextSection | TreeSection | OutlineSection | FilesSection,
                    Field(discriminator="kind")]


class PrefixSpec(_Model):
    target_tokens: int = Field(ge=64)
    fill: bool = True  # pad with a labelled appendix of project text up to the target
    max_file_bytes: int = Field(262_144, ge=1)
    include_hidden: bool = False
    exclude: list[NonEmpty] = []
    sections: list[Section] = Field(min_length=1)


# --------------------------------------------------------------------------- turns


class ToolCallSyntax(_Model):
    """How a tool call and a final answer look in generated text.

    ``style = "json"``: ``<open>{"name": "read_file", "arguments": {"path": "x"}}<close>``.
    ``style = "call"``: ``<open>read_file(path="x")<close>`` (Python call, literal args).
    """

    style: Literal["json", "call"]
    open: NonEmpty = "<tool_call>"
    close: NonEmpty = "</tool_call>"
    answer_open: NonEmpty = "<answer>"
    answer_close: NonEmpty = "</answer>"

    @model_validator(mode="after")
    def _distinct(self) -> ToolCallSyntax:
        tags = [self.open, self.close, self.answer_open, self.answer_close]
        if len(set(tags)) != len(tags):
            raise ValueError("open, close, answer_open and answer_close must all differ")
        return self

    def format(self, name: str, arguments: dict[str, object]) -> str:
        """One call in this syntax (used for examples and for scripted scenario calls)."""
        if self.style == "json":
            body = json.dumps({"name": name, "arguments": arguments}, sort_keys=True)
        else:
            body = f"{name}({', '.join(f'{k}={v!r}' for k, v in sorted(arguments.items()))})"
        return f"{self.open}{body}{self.close}"


class TurnSpec(_Model):
    instructions: NonEmpty  # Jinja file: the first user message's content
    tool_result: NonEmpty  # Jinja file: a tool result message's content
    max_turns: int = Field(8, ge=1)
    max_tokens_per_turn: int = Field(256, ge=1)
    max_total_tokens: int = Field(2048, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    # Sample each turn under the GBNF grammar of mesh.worker.grammar (false: the raw model).
    grammar: bool = True


class ToolsSpec(_Model):
    enabled: list[ToolName] = Field(min_length=1)
    max_output_tokens: int = Field(512, ge=16)


class Skill(_Model):
    id: NonEmpty
    name: NonEmpty
    description: NonEmpty
    tags: list[NonEmpty] = []
    examples: list[NonEmpty] = []


# --------------------------------------------------------------------------- scenario


class FixedDist(_Model):
    dist: Literal["fixed"]
    value: float = Field(ge=0.0)


class UniformDist(_Model):
    dist: Literal["uniform"]
    min: float = Field(ge=0.0)
    max: float = Field(ge=0.0)

    @model_validator(mode="after")
    def _ordered(self) -> UniformDist:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self


class LogNormalDist(_Model):
    """Log-normal around ``median`` with shape ``sigma``, clipped to ``[min, max]``."""

    dist: Literal["lognormal"]
    median: float = Field(gt=0.0)
    sigma: float = Field(ge=0.0)
    min: float = Field(0.0, ge=0.0)
    max: float = Field(gt=0.0)

    @model_validator(mode="after")
    def _ordered(self) -> LogNormalDist:
        if not self.min <= self.median <= self.max:
            raise ValueError("need min <= median <= max")
        return self


Distribution = Annotated[FixedDist | UniformDist | LogNormalDist, Field(discriminator="dist")]


class ScenarioSpec(_Model):
    packages: int = Field(ge=1)
    steps: int = Field(ge=1)
    tokens_per_step: int = Field(ge=1)
    tools: list[NonEmpty] = Field(min_length=1)  # names the scripted calls use, in rotation
    tool_latency_s: Distribution
    tool_output_tokens: Distribution
    # true: each package is sent as plain text, so the coordinator plans it (a planner
    # session, its planned workers running real turns, a synthesis session); the step
    # schedule then does not apply. false (default): explicit subtasks, no planning.
    plan: bool = False


# --------------------------------------------------------------------------- manifest


class Manifest(_Model):
    version: Literal[1] = 1
    name: NonEmpty
    description: NonEmpty
    prefix: PrefixSpec
    tool_calls: ToolCallSyntax
    turns: TurnSpec
    tools: ToolsSpec
    skills: list[Skill] = Field(min_length=1)
    scenario: ScenarioSpec

    @field_validator("skills")
    @classmethod
    def _unique_skill_ids(cls, skills: list[Skill]) -> list[Skill]:
        ids = [s.id for s in skills]
        if len(set(ids)) != len(ids):
            raise ValueError(f"skill ids must be unique, got {ids}")
        return skills

    def files(self) -> list[tuple[str, str]]:
        """Every template file the manifest names, as ``(field, relative path)``."""
        out = [
            ("turns.instructions", self.turns.instructions),
            ("turns.tool_result", self.turns.tool_result),
        ]
        for i, section in enumerate(self.prefix.sections):
            if isinstance(section, TextSection):
                out.append((f"prefix.sections[{i}].file", section.file))
        return out
