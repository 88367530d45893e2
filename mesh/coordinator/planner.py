"""The coordinator's planning turn: the plan's JSON schema, its GBNF grammar, prompt, parser.

A plan is one JSON object of three shapes (the ``action`` decides)::

    {"action": "delegate", "subtasks": [{"instructions": "...", "files": ["..."],
                                         "tools": ["read_file"]}, ...]}
    {"action": "answer", "answer": "..."}        # no worker needed
    {"action": "ask", "question": "..."}         # the task needs the user first

:func:`plan_schema` builds the JSON schema (at most ``max_subtasks`` subtasks, every string
bounded), :func:`schema_to_gbnf` turns that schema into a llama.cpp grammar, so a turn
sampled under it is always a parseable plan that ends within :func:`max_plan_chars`
characters (no free whitespace, bounded strings). A subtask's instructions start with a
letter and hold at least :data:`INSTRUCTIONS_MIN` characters, so even a small model's
noise cannot plan ", ". Everything here is pure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ACTIONS",
    "INSTRUCTIONS_MIN",
    "Plan",
    "PlanError",
    "PlannedSubtask",
    "max_plan_chars",
    "parse_plan",
    "plan_prompt",
    "plan_schema",
    "schema_to_gbnf",
]

ACTIONS = ("delegate", "answer", "ask")
_NAME_MAX = 80
_FILES_MAX = 4
# An instruction starts with a letter and is at least this long (capped by text_max): small
# models otherwise write instructions like ", ". The grammar makes anything else impossible.
INSTRUCTIONS_MIN = 12
_LETTER_FIRST = "^[A-Za-z]"


class PlanError(ValueError):
    """The text is not a plan; the message says what is wrong."""


@dataclass(frozen=True)
class PlannedSubtask:
    """One subtask of a plan: what to do and, where it helps, which files and tools."""

    instructions: str
    files: tuple[str, ...] = ()
    tools: tuple[str, ...] = ()

    def worker_instructions(self, request: str = "") -> str:
        """The instructions a worker gets, the files and tools spelled out. With the
        user's ``request`` the worker also sees what its part belongs to (a plan's
        instructions, a small model's above all, may leave out what the user asked)."""
        lines = [self.instructions]
        if self.files:
            lines.append("Files to look at: " + ", ".join(self.files))
        if self.tools:
            lines.append("Tools to use: " + ", ".join(self.tools))
        request = request.strip()
        if request and request != self.instructions:
            lines.append(f"This is part of the user's request: {request}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Plan:
    """A parsed plan. ``action`` is one of :data:`ACTIONS`."""

    action: str
    subtasks: tuple[PlannedSubtask, ...] = ()
    answer: str = ""
    question: str = ""
    source: str = field(default="model", compare=False)  # "model" | "fallback"

    def to_dict(self) -> dict[str, Any]:
        """The plan as published on the task (camelCase keys)."""
        out: dict[str, Any] = {"action": self.action, "source": self.source}
        if self.action == "delegate":
            out["subtasks"] = [
                {"id": f"p{i + 1}", "instructions": s.instructions, "files": list(s.files),
                 "tools": list(s.tools)}
                for i, s in enumerate(self.subtasks)
            ]
        elif self.action == "answer":
            out["answer"] = self.answer
        else:
            out["question"] = self.question
        return out


# --------------------------------------------------------------------------- schema


def _string(max_len: int, min_len: int = 1) -> dict[str, Any]:
    return {"type": "string", "minLength": min_len, "maxLength": max_len}


def _instructions(max_len: int) -> dict[str, Any]:
    """A subtask's instructions: a letter first, a non-blank last, at least
    ``INSTRUCTIONS_MIN`` characters in all."""
    return {**_string(max_len, min(INSTRUCTIONS_MIN, max_len)), "pattern": _LETTER_FIRST}


def plan_schema(
    max_subtasks: int,
    tools: Sequence[str] = (),
    actions: Sequence[str] = ACTIONS,
    text_max: int = 240,
) -> dict[str, Any]:
    """The JSON schema of a plan; ``actions`` narrows which shapes are allowed.

    Instructions are at most ``text_max`` characters (at least ``min(INSTRUCTIONS_MIN,
    text_max)``, the first a letter), a direct answer or a question twice that, a file name
    ``min(80, text_max)``.
    """
    if text_max < 8:
        raise ValueError(f"text_max must be >= 8, got {text_max}")
    if max_subtasks < 1:
        raise ValueError(f"max_subtasks must be >= 1, got {max_subtasks}")
    bad = [a for a in actions if a not in ACTIONS]
    if bad or not actions:
        raise ValueError(f"actions must be a non-empty subset of {ACTIONS}, got {list(actions)}")
    name = min(_NAME_MAX, text_max)
    tool_item: dict[str, Any] = {"enum": list(tools)} if tools else _string(name)
    subtask = {
        "type": "object",
        "properties": {
            "instructions": _instructions(text_max),
            "files": {"type": "array", "items": _string(name), "maxItems": _FILES_MAX},
            "tools": {"type": "array", "items": tool_item, "maxItems": max(1, len(tools))},
        },
    }
    shapes = {
        "delegate": {"type": "object", "properties": {
            "action": {"const": "delegate"},
            "subtasks": {"type": "array", "items": subtask, "minItems": 1,
                         "maxItems": max_subtasks}}},
        "answer": {"type": "object", "properties": {
            "action": {"const": "answer"}, "answer": _string(2 * text_max)}},
        "ask": {"type": "object", "properties": {
            "action": {"const": "ask"}, "question": _string(2 * text_max)}},
    }
    return {"oneOf": [shapes[a] for a in actions]}


# --------------------------------------------------------------------------- grammar


class _Gbnf:
    """Schema → GBNF for the subset :func:`plan_schema` uses (every property required, in
    order; strings without escapes and bounded; arrays bounded; const/enum; oneOf)."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}

    def add(self, name: str, body: str) -> str:
        self.rules.setdefault(name, body)
        return name

    def visit(self, node: Mapping[str, Any], name: str) -> str:
        if "oneOf" in node:
            alts = [self.visit(n, f"{name}-{i}") for i, n in enumerate(node["oneOf"])]
            return self.add(name, " | ".join(alts))
        if "const" in node:
            return self.add(name, _literal(json.dumps(node["const"])))
        if "enum" in node:
            return self.add(name, " | ".join(_literal(json.dumps(v)) for v in node["enum"]))
        kind = node.get("type")
        if kind == "string":
            lo, hi = int(node.get("minLength", 0)), int(node["maxLength"])
            self.add("char", r'[^"\\\x00-\x1f]')
            pattern = node.get("pattern")
            if pattern is not None:
                if pattern != _LETTER_FIRST:
                    raise ValueError(f"the plan grammar supports only the pattern "
                                     f"{_LETTER_FIRST!r}, got {pattern!r}")
                # a letter, then a last char that is not blank: stripped, still >= lo
                self.add("letter", "[A-Za-z]")
                self.add("char0", r'[^"\\\x00-\x20]')
                mid = f"char{{{max(lo, 2) - 2},{hi - 2}}}"
                return self.add(name, f'"\\"" letter {mid} char0 "\\""')
            self.add("char0", r'[^"\\\x00-\x20]')  # a first char that is not blank
            if lo >= 1:
                body = f'"\\"" char0 char{{0,{hi - 1}}} "\\""'
            else:
                body = f'"\\"" char{{0,{hi}}} "\\""'
            return self.add(name, body)
        if kind == "array":
            item = self.visit(node["items"], f"{name}-item")
            lo, hi = int(node.get("minItems", 0)), int(node["maxItems"])
            more = f'("," {item}){{0,{hi - 1}}}'
            body = f'"[" {item} {more} "]"' if lo >= 1 else f'"[" ({item} {more})? "]"'
            return self.add(name, body)
        if kind == "object":
            pieces = []
            for i, (key, sub) in enumerate(node["properties"].items()):
                rule = self.visit(sub, f"{name}-{key}")
                sep = "{" if i == 0 else ","
                pieces.append(f"{_literal(sep + json.dumps(key) + ':')} {rule}")
            return self.add(name, " ".join(pieces) + ' "}"')
        raise ValueError(f"schema node not supported by the plan grammar: {node}")


def _literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def schema_to_gbnf(schema: Mapping[str, Any]) -> str:
    """A GBNF grammar (root rule ``root``) accepting exactly the JSON texts of ``schema``."""
    g = _Gbnf()
    top = g.visit(schema, "plan")
    lines = [f"root ::= {top}"] + [f"{name} ::= {body}" for name, body in g.rules.items()]
    return "\n".join(lines) + "\n"


def max_plan_chars(schema: Mapping[str, Any]) -> int:
    """An upper bound of a plan's length in characters (so in tokens: every token the
    grammar accepts writes at least one character)."""

    def size(node: Mapping[str, Any]) -> int:
        if "oneOf" in node:
            return max(size(n) for n in node["oneOf"])
        if "const" in node:
            return len(json.dumps(node["const"]))
        if "enum" in node:
            return max(len(json.dumps(v)) for v in node["enum"])
        if node.get("type") == "string":
            return int(node["maxLength"]) + 2
        if node.get("type") == "array":
            return 2 + int(node["maxItems"]) * (size(node["items"]) + 1)
        return 2 + sum(len(json.dumps(k)) + 2 + size(v) for k, v in node["properties"].items())

    return size(schema)


# --------------------------------------------------------------------------- prompt, parse


def plan_prompt(
    message: str, history: str, tools: Sequence[str], max_subtasks: int
) -> str:
    """The planning turn's suffix (after the shared project prefix)."""
    parts = [
        "You are the coordinator. Plan how to answer the user's request about the project."
        " You cannot open the project's files yourself: workers can, with their tools. A"
        " request about the code, its files, names, values, errors or tests needs workers;"
        " answer directly only when it needs nothing from the files.",
        f"Reply with one JSON object. To use workers: {{\"action\":\"delegate\",\"subtasks\":"
        f"[{{\"instructions\":...,\"files\":[...],\"tools\":[...]}}]}} with 1 to {max_subtasks}"
        " independent subtasks, one per part of the request. If no worker is needed: "
        "{\"action\":\"answer\",\"answer\":...}. If you need something from the user first: "
        "{\"action\":\"ask\",\"question\":...}.",
        f"Tools workers have: {', '.join(tools) if tools else '(none)'}.",
    ]
    if history:
        parts.append("Earlier in this conversation:\n" + history)
    parts.append("User request:\n" + message)
    parts.append("Plan:")
    return "\n\n".join(parts) + "\n"


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PlanError(f"{where} must be a list of strings")
    return tuple(v.strip() for v in value if v.strip())


def parse_plan(text: str, max_subtasks: int) -> Plan:
    """The plan in ``text`` (one JSON object); raises :class:`PlanError` saying why not."""
    try:
        data = json.loads(text.strip())
    except json.JSONDecodeError as e:
        raise PlanError(f"the plan is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise PlanError("the plan must be a JSON object")
    action = data.get("action")
    if action == "answer":
        answer = data.get("answer")
        if not isinstance(answer, str) or not answer.strip():
            raise PlanError("an 'answer' plan needs a non-empty answer")
        return Plan("answer", answer=answer.strip())
    if action == "ask":
        question = data.get("question")
        if not isinstance(question, str) or not question.strip():
            raise PlanError("an 'ask' plan needs a non-empty question")
        return Plan("ask", question=question.strip())
    if action != "delegate":
        raise PlanError(f"action must be one of {ACTIONS}, got {action!r}")
    raw = data.get("subtasks")
    if not isinstance(raw, list) or not raw:
        raise PlanError("a 'delegate' plan needs a non-empty subtasks list")
    if len(raw) > max_subtasks:
        raise PlanError(f"the plan has {len(raw)} subtasks; at most {max_subtasks} are allowed")
    subtasks = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise PlanError(f"subtasks[{i}] must be an object")
        instructions = entry.get("instructions")
        if not isinstance(instructions, str) or not instructions.strip():
            raise PlanError(f"subtasks[{i}].instructions must be a non-empty string")
        subtasks.append(PlannedSubtask(
            instructions.strip(),
            _strings(entry.get("files"), f"subtasks[{i}].files"),
            _strings(entry.get("tools"), f"subtasks[{i}].tools"),
        ))
    return Plan("delegate", tuple(subtasks))


def fallback_plan(message: str) -> Plan:
    """The plan used when the model's plan does not parse: the request as one subtask."""
    return Plan("delegate", (PlannedSubtask(message),), source="fallback")
