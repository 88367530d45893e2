"""The turn grammar against parse_turn: every sentence it admits parses, and the calls the
templates document are sentences of it.

The grammar is not recursive, so the test inlines its rules into one regular expression
(GBNF literals, character classes and ``{m,n}``/``?``/``*`` map one to one) and lets
hypothesis draw sentences from it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.template.loader import ToolCallSyntax, load_template
from mesh.worker.grammar import (
    PATHS_MAX,
    TOOL_ARGS,
    ProjectPaths,
    parse_turn,
    sentence_grammar,
    turn_grammar,
)

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
    assert pattern.fullmatch("A plain reply, no call and no answer.")  # the model's own way
    assert not pattern.fullmatch("A reply <with> markup.")
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
    tags = (syntax.open, syntax.answer_open)
    if not any(tag in text for tag in tags):  # a plain reply: the worker's answer
        assert not parsed.calls and parsed.answer is None, text
    else:
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
    prose = text if not parsed.calls else text[:text.find(syntax.open)]
    prose = prose.replace(syntax.answer_open, " ").replace(syntax.answer_close, " ")
    assert _paths_are_real(prose, PATHS.choices("place")[1:]), text


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


# --------------------------------------------------------------------------- paths in prose


@pytest.mark.parametrize(("syntax", "tools", "budget"), FULL)
def test_prose_names_only_the_projects_paths(
    syntax: ToolCallSyntax, tools: list[str], budget: int
) -> None:
    pattern = re.compile(grammar_regex(turn_grammar(syntax, tools, budget, PATHS)))

    def ok(answer: str) -> bool:
        return bool(pattern.fullmatch(f"{syntax.answer_open}{answer}{syntax.answer_close}"))

    assert ok("The Parcel class is in courier/parcels.py.")
    assert ok("courier/parcels.py defines it.") and ok("See the tests folder.")
    assert not ok("It is in src/main.py.")  # no such path: a "/" only inside a real one
    assert not ok("It is in courier/main.py.")
    assert not ok("Read courier/parcels.py and tests/test_sample.py.")  # one path a turn


def test_a_sentence_grammar_admits_whole_sentences_only() -> None:
    syntax = LIGHT.tool_calls
    pattern = re.compile(grammar_regex(sentence_grammar(syntax, 160, PATHS)))

    def ok(sentence: str) -> bool:
        return bool(pattern.fullmatch(f"<answer>{sentence}</answer>"))

    assert ok("The Parcel class is defined in courier/parcels.py.")
    assert ok("It weighs at most 30 kg!")
    assert not ok("file in the")  # no full stop
    assert not ok("write_to_file(path=x).")  # no brackets: no part of a call
    assert not ok("The file `x` is it.") and not ok("It is <b>.")  # no quotes, no markup
    assert not ok("It is src/main.py.")  # a path only of the project's
    assert not ok("ok.")  # too short to be a sentence
    free = re.compile(grammar_regex(sentence_grammar(syntax, 160)))
    assert free.fullmatch("<answer>It is in src/main.py.</answer>")  # no paths: any "/"


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_every_sentence_it_admits_is_closed_and_fits(data: st.DataObject) -> None:
    assert PATHS is not None
    syntax = LIGHT.tool_calls
    text = data.draw(st.from_regex(grammar_regex(sentence_grammar(syntax, 160, PATHS)),
                                   fullmatch=True))
    assert len(text) <= 160
    body = text.removeprefix("<answer>").removesuffix("</answer>")
    places = PATHS.choices("place")[1:]
    # a capital, a digit or a project path (set apart) first
    assert body[0].isupper() or body[0].isdigit() or any(
        body.startswith(p) and body[len(p)] in " .,;:!?" for p in places), text
    assert body[-1] in ".!?" and "<" not in body
    assert not set(body) & set("()[]{}`\"")
    assert _paths_are_real(body, places), text


def _paths_are_real(text: str, places: tuple[str, ...]) -> bool:
    """Every "/" of ``text`` lies inside one of ``places``, set apart from word characters."""
    for at, char in enumerate(text):
        if char != "/":
            continue
        if not any(text[s:s + len(p)] == p and s <= at < s + len(p)
                   and (s == 0 or not (text[s - 1].isalnum() or text[s - 1] in "_/"))
                   for p in places for s in range(max(0, at - len(p)), at + 1)):
            return False
    return True


def test_a_tree_of_thousands_of_paths_stays_small() -> None:
    files = [f"pkg{i}/mod{j}.py" for i in range(40) for j in range(50)]
    paths = ProjectPaths.of(files, [f"pkg{i}" for i in range(40)])
    assert paths is not None
    grammar = turn_grammar(LIGHT.tool_calls, LIGHT.tools.enabled, 192, paths)
    assert len(grammar) < 150_000
    # every rule line is short: one folder's entries, never the whole list
    assert max(len(line) for line in grammar.splitlines()) < 2_000
    pattern = re.compile(grammar_regex(grammar))
    assert pattern.fullmatch('<call>read_file(path="pkg39/mod49.py")</call>')
    assert not pattern.fullmatch('<call>read_file(path="pkg40/mod0.py")</call>')


def test_the_real_sampler_keeps_noise_inside_the_sentence_grammar(tiny_model_path: Path) -> None:
    from mesh.engine.config import SamplingParams
    from tests.engine.test_pool import make_pool, run

    syntax = LIGHT.tool_calls
    grammar = sentence_grammar(syntax, 80, PATHS)
    pattern = re.compile(grammar_regex(grammar))

    async def body() -> list[str]:
        pool = await make_pool(tiny_model_path, max_sessions=2)
        out: list[str] = []
        try:
            for seed in range(4):
                s = await pool.attach()
                s.append(f"Answer {seed}:")
                gen = s.generate(SamplingParams(max_tokens=80, temperature=1.0, seed=seed,
                                                stop_at_eos=False, grammar=grammar))
                _ = [p async for p in gen]
                assert gen.result is not None
                out.append(gen.result.text)
                await s.detach()
        finally:
            await pool.aclose()
        return out

    for text in run(body()):
        assert pattern.fullmatch(text), text
