"""The OpenAI-compatible API's request shapes and tools: the limits on ``tools``, the
request models, the tools' prompt and reply parsing, and the grammar a
tool call is sampled under (docs/openai-api.md has the limits' table and the bounds).
Read top to bottom:

**Limits.** :func:`check_tools_shape` walks the raw ``tools`` once, bounded by
:data:`MAX_SCHEMA_NODES` whatever the body holds, before anything else reads them, and
refuses a schema past any limit with a :class:`ToolsError` naming the limit and where
(400 ``invalid_tools``). Within them the grammar is linear in the schema and llama.cpp's
parser accepts it (it refuses a repeated group of over 2,000 elements).

**Schema.** Models ignore fields mesh does not use and reject the ones it cannot honour
(``n > 1``, ``logprobs``). Errors follow OpenAI's shape.

**Tools.** The tools are described before the first user message's content (the prefix
is immutable and shared); the reply is parsed back into ``tool_calls`` (a call repeated
word for word kept once unless the request asks for repeats), and an assistant message's
``tool_calls`` are rendered back in the same markup.

**Grammar.** GBNF admitting only well-formed calls of the listed tools, arguments typed by
their schema, or with ``tool_choice`` ``auto`` plain prose not starting with ``<``.
Strings and arrays are bounded by ``max_tokens`` (:class:`Bounds`) so a call closes before
the reply runs out of tokens. Each schema node is compiled once (memoized by path name),
and equal requests share one build (:func:`cached_grammar`, called off the event loop).
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ARRAY_BOUNDED_MAX", "CALL_CLOSE", "CALL_OPEN", "MAX_ENUM", "MAX_KEY_CHARS", "MAX_PARALLEL",
    "MAX_PROPERTIES", "MAX_SCHEMA_DEPTH", "MAX_SCHEMA_NODES", "MAX_TOOLS", "MAX_TYPE_LIST",
    "STRING_BOUNDED_MAX", "Bounds", "ChatRequest", "CompletionRequest", "SamplingFields",
    "ToolChoice", "ToolSpec", "ToolsError", "cached_grammar", "check_tools_shape",
    "parse_tool_choice", "parse_tools", "render_calls", "split_calls", "tools_grammar",
    "tools_prompt",
]


# -------------------- limits --------------------------------------------------

MAX_TOOLS = 64  # functions in one request
MAX_SCHEMA_NODES = 8192  # JSON values and object keys in all of ``tools`` together
MAX_SCHEMA_DEPTH = 32  # JSON nesting of ``tools`` (the list is level 1)
MAX_PROPERTIES = 64  # properties of one object schema
MAX_TYPE_LIST = 8  # entries of one ``type`` list (JSON Schema has seven types)
MAX_ENUM = 512  # values of one ``enum``
MAX_KEY_CHARS = 256  # characters of one property name


class ToolsError(ValueError):
    """A request's ``tools`` or ``tool_choice`` is malformed or too large (a 400 naming
    ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _over(limit: str, value: int, cap: int, where: str, fix: str) -> ToolsError:
    return ToolsError(f"{where}: {limit} ({value}) is over mesh's limit of {cap}; {fix}",
                      where)


def check_tools_shape(tools: Any) -> None:
    """Refuse ``tools`` past any limit above; O(min(size, MAX_SCHEMA_NODES)) work."""
    if not isinstance(tools, list):
        return  # the request model already refuses a non-list
    if len(tools) > MAX_TOOLS:
        raise _over("the number of tools", len(tools), MAX_TOOLS, "tools",
                    "send fewer tools")
    nodes = 0
    stack: list[tuple[Any, str, int]] = [(tools, "tools", 1)]
    while stack:
        value, where, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise _over("the number of schema nodes (JSON values and keys)", nodes,
                        MAX_SCHEMA_NODES, "tools", "send fewer or smaller tool schemas")
        if depth > MAX_SCHEMA_DEPTH:
            raise _over("the schema nesting depth", depth, MAX_SCHEMA_DEPTH, where,
                        "flatten the tool's parameters")
        if isinstance(value, Mapping):
            _check_schema(value, where)
            nodes += len(value)  # the keys
            for key, child in value.items():
                stack.append((child, f"{where}.{str(key)[:40]}", depth + 1))
        elif isinstance(value, list):
            for i, child in enumerate(value):
                stack.append((child, f"{where}[{i}]", depth + 1))


def _check_schema(node: Mapping[str, Any], where: str) -> None:
    """Checks of one mapping read as a schema."""
    kind = node.get("type")
    if isinstance(kind, list) and len(kind) > MAX_TYPE_LIST:
        raise _over("the number of entries in a 'type' list", len(kind), MAX_TYPE_LIST,
                    f"{where}.type", "list each JSON type once")
    enum = node.get("enum")
    if isinstance(enum, list) and len(enum) > MAX_ENUM:
        raise _over("the number of enum values", len(enum), MAX_ENUM, f"{where}.enum",
                    "send fewer values (or a plain string)")
    props = node.get("properties")
    if not isinstance(props, Mapping):
        return
    if len(props) > MAX_PROPERTIES:
        raise _over("the number of properties of one object", len(props), MAX_PROPERTIES,
                    f"{where}.properties", "split the tool or nest its parameters")
    long = next((k for k in props if len(str(k)) > MAX_KEY_CHARS), None)
    if long is not None:
        raise _over("the length of a property name", len(str(long)), MAX_KEY_CHARS,
                    f"{where}.properties", "use shorter names")

# -------------------- schema --------------------------------------------------

class SamplingFields(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str = ""
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=1)  # one choice per request
    logprobs: bool | int | None = None

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined; other parts refused upstream)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")

    def has_non_text(self) -> bool:
        return isinstance(self.content, list) and any(p.get("type") != "text"
                                                      for p in self.content)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    # mesh's own: keep a call repeated word for word in one reply (dropped by default).
    repeat_tool_calls: bool = False


class CompletionRequest(SamplingFields):
    prompt: str
    echo: bool = False
    suffix: str | None = None


# -------------------- tools ---------------------------------------------------

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
    limit crossed (:func:`~mesh.api.openai_tools.check_tools_shape`, checked first)."""
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

# -------------------- grammar -------------------------------------------------

MAX_PARALLEL = 8  # calls in one reply when parallel_tool_calls is on
STRING_BOUNDED_MAX = 2000  # characters (llama.cpp refuses more); past it ``char*``
ARRAY_BOUNDED_MAX = 64  # items; past it an array (or generic object) is open
_DEPTH = 3  # nesting of arguments the grammar types; deeper is a bounded generic value
_CACHE_SIZE = 64


@dataclass(frozen=True)
class Bounds:
    """How long a string and an array of arguments may be (from the turn's max_tokens)."""

    string: int | None  # characters; None: open
    array: int | None  # items; None: open

    @classmethod
    def of(cls, max_tokens: int) -> Bounds:
        chars, items = max(1, max_tokens), max(1, max_tokens // 2)
        return cls(chars if chars <= STRING_BOUNDED_MAX else None,
                   items if items <= ARRAY_BOUNDED_MAX else None)

    def more(self) -> str:
        """The repetition of items after the first: ``{0,n-1}`` or ``*``."""
        return "*" if self.array is None else f"{{0,{self.array - 1}}}"


_BUILTIN = {"string": "str", "integer": "int", "number": "num", "boolean": "bool"}


def _lit(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


class _Rules:
    def __init__(self, bounds: Bounds) -> None:
        chars = "*" if bounds.string is None else f"{{0,{bounds.string}}}"
        more = bounds.more()
        self.bounds = bounds
        self.rules: dict[str, str] = {
            "ws": '" "?',
            "char": r'[^"\\\x00-\x1f] | "\\" ["\\/bfnrt]',
            "str": f'"\\"" char{chars} "\\""',
            "int": '"-"? ([0-9] | [1-9] [0-9]{1,15})',
            "num": 'int ("." [0-9]{1,15})? ([eE] [-+]? [0-9]{1,3})?',
            "bool": '"true" | "false"',
        }
        self._memo: dict[str, str] = {}  # path name -> the rule (or builtin) it compiled to
        for d in range(_DEPTH + 1):  # generic JSON values, bounded in depth and size
            inner = f"val{d + 1}" if d < _DEPTH else "scalar"
            self.rules[f"val{d}"] = f"scalar | obj{d} | arr{d}" if d < _DEPTH else "scalar"
            if d < _DEPTH:
                self.rules[f"obj{d}"] = (f'"{{" ws (str ":" ws {inner} ("," ws str ":" ws '
                                         f'{inner}){more})? "}}"')
                self.rules[f"arr{d}"] = f'"[" ({inner} ("," ws {inner}){more})? "]"'
        self.rules["scalar"] = 'str | num | bool | "null"'

    def add(self, name: str, body: str) -> str:
        self.rules.setdefault(name, body)
        return name

    def value(self, schema: Any, name: str, depth: int) -> str:
        """A rule for values of ``schema`` (the JSON-schema subset tools use), compiled
        once per path ``name``: an optional property is referenced by many alternatives."""
        got = self._memo.get(name)
        if got is None:
            got = self._memo[name] = self._value(schema, name, depth)
        return got

    def _value(self, schema: Any, name: str, depth: int) -> str:
        if not isinstance(schema, Mapping) or depth >= _DEPTH:
            return f"val{min(depth, _DEPTH)}"
        if "enum" in schema and isinstance(schema["enum"], list) and schema["enum"]:
            values = dict.fromkeys(_lit(json.dumps(v)) for v in schema["enum"])
            return self.add(name, " | ".join(values))
        if "const" in schema:
            return self.add(name, _lit(json.dumps(schema["const"])))
        kind = schema.get("type")
        if isinstance(kind, list):  # e.g. ["string", "null"]; each type once
            kinds = dict.fromkeys(k for k in kind if isinstance(k, str))
            alts = [self.value({**schema, "type": k}, f"{name}-t{j}", depth)
                    for j, k in enumerate(kinds)]
            return self.add(name, " | ".join(dict.fromkeys(alts))) if alts else f"val{depth}"
        if kind in _BUILTIN:
            return _BUILTIN[kind]
        if kind == "null":
            return self.add("nul", '"null"')
        if kind == "array":
            item = self.value(schema.get("items"), f"{name}-item", depth + 1)
            return self.add(name, f'"[" ({item} ("," ws {item}){self.bounds.more()})? "]"')
        if kind == "object" and isinstance(schema.get("properties"), Mapping):
            return self.obj(schema, name, depth)
        return f"val{depth}"

    def obj(self, schema: Mapping[str, Any], name: str, depth: int) -> str:
        """Required properties in the schema's order, then any in-order subset of the
        optional ones (commas placed so the JSON stays valid). Linear in the properties:
        optional ones chain through one rule each (``name-oI ::= (",k_I" v)? name-oI+1``),
        and no repeated group holds more than one member (llama.cpp refuses a ``?`` or
        ``{m,n}`` over more than 2,000 grammar elements)."""
        props: Mapping[str, Any] = schema.get("properties") or {}
        required = [k for k in dict.fromkeys(schema.get("required") or [])
                    if isinstance(k, str) and k in props]
        optional = [k for k in props if k not in required]
        # Rule names carry the property's position: slugs of two keys may be equal.
        rules = {k: self.value(props[k], f"{name}-{i}-{_slug(k)}", depth + 1)
                 for i, k in enumerate(props)}

        def member(key: str, comma: bool) -> str:
            return f"{_lit((',' if comma else '') + json.dumps(key) + ':')} ws {rules[key]}"

        # tails[i]: any in-order subset of optional[i:], each after a comma.
        tails = [""] * (len(optional) + 1)
        first = 0 if required else 1  # with none required, each optional opens an alternative
        for i in range(len(optional) - 1, first - 1, -1):
            tails[i] = self.add(f"{name}-o{i}",
                                f"({member(optional[i], True)})? {tails[i + 1]}".strip())

        if required:
            body = " ".join(member(k, i > 0) for i, k in enumerate(required))
            body = f"{body} {tails[0]}".strip()
        elif optional:  # (k1 tails[1] | k2 tails[2] | ... | kn)?
            alts = " | ".join(f"{member(k, False)} {tails[i + 1]}".strip()
                              for i, k in enumerate(optional))
            body = f"({self.add(f'{name}-any', alts)})?"
        else:
            body = ""
        return self.add(name, f'"{{" {body} "}}"' if body else '"{}"')


def _slug(key: str) -> str:
    """A key's letters and digits only: ``-`` separates the segments of a rule name
    (``args0-1-path-item``, ``args0-o2``), so two paths never share a name."""
    return re.sub(r"[^A-Za-z0-9]", "", str(key))[:24] or "k"


def tools_grammar(specs: Sequence[ToolSpec], choice: ToolChoice, *, parallel: bool = True,
                  max_tokens: int = 128) -> str | None:
    """GBNF for a reply under ``choice`` (``None`` for ``none``: no constraint). The
    schemas must have passed :func:`~mesh.api.openai_tools.check_tools_shape`."""
    if choice.mode == "none" or not specs:
        return None
    g = _Rules(Bounds.of(max_tokens))
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


_cache: OrderedDict[tuple[str, ToolChoice, bool, Bounds], str | None] = OrderedDict()
_lock = threading.Lock()


def cached_grammar(tools_key: str, specs: Sequence[ToolSpec], choice: ToolChoice, *,
                   parallel: bool, max_tokens: int) -> str | None:
    """:func:`tools_grammar`, remembered for the last few distinct requests.

    ``tools_key`` is the canonical JSON of the request's ``tools`` (an agent sends the same
    tools every turn). Runs in a worker thread; two threads may build the same key once
    each, harmlessly."""
    key = (tools_key, choice, parallel, Bounds.of(max_tokens))
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    grammar = tools_grammar(specs, choice, parallel=parallel, max_tokens=max_tokens)
    with _lock:
        _cache[key] = grammar
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return grammar
