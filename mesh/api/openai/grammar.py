"""The GBNF grammar of a chat reply under ``tools`` (llama.cpp's grammar sampler).

The grammar admits only well-formed calls of the listed tools, each ``<tool_call>{"name":
"NAME","arguments":{...}}</tool_call>`` with the tool's arguments typed by its JSON schema,
or, with ``tool_choice`` ``auto``, plain prose that does not start with ``<``.

Strings and arrays are bounded by the request's ``max_tokens`` (:class:`Bounds`), so that a
call closes before the reply runs out of tokens even on a noisy model: a string holds at
most ``max_tokens`` characters (a token is one character at least) and an array at most
``max_tokens // 2`` items (an item and its comma take two tokens or one). Past
:data:`STRING_BOUNDED_MAX` characters or :data:`ARRAY_BOUNDED_MAX` items the repetition is
left open (``*``): llama.cpp expands ``x{0,n}`` into ``n`` rules, and ``max_tokens`` ends
the reply anyway.

Cost: the schema's shape is bounded first (:mod:`mesh.api.openai.limits`); each schema node
is then compiled once (rules are memoized by their path name), so building is linear in the
schema plus the optional-members expansion. The API calls :func:`cached_grammar` off the
event loop; equal requests (same tools, choice and bounds) share one build.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mesh.api.openai.tools import CALL_CLOSE, CALL_OPEN, ToolChoice, ToolSpec

__all__ = ["ARRAY_BOUNDED_MAX", "MAX_PARALLEL", "STRING_BOUNDED_MAX", "Bounds",
           "cached_grammar", "tools_grammar"]

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
    schemas must have passed :func:`~mesh.api.openai.limits.check_tools_shape`."""
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
