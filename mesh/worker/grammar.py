"""What a worker's turn may say and how it is read back: parsing a turn into tool calls and
an answer, then the GBNF grammars it is sampled under.

**Reading a turn.** Models, small ones most of all, write garbage: unterminated tags,
invalid JSON, positional arguments, nested junk. :func:`parse_turn` never raises; what it
cannot read becomes an entry of :attr:`ParsedTurn.errors`, which the worker reports back
to the model as a tool error. Syntaxes (:class:`~mesh.template.loader.ToolCallSyntax`):

* ``json``: ``<open>{"name": "grep", "arguments": {"text": "x"}}<close>``;
* ``call``: ``<open>grep(text="x")<close>``: keyword arguments with literal values only,
  read with :func:`ast.literal_eval` (never evaluated).

A call whose close tag is missing at the very end of the text is accepted (generation may
have stopped on the close tag without emitting it).

**Grammars.** :func:`turn_grammar` builds, for a template's call syntax and its enabled
tools, a grammar (root rule ``root``) whose sentences are exactly

* ``FREE OPEN CALL CLOSE``: reasoning, then one call of an enabled tool, with only that
  tool's argument keys, each at most once (in any order), each value a literal of the
  key's type (string, integer or boolean); or
* ``FREE ANSWER_OPEN TEXT ANSWER_CLOSE``: reasoning, then the final answer; or
* ``TEXT``: a plain reply (the turn ends at the model's end-of-turn token), read as the
  answer.

So every turn :func:`parse_turn` reads has no errors. All characters are printable ASCII
(plus newlines in free text and answers), and free text and answers contain no ``<``: a
tag can only be a real tag. Given the project's :class:`ProjectPaths`, prose writes a
``/`` only inside one of the project's paths, so a small model cannot name a file the
project does not have. Lengths are capped so that a whole sentence fits ``max_tokens``
(each token the grammar admits carries at least one character).

Argument keys and types (:data:`TOOL_ARGS`) mirror what :mod:`mesh.worker.tools` accepts:
numbers within the tools' own ranges and, given :class:`ProjectPaths`, a ``path`` that
names one of them (a file for ``read_file``, a folder for ``list_files``, either for
``grep``). Paths are written as a tree of rules (one a folder), so a grammar over
thousands of paths stays small for llama.cpp's sampler. A tool this module does not know
gets no arguments in the grammar.

:func:`sentence_grammar` is the grammar of a repair turn: the answer as one complete
sentence (see :mod:`mesh.worker.loop`).
"""

from __future__ import annotations

import ast
import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mesh.template.loader import ToolCallSyntax

__all__ = [
    "MAX_CALL_CHARS", "PATHS_MAX", "TOOL_ARGS", "ParsedTurn", "ProjectPaths", "ToolCall",
    "parse_turn", "sentence_grammar", "turn_grammar"
]


# -------------------- reading a turn ------------------------------------------

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

# -------------------- grammars ------------------------------------------------

# "str" | "bool" | a path kind ("file", "dir", "place": either) | a number kind (_NUMBERS)
ArgType = str

TOOL_ARGS: Mapping[str, tuple[tuple[str, ArgType], ...]] = {
    "list_files": (("path", "dir"), ("depth", "depth")),
    "read_file": (("path", "file"), ("start", "line"), ("lines", "count")),
    "grep": (("text", "str"), ("path", "place"), ("ignore_case", "bool"),
             ("max_matches", "matches")),
    "delegate": (("peer", "str"), ("text", "str")),
}
# number kinds: (GBNF, most characters), within what mesh.worker.tools accepts
_NUMBERS = {
    "line": ("[1-9] [0-9]{0,4}", 5),
    "count": ("[1-9] [0-9]{0,2}", 3),
    "depth": ("[1-6]", 1),
    "matches": ("[1-9] [0-9]?", 2),
}
_PATH_KINDS = ("file", "dir", "place")
PATHS_MAX = 20_000  # past this many names, paths are free strings
_PATH_OK = re.compile(r"[ !#-\[\]-~]+")  # what a grammar string may hold (_STR_CHAR)


@dataclass(frozen=True)
class ProjectPaths:
    """The project's files and folders (relative, as its scan lists them) that a call may
    name; see the module doc."""

    files: tuple[str, ...]
    dirs: tuple[str, ...] = ()

    @classmethod
    def of(cls, files: Sequence[str], dirs: Sequence[str] = ()) -> ProjectPaths | None:
        """The names a grammar can hold (printable ASCII, no quote or backslash), or None
        when there are none or more than :data:`PATHS_MAX` (free strings then)."""
        ok = [f for f in files if _PATH_OK.fullmatch(f)]
        folders = [d for d in dirs if _PATH_OK.fullmatch(d)]
        if not ok or len(ok) + len(folders) > PATHS_MAX:
            return None
        return cls(tuple(ok), tuple(folders))

    def choices(self, kind: ArgType) -> tuple[str, ...]:
        folders = (".", *self.dirs)
        return {"file": self.files, "dir": folders, "place": (*folders, *self.files)}[kind]

_STR_CAPS = (48, 32, 16, 8, 4)
_MIN_FREE = 16  # reasoning room the string caps leave
_MAX_FREE = 160
_TEXT_CHAR = r"[\n -;=-~]"  # printable ASCII and newline, no "<"
_PROSE_CHAR = r"[\n -.0-;=-~]"  # the same without "/": a "/" is inside a project path
_STR_CHAR = r"[ !#-\[\]-~]"  # printable ASCII, no quote, no backslash


def _lit(text: str) -> str:
    return json.dumps(text)  # a GBNF literal uses JSON's escapes for quote and backslash


def _rule_name(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower())


def _value_len(kind: ArgType, max_str: int, paths: ProjectPaths | None) -> int:
    if kind in _NUMBERS:
        return _NUMBERS[kind][1]
    if kind == "bool":
        return 5
    if kind in _PATH_KINDS and paths is not None:
        return max(len(p) for p in paths.choices(kind)) + 2
    return max_str + 2


def _call_len(name: str, syntax: ToolCallSyntax, max_str: int,
              paths: ProjectPaths | None = None) -> int:
    """The longest call this grammar admits for a tool (all arguments, tags included)."""
    args = TOOL_ARGS.get(name, ())
    pieces = [len(key) + 4 + _value_len(kind, max_str, paths) for key, kind in args]
    body = len(name) + sum(pieces) + 2 * max(len(pieces) - 1, 0)
    body += 32 if syntax.style == "json" else 2
    return body + len(syntax.open) + len(syntax.close)


def turn_grammar(syntax: ToolCallSyntax, tools: Iterable[str], max_tokens: int,
                 paths: ProjectPaths | None = None, *, call_only: bool = False) -> str:
    """The GBNF grammar of one turn of at most ``max_tokens`` tokens (see the module doc).

    String values get up to 48 characters, fewer when the budget is small; a tool whose
    longest call still does not fit is left out of this turn's grammar, and a budget too
    small for any call leaves only the answer. With ``paths``, a ``path`` is one of them.
    ``call_only``: the turn must call a tool (no answer), when any tool fits.
    """
    # Every turn of every worker asks again with the same few arguments, and with a
    # project's paths the text takes ~0.6 ms to build on the event loop: built once each.
    return _turn_grammar(syntax, tuple(sorted(set(tools))), max_tokens, paths, call_only)


@functools.lru_cache(maxsize=256)
def _turn_grammar(syntax: ToolCallSyntax, names_in: tuple[str, ...], max_tokens: int,
                  paths: ProjectPaths | None, call_only: bool) -> str:
    names = list(names_in)
    style = syntax.style
    room = max_tokens - _MIN_FREE
    max_str = next((n for n in _STR_CAPS
                    if all(_call_len(t, syntax, n, paths) <= room for t in names)), _STR_CAPS[-1])
    names = [t for t in names if _call_len(t, syntax, max_str, paths) <= room]
    longest = max((_call_len(t, syntax, max_str, paths) for t in names), default=0)
    tags = len(syntax.answer_open) + len(syntax.answer_close)
    max_free = max(0, min(_MAX_FREE, max_tokens - max(longest, tags + _MIN_FREE)))
    max_answer = max(1, max_tokens - max_free - tags)
    # With the project's paths, prose writes a "/" only inside one of them.
    prose = _prose_paths(paths)
    char = _PROSE_CHAR if prose else _TEXT_CHAR
    rules = {
        "root": ("free call" if call_only else "free (call | answer) | reply") if names
        else "free answer | reply",
        "free": _prose(char, 0, max_free, prose),
        "reply": f"[A-Za-z0-9] ({_prose(char, 0, max_tokens - 1, prose, path_first=False)})"
        + (" | path-prose" + f" ({_AFTER['turn']} {char}{{0,{max_tokens - 1 - _longest(prose)}}})?"
           if prose and max_tokens - 1 - _longest(prose) > 0 else ""),
        "answer": f"{_lit(syntax.answer_open)} ({_prose(char, 1, max_answer, prose)}) "
        f"{_lit(syntax.answer_close)}",
    }
    if names:
        alts = " | ".join("t-" + _rule_name(n) for n in names)
        rules["call"] = f"{_lit(syntax.open)} ({alts}) {_lit(syntax.close)}"
    kinds = {_kind(k, paths) for n in names for _, k in TOOL_ARGS.get(n, ())}
    for kind in sorted(kinds):
        rules[kind] = _value_rule(kind, style, max_str, paths)
        if kind in _PATH_KINDS and paths is not None:
            rules.update(_path_rules(f"path-{kind}", paths.choices(kind)))
    if prose:
        rules.update(_path_rules("path-prose", prose))
    for name in names:
        args = tuple((key, _kind(k, paths)) for key, k in TOOL_ARGS.get(name, ()))
        rules.update(_tool_rules(name, args, style))
    return _text(rules)


def _text(rules: Mapping[str, str]) -> str:
    return "\n".join(f"{k} ::= {v}" for k, v in rules.items()) + "\n"


_PROSE_PATH_MAX = 48  # longer paths cannot be named in prose (a length bound needs room)
_MIN_SEGMENT = 24  # prose around a path: at least this many characters each side


def _longest(prose: tuple[str, ...]) -> int:
    return max((len(p) for p in prose), default=0)


def _prose_paths(paths: ProjectPaths | None, kind: ArgType = "place") -> tuple[str, ...]:
    """The project's paths prose may name (files and folders, or ``kind``; not too long)."""
    if paths is None:
        return ()
    return tuple(p for p in paths.choices(kind) if len(p) <= _PROSE_PATH_MAX and p != ".")


# What may stand right before and right after a path in prose: never a letter, a digit,
# "_" or "/", so no made-up path can hide around a real one ("xsrc/courier/parcels.py").
_BEFORE = {"turn": r"[ \n(`'\"]", "sentence": r"[ ]"}
_AFTER = {"turn": r"[ \n.,;:!?)`'\"]", "sentence": r"[ .,;:!?]"}


def _prose(char: str, least: int, most: int, prose: tuple[str, ...],
           kind: str = "turn", *, path_first: bool = True, need_path: bool = False) -> str:
    """GBNF for ``least`` to ``most`` characters of prose naming at most one project path
    (``path-prose``, set apart by :data:`_BEFORE`/:data:`_AFTER`; first, when
    ``path_first``; always, with ``need_path``) when the length bound has room for one:
    a path's characters count, so the bound holds exactly."""
    side = (most - _longest(prose) - 2) // 2
    if not prose or side < _MIN_SEGMENT:
        return f"{char}{{{least},{most}}}"
    tail = f"({_AFTER[kind]} {char}{{0,{side}}})?"
    named = f"{_BEFORE[kind]} path-prose {tail}"
    plain = f"{char}{{{least},{side}}} " + (named if need_path else f"({named})?")
    return plain if least == 0 or not path_first else f"{plain} | path-prose {tail}"


def _path_rules(root: str, names: Iterable[str]) -> dict[str, str]:
    """Rules whose sentences are exactly ``names`` (relative paths), as a tree: rule
    ``root`` is the top folder's entries, and each folder's entries are one rule
    (``NAME "/" FOLDER-RULE``, optional after a name that is itself a path). A flat
    alternation of thousands of paths would give llama.cpp's sampler thousands of stacks."""
    tree: dict[str, Any] = {}
    for name in names:
        node = tree
        for part in name.split("/"):
            node = node.setdefault(part, {})
        node[""] = {}  # a path ends here
    rules: dict[str, str] = {}

    def emit(node: dict[str, Any], rule: str) -> None:
        alts = []
        for part in sorted(k for k in node if k):
            child = node[part]
            inner = {k: v for k, v in child.items() if k}
            if not inner:
                alts.append(_lit(part))
                continue
            sub = f"{root}-{len(rules) + 1}"
            rules[sub] = ""  # reserve the name before the children take theirs
            emit(inner, sub)
            alts.append(f"{_lit(part + '/')} {sub}" if "" not in child
                        else f"{_lit(part)} (\"/\" {sub})?")
        rules[rule] = " | ".join(alts) or '""'

    emit(tree, root)
    return rules


# A sentence's characters: printable ASCII without the ones that open or close something
# (brackets, quotes, backticks, "<" and ">") or escape it, so a sentence cannot hold markup
# or part of a call, nor leave anything open; nor ".", "!" or "?" (one sentence: it ends
# on one), nor "/", so a file name is only ever one of the project's paths ("courier.py"
# cannot be made up). Without the project's paths, "/" and "." are characters too.
_SENTENCE_CHAR = r"[ #-&'*+,0-;=@-Z^_a-z|~-]"  # "-" last: a character, not a range
_SENTENCE_CHAR_FREE = r"[ !#-&'*-;=?-Z^_a-z|~]"
_SENTENCE_MIN = 8


def sentence_grammar(syntax: ToolCallSyntax, max_tokens: int,
                     paths: ProjectPaths | None = None, *, name_path: bool = False) -> str:
    """The GBNF grammar of one complete sentence as the answer: ``ANSWER_OPEN`` a capital
    letter or a digit, at least :data:`_SENTENCE_MIN` characters with no brackets, quotes
    or markup (given ``paths``: no ``.``, ``!``, ``?`` or ``/`` but inside one of them, at
    most one), a closing ``.``, ``!`` or ``?``, ``ANSWER_CLOSE``; at most ``max_tokens`` characters
    in all, so at most ``max_tokens`` tokens. With ``name_path`` (and ``paths``) the
    sentence names one of the files."""
    tags = len(syntax.answer_open) + len(syntax.answer_close)
    most = max_tokens - tags - 2
    if most < _SENTENCE_MIN:
        raise ValueError(f"max_tokens {max_tokens} leaves no room for a sentence")
    prose = _prose_paths(paths, "file" if name_path else "place")
    char = _SENTENCE_CHAR if prose else _SENTENCE_CHAR_FREE
    body = _prose(char, _SENTENCE_MIN, most - 1, prose, "sentence", path_first=False,
                  need_path=name_path)
    rules = {
        "root": f"{_lit(syntax.answer_open)} sentence {_lit(syntax.answer_close)}",
        "sentence": f"[A-Z0-9] ({body}) [.!?]",
    }
    if prose:  # or the path first: "courier/parcels.py defines it."
        side = most - _longest(prose) - 1
        if side >= _SENTENCE_MIN:
            rules["sentence"] += (f" | path-prose {_AFTER['sentence']} "
                                  f"{char}{{{_SENTENCE_MIN},{side}}} [.!?]")
        rules.update(_path_rules("path-prose", prose))
    return _text(rules)


def _kind(kind: ArgType, paths: ProjectPaths | None) -> ArgType:
    """A path kind is a free string without the project's paths."""
    return "str" if kind in _PATH_KINDS and paths is None else kind


def _value_rule(kind: ArgType, style: str, max_str: int, paths: ProjectPaths | None) -> str:
    if kind in _NUMBERS:
        return _NUMBERS[kind][0]
    if kind == "bool":
        return '"true" | "false"' if style == "json" else '"True" | "False"'
    if kind in _PATH_KINDS and paths is not None:
        return f'"\\"" path-{kind} "\\""'
    return f'"\\"" {_STR_CHAR}{{0,{max_str}}} "\\""'


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
