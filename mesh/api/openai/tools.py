"""OpenAI function tools on the pool: the tools' prompt, parsing, and the reply's calls.

A chat request with ``tools`` gets three things. The tools are described in text put before
the first user message's content (never in the system part: the prefix is immutable and
shared). The turn is sampled under a GBNF grammar of their calls
(:mod:`mesh.api.openai.grammar`): only well-formed calls of the listed tools, each
``<tool_call>{"name":"NAME","arguments":{...}}</tool_call>`` — or, with ``tool_choice``
``auto``, plain prose that does not start with ``<``. And the reply is parsed back into
OpenAI ``tool_calls`` with ``finish_reason: "tool_calls"``; a call repeated word for word
in one reply is kept once unless the request asks for repeats (a small model under
``parallel_tool_calls`` tends to write the one right call twice).

``tools`` pass :func:`~mesh.api.openai.limits.check_tools_shape` before anything else reads
them (a 400 naming the limit).

An assistant message with ``tool_calls`` in a later request is rendered with the same
markup, so the conversation reads to the model as it wrote it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mesh.api.openai.limits import ToolsError, check_tools_shape

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "ToolChoice",
    "ToolSpec",
    "ToolsError",
    "parse_tool_choice",
    "parse_tools",
    "render_calls",
    "split_calls",
    "tools_prompt",
]

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: Mapping[str, Any]


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["none", "auto", "required"]
    name: str | None = None  # a forced function


def parse_tools(tools: Sequence[Any]) -> tuple[ToolSpec, ...]:
    """The request's ``tools`` as specs; :class:`ToolsError` names the bad entry or the
    limit crossed (:func:`~mesh.api.openai.limits.check_tools_shape`, checked first)."""
    if not tools:
        return ()
    check_tools_shape(list(tools))
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ToolsError(f"{where}: only {{'type': 'function', 'function': {{...}}}} "
                             "tools are supported", where)
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ToolsError(f"{where}.function must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolsError(f"{where}.function.name must be 1-64 characters of a-z, A-Z, "
                             "0-9, _ and -", f"{where}.function.name")
        if any(s.name == name for s in specs):
            raise ToolsError(f"{where}: the tool name {name!r} is listed twice",
                             f"{where}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping) or params.get("type", "object") != "object":
            raise ToolsError(f"{where}.function.parameters must be a JSON schema of type "
                             "'object'", f"{where}.function.parameters")
        desc = fn.get("description") or ""
        specs.append(ToolSpec(name, str(desc), params))
    return tuple(specs)


def parse_tool_choice(choice: Any, specs: Sequence[ToolSpec]) -> ToolChoice:
    """``tool_choice`` as OpenAI defines it (default ``auto`` with tools, else ``none``)."""
    if choice is None:
        return ToolChoice("auto" if specs else "none")
    if choice in ("none", "auto", "required"):
        if choice != "none" and not specs:
            raise ToolsError(f"tool_choice {choice!r} needs tools", "tool_choice")
        return ToolChoice(choice)
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not any(s.name == name for s in specs):
            raise ToolsError(f"tool_choice names {name!r}, which is not in tools",
                             "tool_choice")
        return ToolChoice("required", str(name))
    raise ToolsError("tool_choice must be 'none', 'auto', 'required' or "
                     "{'type': 'function', 'function': {'name': ...}}", "tool_choice")


def tools_prompt(specs: Sequence[ToolSpec], choice: ToolChoice) -> str:
    """The text that tells the model the tools and the call format."""
    lines = ["You can call these functions:"]
    for s in specs:
        sig = json.dumps(dict(s.parameters), separators=(",", ":"))
        lines.append(f"- {s.name}: {s.description or '(no description)'} Parameters: {sig}")
    lines.append(f'To call one, write {CALL_OPEN}{{"name":"NAME","arguments":{{...}}}}'
                 f"{CALL_CLOSE} and nothing after it; the result comes back as a message.")
    if choice.mode == "auto":
        lines.append("Otherwise answer in plain text.")
    elif choice.name:
        lines.append(f"Call {choice.name} now.")
    return "\n".join(lines)


# --------------------------------------------------------------------------- parse, render


def split_calls(text: str, specs: Sequence[ToolSpec], *, repeats: bool = False
                ) -> tuple[str | None, list[dict[str, Any]]]:
    """The reply's prose and its tool calls as OpenAI ``tool_calls`` entries. A block that
    is not a complete call of a listed tool with an object of arguments stays prose. A call
    equal to an earlier one (same name, same arguments) is dropped unless ``repeats``."""
    names = {s.name for s in specs}
    calls: list[dict[str, Any]] = []
    seen: set[tuple[str, str]] = set()
    pos, prose = 0, []
    while (start := text.find(CALL_OPEN, pos)) >= 0:
        end = text.find(CALL_CLOSE, start)
        if end < 0:
            break
        body = text[start + len(CALL_OPEN):end]
        try:
            doc = json.loads(body)
        except ValueError:
            break
        if (not isinstance(doc, dict) or doc.get("name") not in names
                or not isinstance(doc.get("arguments"), dict)):
            break
        prose.append(text[pos:start])
        pos = end + len(CALL_CLOSE)
        args = json.dumps(doc["arguments"], separators=(",", ":"))
        if not repeats and (doc["name"], args) in seen:
            continue
        seen.add((doc["name"], args))
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": doc["name"], "arguments": args}})
    prose.append(text[pos:])
    content = "".join(prose).strip()
    return (content or None), calls


def render_calls(tool_calls: Sequence[Any]) -> str:
    """An assistant message's ``tool_calls`` in the markup the grammar writes."""
    out = []
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping):
            raise ToolsError("an assistant tool call needs a 'function' object", "messages")
        raw = fn.get("arguments") or "{}"
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            raise ToolsError(f"tool call arguments are not JSON: {str(raw)[:60]!r}",
                             "messages") from None
        doc = json.dumps({"name": fn.get("name"), "arguments": args}, separators=(",", ":"))
        out.append(f"{CALL_OPEN}{doc}{CALL_CLOSE}")
    return "\n".join(out)
