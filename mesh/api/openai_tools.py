"""OpenAI function tools on the pool: the tools' prompt, the call grammar, and parsing.

A chat request with ``tools`` gets three things. The tools are described in text put before
the first user message's content (never in the system part: the prefix is immutable and
shared). The turn is sampled under a GBNF grammar (llama.cpp's grammar sampler) that admits
only well-formed calls of the listed tools, each ``<tool_call>{"name":"NAME","arguments":
{...}}</tool_call>`` with the tool's required arguments typed by its JSON schema (strings
and arrays bounded, so a call cannot run past ``max_tokens`` on a noisy model) — or, with
``tool_choice`` ``auto``, plain prose that does not start with ``<``. And the reply is
parsed back into OpenAI ``tool_calls`` with ``finish_reason: "tool_calls"``.

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
    "tools_grammar",
    "tools_prompt",
]

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
MAX_TOOLS = 64
MAX_PARALLEL = 8  # calls in one reply when parallel_tool_calls is on
STRING_MAX = 200  # characters of one string argument under the grammar
ARRAY_MAX = 16
_DEPTH = 3  # nesting of arguments the grammar types; deeper is a bounded generic value
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolsError(ValueError):
    """A request's ``tools`` or ``tool_choice`` is malformed (a 400 naming ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


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
    """The request's ``tools`` as specs; :class:`ToolsError` names the bad entry."""
    if not tools:
        return ()
    if len(tools) > MAX_TOOLS:
        raise ToolsError(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
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


# --------------------------------------------------------------------------- grammar


def _lit(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


class _Rules:
    def __init__(self) -> None:
        self.rules: dict[str, str] = {
            "ws": '" "?',
            "char": r'[^"\\\x00-\x1f] | "\\" ["\\/bfnrt]',
            "str": f'"\\"" char{{0,{STRING_MAX}}} "\\""',
            "int": '"-"? ([0-9] | [1-9] [0-9]{1,15})',
            "num": 'int ("." [0-9]{1,15})? ([eE] [-+]? [0-9]{1,3})?',
            "bool": '"true" | "false"',
        }
        for d in range(_DEPTH + 1):  # generic JSON values, bounded in depth and size
            inner = f"val{d + 1}" if d < _DEPTH else "scalar"
            self.rules[f"val{d}"] = f"scalar | obj{d} | arr{d}" if d < _DEPTH else "scalar"
            if d < _DEPTH:
                self.rules[f"obj{d}"] = (f'"{{" ws (str ":" ws {inner} ("," ws str ":" ws '
                                         f'{inner}){{0,{ARRAY_MAX - 1}}})? "}}"')
                self.rules[f"arr{d}"] = (f'"[" ({inner} ("," ws {inner})'
                                         f'{{0,{ARRAY_MAX - 1}}})? "]"')
        self.rules["scalar"] = 'str | num | bool | "null"'

    def add(self, name: str, body: str) -> str:
        self.rules.setdefault(name, body)
        return name

    def value(self, schema: Any, name: str, depth: int) -> str:
        """A rule for values of ``schema`` (the JSON-schema subset tools use)."""
        if not isinstance(schema, Mapping) or depth >= _DEPTH:
            return f"val{min(depth, _DEPTH)}"
        if "enum" in schema and isinstance(schema["enum"], list) and schema["enum"]:
            return self.add(name, " | ".join(_lit(json.dumps(v)) for v in schema["enum"]))
        if "const" in schema:
            return self.add(name, _lit(json.dumps(schema["const"])))
        kind = schema.get("type")
        if isinstance(kind, list):  # e.g. ["string", "null"]
            alts = [self.value({**schema, "type": k}, f"{name}-{k}", depth) for k in kind]
            return self.add(name, " | ".join(alts))
        if kind == "string":
            return "str"
        if kind == "integer":
            return "int"
        if kind == "number":
            return "num"
        if kind == "boolean":
            return "bool"
        if kind == "null":
            return self.add("nul", '"null"')
        if kind == "array":
            item = self.value(schema.get("items"), f"{name}-item", depth + 1)
            return self.add(name, f'"[" ({item} ("," ws {item}){{0,{ARRAY_MAX - 1}}})? "]"')
        if kind == "object" and isinstance(schema.get("properties"), Mapping):
            return self.obj(schema, name, depth)
        return f"val{depth}"

    def obj(self, schema: Mapping[str, Any], name: str, depth: int) -> str:
        """Required properties in the schema's order, then any in-order subset of the
        optional ones (commas placed so the JSON stays valid)."""
        props: Mapping[str, Any] = schema.get("properties") or {}
        required = [k for k in schema.get("required", []) if k in props]
        optional = [k for k in props if k not in required]

        def member(key: str, comma: bool) -> str:
            rule = self.value(props[key], f"{name}-{_slug(key)}", depth + 1)
            return f"{_lit((',' if comma else '') + json.dumps(key) + ':')} ws {rule}"

        if required:
            body = " ".join(member(k, i > 0) for i, k in enumerate(required))
            body += "".join(f" ({member(k, True)})?" for k in optional)
        elif optional:  # (k1 (,k2)? (,k3)? | k2 (,k3)? | k3)?
            alts = []
            for i, key in enumerate(optional):
                alt = member(key, False)
                alt += "".join(f" ({member(k, True)})?" for k in optional[i + 1:])
                alts.append(f"({alt})")
            body = "(" + " | ".join(alts) + ")?"
        else:
            body = ""
        return self.add(name, f'"{{" {body} "}}"' if body else '"{}"')


def _slug(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "-", key)[:32] or "k"


def tools_grammar(specs: Sequence[ToolSpec], choice: ToolChoice, *, parallel: bool = True
                  ) -> str | None:
    """GBNF for a reply under ``choice`` (``None`` for ``none``: no constraint)."""
    if choice.mode == "none" or not specs:
        return None
    g = _Rules()
    calls = []
    for i, s in enumerate(specs):
        if choice.name and s.name != choice.name:
            continue
        args = g.obj(s.parameters, f"args{i}", 0) if isinstance(
            s.parameters.get("properties"), Mapping) else "obj0"
        head = _lit(f'{CALL_OPEN}{{"name":{json.dumps(s.name)},"arguments":')
        calls.append(g.add(f"call{i}", f'{head} {args} {_lit("}" + CALL_CLOSE)}'))
    g.add("call", " | ".join(calls))
    many = f'call ("\\n" call){{0,{MAX_PARALLEL - 1}}}' if parallel and not choice.name else "call"
    g.add("calls", many)
    if choice.mode == "auto":
        g.add("prose", r'[^<\x00-\x08\x0b-\x1f] [^\x00]*')
        root = "calls | prose"
    else:
        root = "calls"
    lines = [f"root ::= {root}"] + [f"{k} ::= {v}" for k, v in g.rules.items()]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- parse, render


def split_calls(text: str, specs: Sequence[ToolSpec]
                ) -> tuple[str | None, list[dict[str, Any]]]:
    """The reply's prose and its tool calls as OpenAI ``tool_calls`` entries. A block that
    is not a complete call of a listed tool with an object of arguments stays prose."""
    names = {s.name for s in specs}
    calls: list[dict[str, Any]] = []
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
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": doc["name"],
                                   "arguments": json.dumps(doc["arguments"],
                                                           separators=(",", ":"))}})
        pos = end + len(CALL_CLOSE)
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
