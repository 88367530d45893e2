"""The coordinator's plan: its grammar, explicit subtask lists, the parts of a request, and
the planning turn (schema, prompt, parser). Everything here is pure.

**The plan grammar.** :func:`schema_to_gbnf` turns the subset of JSON schema that
:func:`plan_schema` writes into a llama.cpp grammar: every property required and in
order; strings bounded and without escapes (``pattern`` only as :data:`LETTER_FIRST`;
:data:`STARTS_WITH`: a fixed JSON-escaped opening the model continues); arrays bounded, or
a fixed tuple (``prefixItems``); ``const``, ``enum`` and ``oneOf``. No free whitespace, so
every text the grammar admits is a parseable plan of at most :func:`max_plan_chars`
characters.

**Explicit subtasks.** A message carries plain text (planned, or one subtask) or a data
part ``{"subtasks": [{"instructions": "...", "params": {...}, "id": "optional"}, ...]}``.
Text parts next to a subtask list go to each subtask as ``params["context"]``
(:func:`explicit_plan`). :func:`check_subtask_list` runs once, on the raw JSON at the door
(:mod:`mesh.a2a.validation`), so a client's mistake is reported as invalid params.

**Request parts.** Guided planning (``style="guided"``) anchors each planned subtask on
one part of the request, so a small model's plan keeps what was asked::

    "In which file is the parcel weight checked, and what happens to a parcel of 40 kg?"
    -> ("In which file is the parcel weight checked?", "What happens to a parcel of 40 kg?")

A request splits between sentences, at ``;``, and before a question word that opens a new
clause (``, which ...``, ``, and what ...``, `` and how ...``). A part of fewer than
:data:`MIN_WORDS` words joins the one before it, so ``"Where, and why?"`` stays whole.
Each part starts with a capital letter and ends with its sentence's punctuation.

**The planning turn.** A plan is one JSON object of three shapes::

    {"action": "delegate", "subtasks": [{"instructions": "...", "files": ["..."],
                                         "tools": ["read_file"]}, ...]}
    {"action": "answer", "answer": "..."}        # no worker needed
    {"action": "ask", "question": "..."}         # the task needs the user first

A subtask's instructions start with a letter and hold at least :data:`INSTRUCTIONS_MIN`
characters, so even a small model's noise cannot plan ", ".
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mesh.worker.types import Subtask

__all__ = [
    "ACTIONS", "INSTRUCTIONS_MIN", "LETTER_FIRST", "MIN_WORDS", "STARTS_WITH", "Plan", "PlanError",
    "PlannedSubtask", "SubtaskSpec", "check_subtask_list", "explicit_plan", "fallback_plan",
    "local_id", "max_plan_chars", "parse_plan", "plan_prompt", "plan_schema", "request_parts",
    "schema_to_gbnf"
]


# -------------------- the plan grammar ----------------------------------------

LETTER_FIRST = "^[A-Za-z]"
STARTS_WITH = "x-startsWith"  # a string that begins with this text, then free characters


class _Gbnf:
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
            return self._string(node, name)
        if kind == "array" and "prefixItems" in node:
            items = [self.visit(n, f"{name}-{i}") for i, n in enumerate(node["prefixItems"])]
            return self.add(name, '"[" ' + ' "," '.join(items) + ' "]"')
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

    def _string(self, node: Mapping[str, Any], name: str) -> str:
        lo, hi = int(node.get("minLength", 0)), int(node["maxLength"])
        self.add("char", r'[^"\\\x00-\x1f]')
        self.add("char0", r'[^"\\\x00-\x20]')  # a char that is not blank
        opening = node.get(STARTS_WITH)
        if opening is not None:
            # the opening as JSON writes it, then up to the rest of the bound freely
            fixed = json.dumps(opening, ensure_ascii=False)[1:-1]
            room = max(0, hi - len(opening))
            return self.add(name, f'"\\"" {_literal(fixed)} char{{0,{room}}} "\\""')
        pattern = node.get("pattern")
        if pattern is not None:
            if pattern != LETTER_FIRST:
                raise ValueError(f"the plan grammar supports only the pattern "
                                 f"{LETTER_FIRST!r}, got {pattern!r}")
            # a letter, then a last char that is not blank: stripped, still >= lo
            self.add("letter", "[A-Za-z]")
            mid = f"char{{{max(lo, 2) - 2},{hi - 2}}}"
            return self.add(name, f'"\\"" letter {mid} char0 "\\""')
        if lo >= 1:
            return self.add(name, f'"\\"" char0 char{{0,{hi - 1}}} "\\""')
        return self.add(name, f'"\\"" char{{0,{hi}}} "\\""')


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
            opening = node.get(STARTS_WITH)
            if opening is not None:  # in bytes: a token may write part of a character
                room = max(0, int(node["maxLength"]) - len(opening))
                return len(json.dumps(opening, ensure_ascii=False).encode()) + room
            return int(node["maxLength"]) + 2
        if node.get("type") == "array" and "prefixItems" in node:
            return 1 + sum(size(n) + 1 for n in node["prefixItems"])
        if node.get("type") == "array":
            return 2 + int(node["maxItems"]) * (size(node["items"]) + 1)
        return 2 + sum(len(json.dumps(k)) + 2 + size(v) for k, v in node["properties"].items())

    return size(schema)

# -------------------- explicit subtasks ---------------------------------------

_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class SubtaskSpec:
    """One entry of a ``subtasks`` list, checked."""

    id: str
    instructions: str
    params: Mapping[str, Any]


def check_subtask_list(value: Any, max_subtasks: int, where: str = "subtasks") -> list[SubtaskSpec]:
    """Check a ``subtasks`` value; raise ``ValueError`` naming the bad entry and the fix."""
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list of objects, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{where} is empty; list at least one {{'instructions': ...}}")
    if len(value) > max_subtasks:
        raise ValueError(f"{where} has {len(value)} entries; at most {max_subtasks} are allowed")
    specs: list[SubtaskSpec] = []
    seen: set[str] = set()
    for i, entry in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{at} must be an object, got {type(entry).__name__}")
        instructions = entry.get("instructions")
        if not isinstance(instructions, str) or not instructions.strip():
            raise ValueError(f"{at}.instructions must be a non-empty string")
        params = entry.get("params", {})
        if not isinstance(params, dict):
            raise ValueError(f"{at}.params must be an object, got {type(params).__name__}")
        sid = entry.get("id", f"s{i + 1}")
        if not isinstance(sid, str) or not _ID.match(sid):
            raise ValueError(f"{at}.id must match [A-Za-z0-9_.-]{{1,64}}")
        if sid in seen:
            raise ValueError(f"{at}.id {sid!r} is used twice; subtask ids must be unique")
        seen.add(sid)
        unknown = sorted(set(entry) - {"instructions", "params", "id"})
        if unknown:
            raise ValueError(f"{at} has unknown keys {unknown}; allowed: id, instructions, params")
        specs.append(SubtaskSpec(id=sid, instructions=instructions, params=params))
    return specs


def local_id(subtask: Subtask) -> str:
    """The id a client used for the subtask (the part after the task id)."""
    return subtask.id.rsplit("/", 1)[-1]

# -------------------- request parts -------------------------------------------

MIN_WORDS = 3
_WH = r"(?:what|which|where|when|who|whom|whose|why|how)\b"
_SENTENCE = re.compile(r"(?<=[?!.])\s+(?=[A-Z0-9\"'`(])")
# a clause boundary: "; ", or a comma / "and" / "then" / "also" before a question word
_CLAUSE = re.compile(
    rf"\s*;\s*|,\s*(?:and\s+|or\s+|then\s+|also\s+)?(?={_WH})|\s+(?:and|then)\s+(?={_WH})",
    re.IGNORECASE,
)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _words(text: str, span: tuple[int, int]) -> int:
    return len(text[span[0]:span[1]].split())


def _finish(part: str, end: str) -> str:
    part = part[0].upper() + part[1:]
    return part if part[-1] in ".?!" else part + end


def request_parts(message: str, max_parts: int) -> tuple[str, ...]:
    """The request's parts, at most ``max_parts`` (the tail joins the last one); the whole
    request (whitespace folded) when it has no parts to split."""
    if max_parts < 1:
        raise ValueError(f"max_parts must be >= 1, got {max_parts}")
    text = " ".join(_CONTROL.sub(" ", message).split())
    parts: list[str] = []
    for sentence in _SENTENCE.split(text) if text else ():
        end = sentence[-1] if sentence[-1] in ".?!" else "."
        # (start, stop) spans of the clauses; a short one (either side) joins its
        # neighbour with the text between them kept: "Where, and why?" stays one part
        spans: list[tuple[int, int]] = []
        at = 0
        for cut in [*_CLAUSE.finditer(sentence), None]:
            stop = cut.start() if cut else len(sentence)
            if sentence[at:stop].strip(" ,;:"):
                if spans and (_words(sentence, (at, stop)) < MIN_WORDS
                              or _words(sentence, spans[-1]) < MIN_WORDS):
                    spans[-1] = (spans[-1][0], stop)
                else:
                    spans.append((at, stop))
            at = cut.end() if cut else stop
        parts.extend(_finish(sentence[a:b].strip(" ,;:"), end) for a, b in spans)
    if len(parts) > max_parts:
        parts[max_parts - 1:] = [" ".join(parts[max_parts - 1:])]
    return tuple(parts)

# -------------------- the planning turn ---------------------------------------

ACTIONS = ("delegate", "answer", "ask")
_NAME_MAX = 80
_FILES_MAX = 4
# An instruction starts with a letter and is at least this long (capped by text_max): small
# models otherwise write instructions like ", ". The grammar makes anything else impossible.
INSTRUCTIONS_MIN = 12
# Guided plans: a subtask's instructions are one part of the request, then at most this
# many characters the model adds (files and tools come from their lists). None: what a
# small model added ("1. The Parcel class itself. 2. The Parcel Class itself.") was what
# its worker then copied as the answer; the part itself is what the worker must answer.
GUIDED_EXTRA = 0
# A project with more files than this plans with free file names, not an enum of them.
FILES_ENUM_MAX = 256


class PlanError(ValueError):
    """The text is not a plan; the message says what is wrong."""


@dataclass(frozen=True)
class PlannedSubtask:
    """One subtask of a plan: what to do and, where it helps, which files and tools.
    An explicit subtask (the client listed it) keeps the client's ``id`` and ``params``;
    a planned one is numbered ``p1``, ``p2``... by its place."""

    instructions: str
    files: tuple[str, ...] = ()
    tools: tuple[str, ...] = ()
    id: str = ""
    params: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def worker_instructions(self, request: str = "", history: str = "") -> str:
        """The instructions a worker gets, the files and tools spelled out. With the
        user's ``request`` the worker also sees what its part belongs to (a plan's
        instructions, a small model's above all, may leave out what the user asked), and
        with ``history`` the conversation a follow-up request continues."""
        lines = [self.instructions]
        if self.files:
            lines.append("Files to look at: " + ", ".join(self.files))
        if self.tools:
            lines.append("Tools to use: " + ", ".join(self.tools))
        request = request.strip()
        if request and request != self.instructions:
            lines.append(f"This is part of the user's request: {request}")
        if history:
            lines.append("Earlier in this conversation:\n" + history)
        return "\n".join(lines)


@dataclass(frozen=True)
class Plan:
    """A parsed plan. ``action`` is one of :data:`ACTIONS`."""

    action: str
    subtasks: tuple[PlannedSubtask, ...] = ()
    answer: str = ""
    question: str = ""
    # "model" (the planning turn's), "fallback" (the request as one subtask, when the
    # plan did not parse) or "explicit" (the client's own subtask list, or the message as
    # one subtask when planning is off): no planning turn, no synthesis turn.
    source: str = field(default="model", compare=False)

    def subtask_ids(self) -> list[str]:
        """Each subtask's id within the task: its own, else ``p1``, ``p2``..."""
        return [s.id or f"p{i + 1}" for i, s in enumerate(self.subtasks)]

    def to_dict(self) -> dict[str, Any]:
        """The plan as published on the task (camelCase keys)."""
        out: dict[str, Any] = {"action": self.action, "source": self.source}
        if self.action == "delegate":
            out["subtasks"] = [
                {"id": sid, "instructions": s.instructions, "files": list(s.files),
                 "tools": list(s.tools)}
                for sid, s in zip(self.subtask_ids(), self.subtasks, strict=True)
            ]
        elif self.action == "answer":
            out["answer"] = self.answer
        else:
            out["question"] = self.question
        return out


def _string(max_len: int, min_len: int = 1) -> dict[str, Any]:
    return {"type": "string", "minLength": min_len, "maxLength": max_len}


def _instructions(max_len: int) -> dict[str, Any]:
    """A subtask's instructions: a letter first, a non-blank last, at least
    ``INSTRUCTIONS_MIN`` characters in all."""
    return {**_string(max_len, min(INSTRUCTIONS_MIN, max_len)), "pattern": LETTER_FIRST}


def plan_schema(max_subtasks: int, tools: Sequence[str] = (), actions: Sequence[str] = ACTIONS,
                text_max: int = 240, *, files: Sequence[str] = (),
                parts: Sequence[str] = ()) -> dict[str, Any]:
    """The JSON schema of a plan; ``actions`` narrows which shapes are allowed.

    Instructions are at most ``text_max`` characters, a direct answer or a question twice
    that, a file name ``min(80, text_max)``. With ``files`` (at most :data:`FILES_ENUM_MAX`)
    a plan names only those. With ``parts`` (guided: :func:`request_parts`) a delegate plan
    has one subtask per part, its instructions the part, then at most
    :data:`GUIDED_EXTRA` characters of the model's own.
    """
    if text_max < 8:
        raise ValueError(f"text_max must be >= 8, got {text_max}")
    if max_subtasks < 1:
        raise ValueError(f"max_subtasks must be >= 1, got {max_subtasks}")
    if len(parts) > max_subtasks:
        raise ValueError(f"{len(parts)} request parts but at most {max_subtasks} subtasks")
    bad = [a for a in actions if a not in ACTIONS]
    if bad or not actions:
        raise ValueError(f"actions must be a non-empty subset of {ACTIONS}, got {list(actions)}")
    name = min(_NAME_MAX, text_max)
    tool_item: dict[str, Any] = {"enum": list(tools)} if tools else _string(name)
    file_item: dict[str, Any] = (
        {"enum": list(files)} if files and len(files) <= FILES_ENUM_MAX else _string(name))

    def subtask(instructions: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "properties": {
            "instructions": instructions,
            "files": {"type": "array", "items": file_item, "maxItems": _FILES_MAX},
            "tools": {"type": "array", "items": tool_item, "maxItems": max(1, len(tools))},
        }}

    subtasks: dict[str, Any]
    if parts:
        subtasks = {"type": "array", "prefixItems": [
            subtask({"type": "string", STARTS_WITH: part, "maxLength": len(part) + GUIDED_EXTRA})
            for part in parts]}
    else:
        subtasks = {"type": "array", "items": subtask(_instructions(text_max)), "minItems": 1,
                    "maxItems": max_subtasks}
    shapes = {
        "delegate": {"type": "object", "properties": {
            "action": {"const": "delegate"}, "subtasks": subtasks}},
        "answer": {"type": "object", "properties": {
            "action": {"const": "answer"}, "answer": _string(2 * text_max)}},
        "ask": {"type": "object", "properties": {
            "action": {"const": "ask"}, "question": _string(2 * text_max)}},
    }
    return {"oneOf": [shapes[a] for a in actions]}


def plan_prompt(message: str, history: str, tools: Sequence[str], max_subtasks: int,
                parts: Sequence[str] = ()) -> str:
    """The planning turn's suffix (after the shared project prefix). With ``parts``
    (guided planning) it lists the request's parts, one subtask each."""
    if parts:
        numbered = "\n".join(f"{i + 1}. {p}" for i, p in enumerate(parts))
        how = (f"The request has {len(parts)} part(s); a worker takes each one:\n{numbered}\n"
               "Reply with one JSON object: {\"action\":\"delegate\",\"subtasks\":[...]}, "
               "one subtask per part in this order, each with the part as its instructions "
               "(add what to look for if it helps), the project files a worker should read "
               "for it, and the tools it needs.")
    else:
        how = (f"Reply with one JSON object. To use workers: {{\"action\":\"delegate\","
               f"\"subtasks\":[{{\"instructions\":...,\"files\":[...],\"tools\":[...]}}]}} "
               f"with 1 to {max_subtasks} independent subtasks, one per part of the request. "
               "If no worker is needed: {\"action\":\"answer\",\"answer\":...}. If you need "
               "something from the user first: {\"action\":\"ask\",\"question\":...}.")
    parts_out = [
        "You are the coordinator. Plan how to answer the user's request about the project."
        " You cannot open the project's files yourself: workers can, with their tools. A"
        " request about the code, its files, names, values, errors or tests needs workers;"
        " answer directly only when it needs nothing from the files.",
        how,
        f"Tools workers have: {', '.join(tools) if tools else '(none)'}.",
    ]
    if history:
        parts_out.append("Earlier in this conversation:\n" + history)
    parts_out.append("User request:\n" + message)
    parts_out.append("Plan:")
    return "\n\n".join(parts_out) + "\n"


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
    if action in ("answer", "ask"):
        key = "answer" if action == "answer" else "question"
        value = data.get(key)
        if not isinstance(value, str) or not value.strip():
            raise PlanError(f"an {action!r} plan needs a non-empty {key}")
        value = value.strip()
        return Plan(action, answer=value) if action == "answer" else Plan(action, question=value)
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
        subtasks.append(PlannedSubtask(instructions.strip(),
                                       _strings(entry.get("files"), f"subtasks[{i}].files"),
                                       _strings(entry.get("tools"), f"subtasks[{i}].tools")))
    return Plan("delegate", tuple(subtasks))


def fallback_plan(message: str) -> Plan:
    """The plan used when the model's plan does not parse: the request as one subtask."""
    return Plan("delegate", (PlannedSubtask(message),), source="fallback")


def explicit_plan(specs: Sequence[SubtaskSpec] | None, text: str) -> Plan:
    """The plan of a message that needs no planning turn: its explicit subtask list
    (checked at the door; the message's ``text`` goes to each as ``params["context"]``),
    or, without one, ``text`` as the one subtask ``s1``."""
    if specs is None:
        return Plan("delegate", (PlannedSubtask(text, id="s1"),), source="explicit")
    subtasks = []
    for spec in specs:
        params = dict(spec.params)
        if text:
            params.setdefault("context", text)
        subtasks.append(PlannedSubtask(spec.instructions, id=spec.id, params=params))
    return Plan("delegate", tuple(subtasks), source="explicit")
