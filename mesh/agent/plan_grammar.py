"""A plan's JSON schema → a llama.cpp GBNF grammar, and the longest text it admits. Pure.

The subset :func:`mesh.agent.plans.plan_schema` writes: every property required and
in order; strings bounded and without escapes (``pattern`` only as the letter-first rule;
``x-startsWith``: a fixed JSON-escaped opening the model continues); arrays bounded, or a
fixed tuple (``prefixItems``); ``const``, ``enum`` and ``oneOf``. No free whitespace, so
every text the grammar admits is a plan of at most :func:`max_plan_chars` characters.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["LETTER_FIRST", "STARTS_WITH", "max_plan_chars", "schema_to_gbnf"]

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
