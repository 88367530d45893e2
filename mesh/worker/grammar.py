"""GBNF grammars for worker turns: free text, then one well-formed tool call or an answer.

:func:`turn_grammar` builds, for a template's call syntax and its enabled tools, a grammar
(llama.cpp's GBNF, root rule ``root``) whose sentences are exactly

* ``FREE OPEN CALL CLOSE``: reasoning, then one call of an enabled tool, with only that
  tool's argument keys, each at most once and in a fixed order, each value a literal of the
  key's type (string, integer or boolean); or
* ``FREE ANSWER_OPEN TEXT ANSWER_CLOSE``: reasoning, then the final answer.

Nothing else can be sampled, so every turn :func:`~mesh.worker.toolcalls.parse_turn` reads
has no errors. All characters are printable ASCII (plus newlines in free text and answers),
and free text and answers contain no ``<``: a tag can only be a real tag.

Lengths are capped so that a whole sentence fits ``max_tokens``: with ASCII only, each
token the grammar admits carries at least one character, so a sentence of at most
``max_tokens`` characters cannot be cut by ``length`` half-way through a call.

Argument keys and types (:data:`TOOL_ARGS`) mirror what :mod:`mesh.worker.tools` accepts.
A tool this module does not know gets no arguments in the grammar.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from mesh.template.manifest import ToolCallSyntax

__all__ = ["TOOL_ARGS", "turn_grammar"]

ArgType = str  # "str" | "int" | "bool"

TOOL_ARGS: Mapping[str, tuple[tuple[str, ArgType], ...]] = {
    "list_files": (("path", "str"), ("depth", "int")),
    "read_file": (("path", "str"), ("start", "int"), ("lines", "int")),
    "grep": (("text", "str"), ("path", "str"), ("ignore_case", "bool"), ("max_matches", "int")),
    "delegate": (("peer", "str"), ("text", "str")),
}

_INT_DIGITS = 5
_TEXT_CHAR = r"[\n -;=-~]"  # printable ASCII and newline, no "<"
_STR_CHAR = r"[ !#-\[\]-~]"  # printable ASCII, no quote, no backslash


def _lit(text: str) -> str:
    return json.dumps(text)  # a GBNF literal uses JSON's escapes for quote and backslash


def _rule_name(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower())


def _value_len(kind: ArgType, max_str: int, style: str) -> int:
    if kind == "int":
        return _INT_DIGITS + 1
    if kind == "bool":
        return 5
    return max_str + 2


def _call_len(name: str, args: Iterable[tuple[str, ArgType]], max_str: int, style: str) -> int:
    """The longest call body this grammar admits for a tool (all arguments present)."""
    pieces = [len(key) + 4 + _value_len(kind, max_str, style) for key, kind in args]
    sep = 2 * max(len(pieces) - 1, 0)
    if style == "json":
        return len(name) + 32 + sum(pieces) + sep
    return len(name) + 2 + sum(pieces) + sep


def turn_grammar(syntax: ToolCallSyntax, tools: Iterable[str], max_tokens: int) -> str:
    """The GBNF grammar of one turn of at most ``max_tokens`` tokens (see the module doc)."""
    names = sorted(set(tools))
    if not names:
        raise ValueError("a turn grammar needs at least one enabled tool")
    style = syntax.style
    tags = len(syntax.open) + len(syntax.close)
    # String values get up to 48 characters, less when the turn budget is small.
    max_str = 48
    longest = 0
    while True:
        longest = max(_call_len(n, TOOL_ARGS.get(n, ()), max_str, style) for n in names) + tags
        if longest <= max_tokens * 2 // 3 or max_str <= 4:
            break
        max_str //= 2
    max_free = max(0, min(160, max_tokens - longest))
    answer_room = max_tokens - max_free - len(syntax.answer_open) - len(syntax.answer_close)
    max_answer = max(1, answer_room)
    rules = {
        "root": "free (call | answer)",
        "free": f"{_TEXT_CHAR}{{0,{max_free}}}",
        "answer": f"{_lit(syntax.answer_open)} {_TEXT_CHAR}{{1,{max_answer}}} "
        f"{_lit(syntax.answer_close)}",
        "call": f"{_lit(syntax.open)} ({' | '.join('t-' + _rule_name(n) for n in names)}) "
        f"{_lit(syntax.close)}",
        "str": f'"\\"" {_STR_CHAR}{{0,{max_str}}} "\\""',
        "int": f'"-"? [0-9]{{1,{_INT_DIGITS}}}',
        "bool": '"true" | "false"' if style == "json" else '"True" | "False"',
    }
    for name in names:
        rules.update(_tool_rules(name, TOOL_ARGS.get(name, ()), style))
    return "\n".join(f"{k} ::= {v}" for k, v in rules.items()) + "\n"


def _tool_rules(name: str, args: tuple[tuple[str, ArgType], ...], style: str) -> dict[str, str]:
    """``t-NAME`` and, per argument position i, ``a-NAME-i``: argument i then, optionally,
    any later one (so keys appear at most once, in order)."""
    base = _rule_name(name)
    out: dict[str, str] = {}
    for i, (key, kind) in enumerate(args):
        if style == "json":
            pair = f"{_lit(json.dumps(key) + ': ')} {kind}"
        else:
            pair = f"{_lit(key + '=')} {kind}"
        later = [f"a-{base}-{j}" for j in range(i + 1, len(args))]
        tail = f' ("," " " ({" | ".join(later)}))?' if later else ""
        out[f"a-{base}-{i}"] = pair + tail
    starts = " | ".join(f"a-{base}-{i}" for i in range(len(args)))
    inner = f"({starts})?" if args else ""
    if style == "json":
        head = _lit('{"name": ' + json.dumps(name) + ', "arguments": {')
        out[f"t-{base}"] = f'{head} {inner} "}}}}"'.replace("  ", " ")
    else:
        out[f"t-{base}"] = f'{_lit(name + "(")} {inner} ")"'.replace("  ", " ")
    return out
