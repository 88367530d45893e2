"""GBNF grammars for worker turns: free text, then one well-formed tool call or an answer.

:func:`turn_grammar` builds, for a template's call syntax and its enabled tools, a grammar
(llama.cpp's GBNF, root rule ``root``) whose sentences are exactly

* ``FREE OPEN CALL CLOSE``: reasoning, then one call of an enabled tool, with only that
  tool's argument keys, each at most once (in any order), each value a literal of the
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

_INT_DIGITS = 6  # sign included: -9999 .. 99999
_STR_CAPS = (48, 32, 16, 8, 4)
_MIN_FREE = 16  # reasoning room the string caps leave
_MAX_FREE = 160
_TEXT_CHAR = r"[\n -;=-~]"  # printable ASCII and newline, no "<"
_STR_CHAR = r"[ !#-\[\]-~]"  # printable ASCII, no quote, no backslash


def _lit(text: str) -> str:
    return json.dumps(text)  # a GBNF literal uses JSON's escapes for quote and backslash


def _rule_name(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower())


def _value_len(kind: ArgType, max_str: int) -> int:
    if kind == "int":
        return _INT_DIGITS + 1
    if kind == "bool":
        return 5
    return max_str + 2


def _call_len(name: str, syntax: ToolCallSyntax, max_str: int) -> int:
    """The longest call this grammar admits for a tool (all arguments, tags included)."""
    args = TOOL_ARGS.get(name, ())
    pieces = [len(key) + 4 + _value_len(kind, max_str) for key, kind in args]
    body = len(name) + sum(pieces) + 2 * max(len(pieces) - 1, 0)
    body += 32 if syntax.style == "json" else 2
    return body + len(syntax.open) + len(syntax.close)


def turn_grammar(syntax: ToolCallSyntax, tools: Iterable[str], max_tokens: int) -> str:
    """The GBNF grammar of one turn of at most ``max_tokens`` tokens (see the module doc).

    String values get up to 48 characters, fewer when the budget is small; a tool whose
    longest call still does not fit is left out of this turn's grammar, and a budget too
    small for any call leaves only the answer.
    """
    names = sorted(set(tools))
    style = syntax.style
    room = max_tokens - _MIN_FREE
    max_str = next(
        (n for n in _STR_CAPS if all(_call_len(t, syntax, n) <= room for t in names)),
        _STR_CAPS[-1],
    )
    names = [t for t in names if _call_len(t, syntax, max_str) <= room]
    longest = max((_call_len(t, syntax, max_str) for t in names), default=0)
    tags = len(syntax.answer_open) + len(syntax.answer_close)
    max_free = max(0, min(_MAX_FREE, max_tokens - max(longest, tags + _MIN_FREE)))
    max_answer = max(1, max_tokens - max_free - tags)
    rules = {
        "root": "free (call | answer)" if names else "free answer",
        "free": f"{_TEXT_CHAR}{{0,{max_free}}}",
        "answer": f"{_lit(syntax.answer_open)} {_TEXT_CHAR}{{1,{max_answer}}} "
        f"{_lit(syntax.answer_close)}",
        "str": f'"\\"" {_STR_CHAR}{{0,{max_str}}} "\\""',
        "int": f'"0" | "-"? [1-9] [0-9]{{0,{_INT_DIGITS - 2}}}',
        "bool": '"true" | "false"' if style == "json" else '"True" | "False"',
    }
    if names:
        alts = " | ".join("t-" + _rule_name(n) for n in names)
        rules["call"] = f"{_lit(syntax.open)} ({alts}) {_lit(syntax.close)}"
    else:
        del rules["str"], rules["int"], rules["bool"]
    for name in names:
        rules.update(_tool_rules(name, TOOL_ARGS.get(name, ()), style))
    return "\n".join(f"{k} ::= {v}" for k, v in rules.items()) + "\n"


def _tool_rules(name: str, args: tuple[tuple[str, ArgType], ...], style: str) -> dict[str, str]:
    """``t-NAME`` and one ``a-NAME-MASK`` rule per set of keys already written (MASK, a
    bit set): any key not yet written, then optionally more. Keys appear at most once, in
    any order (the templates' examples use several orders)."""
    base = _rule_name(name)
    out: dict[str, str] = {}
    full = (1 << len(args)) - 1
    pairs = [
        f"{_lit(json.dumps(key) + ': ')} {kind}" if style == "json" else f"{_lit(key + '=')} {kind}"
        for key, kind in args
    ]
    for mask in range(full):
        alts = []
        for i, pair in enumerate(pairs):
            if mask & (1 << i):
                continue
            nxt = mask | (1 << i)
            alts.append(pair if nxt == full else f'{pair} ("," " " a-{base}-{nxt})?')
        out[f"a-{base}-{mask}"] = " | ".join(f"({a})" for a in alts)
    inner = f"a-{base}-0?" if args else ""
    if style == "json":
        # Either key order: the templates document both.
        named = _lit('"name": ' + json.dumps(name))
        arguments = f'{_lit(chr(34) + "arguments" + chr(34) + ": {")} {inner} "}}"'
        out[f"t-{base}"] = (
            f'"{{" ({named} ", " {arguments} | {arguments} ", " {named}) "}}"'.replace("  ", " ")
        )
    else:
        out[f"t-{base}"] = f'{_lit(name + "(")} {inner} ")"'.replace("  ", " ")
    return out
