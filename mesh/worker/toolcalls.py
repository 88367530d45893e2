"""Parsing a generated turn into tool calls and a final answer, in a template's syntax.

Models, small ones most of all, write garbage: unterminated tags, invalid JSON, calls with
positional arguments, nested junk. :func:`parse_turn` never raises; what it cannot read
becomes an entry of :attr:`ParsedTurn.errors`, which the worker reports back to the model
as a tool error so it can try again.

Syntaxes (see :class:`~mesh.template.manifest.ToolCallSyntax`):

* ``json``: ``<open>{"name": "grep", "arguments": {"text": "x"}}<close>``;
* ``call``: ``<open>grep(text="x")<close>``: keyword arguments with literal values only,
  read with :func:`ast.literal_eval` (never evaluated).

A call whose close tag is missing at the very end of the text is accepted (generation may
have stopped on the close tag without emitting it).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mesh.template.manifest import ToolCallSyntax

__all__ = ["MAX_CALL_CHARS", "ParsedTurn", "ToolCall", "parse_turn"]

MAX_CALL_CHARS = 8192  # a call body longer than this is refused unparsed


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)

    def display(self) -> str:
        """The call as a short Python-like string, e.g. ``read_file(path='x')``."""
        args = ", ".join(f"{k}={v!r}" for k, v in self.arguments.items())
        text = f"{self.name}({args})"
        return text if len(text) <= 300 else text[:297] + "..."


@dataclass(frozen=True)
class ParsedTurn:
    """What a turn asked for. ``answer`` is None unless the answer tags were used."""

    calls: tuple[ToolCall, ...]
    answer: str | None
    errors: tuple[str, ...]


def _blocks(text: str, open_tag: str, close_tag: str) -> list[str]:
    out: list[str] = []
    pos = 0
    while (start := text.find(open_tag, pos)) != -1:
        body_start = start + len(open_tag)
        end = text.find(close_tag, body_start)
        if end == -1:
            out.append(text[body_start:])  # unterminated: the rest of the turn
            break
        out.append(text[body_start:end])
        pos = end + len(close_tag)
    return out


def _parse_json(body: str) -> ToolCall:
    data = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError("a tool call must be a JSON object")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError('a tool call needs a "name" string')
    args = data.get("arguments", data.get("args", {}))
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ValueError('"arguments" must be a JSON object')
    unknown = set(data) - {"name", "arguments", "args"}
    if unknown:
        raise ValueError(f"unexpected keys in the call: {sorted(unknown)}")
    return ToolCall(name, args)


def _parse_call(body: str) -> ToolCall:
    node = ast.parse(body.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError("expected name(key=value, ...)")
    if node.args:
        raise ValueError("pass arguments by name, e.g. read_file(path='x')")
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise ValueError("**kwargs are not allowed in a tool call")
        args[kw.arg] = ast.literal_eval(kw.value)
    return ToolCall(node.func.id, args)


def parse_turn(text: str, syntax: ToolCallSyntax) -> ParsedTurn:
    """Read the tool calls and the final answer of one generated turn. Never raises."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for body in _blocks(text, syntax.open, syntax.close):
        if len(body) > MAX_CALL_CHARS:
            errors.append(f"tool call longer than {MAX_CALL_CHARS} characters")
            continue
        try:
            parse = _parse_json if syntax.style == "json" else _parse_call
            calls.append(parse(body.strip()))
        except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError) as exc:
            errors.append(f"could not read the tool call {body.strip()[:120]!r}: {exc}")
    answers = _blocks(text, syntax.answer_open, syntax.answer_close)
    answer = answers[0].strip() if answers else None
    return ParsedTurn(tuple(calls), answer, tuple(errors))
