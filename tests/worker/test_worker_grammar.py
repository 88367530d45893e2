"""The turn grammar against parse_turn: every sentence it admits parses, and the calls the
templates document are sentences of it.

The grammar is not recursive, so the test inlines its rules into one regular expression
(GBNF literals, character classes and ``{m,n}``/``?``/``*`` map one to one) and lets
hypothesis draw sentences from it.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.template.loader import load_template
from mesh.template.manifest import ToolCallSyntax
from mesh.worker.grammar import PATHS_MAX, TOOL_ARGS, ProjectPaths, turn_grammar
from mesh.worker.toolcalls import parse_turn

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[a-z][a-z0-9-]*|\{\d+,\d+\}|[()|?*]')


def grammar_regex(gbnf: str) -> str:
    rules = dict(line.split(" ::= ", 1) for line in gbnf.strip().splitlines())
    done: dict[str, str] = {}

    def expand(name: str) -> str:
        if name not in done:
            out = []
            for tok in _TOKEN.findall(rules[name]):
                if tok.startswith('"'):
                    out.append(re.escape(json.loads(tok)))
                elif tok.startswith("[") or tok.startswith("{") or tok in "()|?*":
                    out.append(tok.replace("(", "(?:") if tok == "(" else tok)
                else:
                    out.append("(?:" + expand(tok) + ")")
            done[name] = "".join(out)
        return done[name]

    return expand("root")


LIGHT = load_template("light").manifest
HEAVY = load_template("heavy").manifest
FULL = [
    (LIGHT.tool_calls, LIGHT.tools.enabled, LIGHT.turns.max_tokens_per_turn),
    (HEAVY.tool_calls, HEAVY.tools.enabled, HEAVY.turns.max_tokens_per_turn),
]
CASES = [
    *FULL,
    (HEAVY.tool_calls, HEAVY.tools.enabled, 120),  # short strings, some tools left out
    (LIGHT.tool_calls, LIGHT.tools.enabled, 30),  # too small for any call: answers only
]


@pytest.mark.parametrize(("syntax", "tools", "budget"), FULL)
def test_documented_calls_and_answers_are_sentences(
    syntax: ToolCallSyntax, tools: list[str], budget: int
) -> None:
    pattern = re.compile(grammar_regex(turn_grammar(syntax, tools, budget)))
    examples = [
        syntax.format("read_file", {"path": "README.md"}),
        "I will look first.\n" + syntax.format("grep", {"text": "def f", "ignore_case": True}),
        syntax.format("list_files", {}),
        f"{syntax.answer_open}It is in courier/parcels.py.{syntax.answer_close}",
    ]
    for text in examples:
        if syntax.style == "call":
            text = text.replace("'", '"')  # the grammar writes strings in double quotes
        assert pattern.fullmatch(text), text
        assert not parse_turn(text, syntax).errors
    assert not pattern.fullmatch(syntax.format("rm", {"path": "/"}))
    assert not pattern.fullmatch("no call and no answer")
    two = syntax.format("list_files", {}) + syntax.format("list_files", {})
    assert not pattern.fullmatch(two.replace("'", '"'))


def test_the_longest_sentence_fits_the_budget() -> None:
    for syntax, tools, budget in CASES:
        gbnf = turn_grammar(syntax, tools, budget)
        caps = [int(m) for m in re.findall(r"\{\d+,(\d+)\}", gbnf)]
        assert caps and max(caps) <= budget


@pytest.mark.parametrize(("syntax", "tools", "budget"), CASES)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_every_sentence_parses_to_one_call_or_an_answer(
    syntax: ToolCallSyntax, tools: list[str], budget: int, data: st.DataObject
) -> None:
    pattern = grammar_regex(turn_grammar(syntax, tools, budget))
    text = data.draw(st.from_regex(pattern, fullmatch=True))
    assert len(text) <= budget
    parsed = parse_turn(text, syntax)
    assert not parsed.errors, text
    assert (len(parsed.calls) == 1) != (parsed.answer is not None), text
    for call in parsed.calls:
        assert call.name in tools
        assert set(call.arguments) <= {k for k, _ in TOOL_ARGS[call.name]}


PATHS = ProjectPaths.of(["README.md", "courier/parcels.py", "tests/test_sample.py"],
                        ["courier", "tests"])


@pytest.mark.parametrize(("syntax", "tools", "budget"), FULL)
def test_with_the_projects_paths_a_call_names_only_them(
    syntax: ToolCallSyntax, tools: list[str], budget: int
) -> None:
    pattern = re.compile(grammar_regex(turn_grammar(syntax, tools, budget, PATHS)))

    def ok(name: str, args: dict[str, object]) -> bool:
        return bool(pattern.fullmatch(syntax.format(name, args).replace("'", '"')))

    assert ok("read_file", {"path": "courier/parcels.py", "start": 10, "lines": 40})
    assert ok("list_files", {"path": "courier", "depth": 2}) and ok("list_files", {"path": "."})
    assert ok("grep", {"text": "def f", "path": "tests"})
    assert ok("grep", {"text": "def f", "path": "README.md", "max_matches": 20})
    assert not ok("read_file", {"path": "./test_sample_courier.py"})  # not in the project
    assert not ok("read_file", {"path": "courier"})  # a folder is not a file
    assert not ok("list_files", {"path": "README.md"})  # nor a file a folder
    # numbers within the tools' ranges
    assert not ok("read_file", {"path": "README.md", "start": 0})
    assert not ok("read_file", {"path": "README.md", "lines": 1000})
    assert not ok("list_files", {"depth": 7})
    assert not ok("grep", {"text": "x", "max_matches": -1})


@pytest.mark.parametrize(("syntax", "tools", "budget"), FULL)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_sentences_with_paths_parse_and_name_project_paths(
    syntax: ToolCallSyntax, tools: list[str], budget: int, data: st.DataObject
) -> None:
    assert PATHS is not None
    text = data.draw(st.from_regex(grammar_regex(turn_grammar(syntax, tools, budget, PATHS)),
                                   fullmatch=True))
    assert len(text) <= budget
    parsed = parse_turn(text, syntax)
    assert not parsed.errors, text
    for call in parsed.calls:
        if "path" in call.arguments:
            assert call.arguments["path"] in PATHS.choices("place"), text


def test_paths_a_grammar_cannot_hold_or_too_many_are_free_strings() -> None:
    assert ProjectPaths.of([]) is None
    assert ProjectPaths.of([f"f{i}.py" for i in range(PATHS_MAX + 1)]) is None
    odd = ProjectPaths.of(['say "hi".txt', "back\\slash.py", "ok.py", "é.py"])
    assert odd is not None and odd.files == ("ok.py",)


@pytest.mark.parametrize(("syntax", "tools", "budget"), FULL)
def test_a_call_only_turn_admits_calls_and_no_answer(
    syntax: ToolCallSyntax, tools: list[str], budget: int
) -> None:
    pattern = re.compile(grammar_regex(turn_grammar(syntax, tools, budget, call_only=True)))
    call = syntax.format("read_file", {"path": "README.md"}).replace("'", '"')
    assert pattern.fullmatch("Let me look.\n" + call) if syntax.style == "call" else True
    assert pattern.fullmatch(syntax.format("list_files", {}))
    assert not pattern.fullmatch(f"{syntax.answer_open}42{syntax.answer_close}")



def test_a_call_only_turn_with_no_tool_that_fits_can_still_answer() -> None:
    # light at 30 tokens fits no call (see CASES): the language is never empty
    syntax = LIGHT.tool_calls
    tiny = turn_grammar(syntax, LIGHT.tools.enabled, 30, call_only=True)
    assert re.compile(grammar_regex(tiny)).fullmatch(
        f"{syntax.answer_open}42{syntax.answer_close}")
