"""The plan schema, its grammar, the parser, the conversation window, the synthesis record."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mesh.agent.history import Conversations
from mesh.agent.plans import (
    GUIDED_EXTRA,
    Plan,
    PlanError,
    PlannedSubtask,
    max_plan_chars,
    parse_plan,
    plan_schema,
    schema_to_gbnf,
)
from mesh.agent.synthesis import Outcome, missing_note, summary
from mesh.agent.task import AgentConfig
from mesh.worker.types import WorkerResult
from tests.worker.test_worker_grammar import grammar_regex


def _longest(node: dict[str, Any], fill: str = "x") -> object:
    """The longest JSON value ``node`` admits (every string and list at its maximum)."""
    if "oneOf" in node:
        return max((_longest(n) for n in node["oneOf"]), key=lambda v: len(json.dumps(v)))
    if "const" in node:
        return node["const"]
    if "enum" in node:
        return max(node["enum"], key=len)
    if node["type"] == "string":
        return fill * node["maxLength"]
    if node["type"] == "array":
        return [_longest(node["items"]) for _ in range(node["maxItems"])]
    return {k: _longest(v) for k, v in node["properties"].items()}


@pytest.mark.parametrize("tools", [(), ("read_file", "grep")])
def test_the_length_bound_covers_the_longest_plan(tools: tuple[str, ...]) -> None:
    schema = plan_schema(3, tools)
    longest = json.dumps(_longest(schema), separators=(",", ":"))
    assert len(longest) <= max_plan_chars(schema)
    assert max_plan_chars(schema) - len(longest) < 16


def test_the_grammar_fixes_key_order_bounds_strings_and_lists() -> None:
    gbnf = schema_to_gbnf(plan_schema(2, ("read_file",), actions=("delegate", "ask")))
    lines = dict(line.split(" ::= ", 1) for line in gbnf.strip().splitlines())
    assert lines["root"] == "plan"
    assert lines["plan"] == "plan-0 | plan-1"
    assert lines["plan-0"].startswith('"{\\"action\\":" plan-0-action ",\\"subtasks\\":"')
    assert lines["plan-0-subtasks"].endswith('("," plan-0-subtasks-item){0,1} "]"')
    assert lines["plan-0-subtasks-item-tools-item"] == '"\\"read_file\\""'
    assert "letter char{10,238} char0" in lines["plan-0-subtasks-item-instructions"]
    assert "answer" not in gbnf  # the actions left out are not in the grammar


def _delegate(instructions: str) -> str:
    return json.dumps({"action": "delegate", "subtasks": [
        {"instructions": instructions, "files": [], "tools": []}]}, separators=(",", ":"))


@pytest.mark.parametrize("text_max", [240, 32, 12, 8])
def test_the_grammar_admits_only_instructions_that_start_with_a_letter_and_are_long_enough(
    text_max: int,
) -> None:
    import re

    language = re.compile(grammar_regex(schema_to_gbnf(plan_schema(2, text_max=text_max))))
    need = min(12, text_max)
    good = ["Read parcels.py"[:text_max], "x" * text_max, "A" + " " * (need - 2) + "b"]
    for text in good:
        assert language.fullmatch(_delegate(text)), text
    junk = [", ", "", " Read parcels.py", "1. read parcels.py", "R" * (need - 1),
            "Read" + " " * (need - 4), "y" * (text_max + 1), "-" * text_max]
    for text in junk:
        assert not language.fullmatch(_delegate(text)), text
    # the other strings keep their own rule: a non-blank first character
    assert language.fullmatch('{"action":"answer","answer":"42"}')


def test_the_grammar_supports_only_the_letter_first_pattern() -> None:
    schema = plan_schema(1)
    item = schema["oneOf"][0]["properties"]["subtasks"]["items"]
    item["properties"]["instructions"]["pattern"] = "^[0-9]"
    with pytest.raises(ValueError, match="only the pattern"):
        schema_to_gbnf(schema)


def test_schema_rejects_unknown_actions_and_empty_plans() -> None:
    with pytest.raises(ValueError, match="subset"):
        plan_schema(2, actions=("explode",))
    with pytest.raises(ValueError, match="max_subtasks"):
        plan_schema(0)
    with pytest.raises(ValueError, match="plan must be one of"):
        AgentConfig(plan="sometimes").validate()


def test_parse_plan_reads_each_shape() -> None:
    plan = parse_plan('{"action":"delegate","subtasks":[{"instructions":" find it ",'
                      '"files":["a.py",""],"tools":["read_file"]}]}', 3)
    assert plan == Plan("delegate", (PlannedSubtask("find it", ("a.py",), ("read_file",)),))
    assert plan.to_dict()["subtasks"][0] == {"id": "p1", "instructions": "find it",
                                             "files": ["a.py"], "tools": ["read_file"]}
    assert "Files to look at: a.py" in plan.subtasks[0].worker_instructions()
    assert parse_plan('{"action":"answer","answer":"42"}', 3).answer == "42"
    assert parse_plan('{"action":"ask","question":"which?"}', 3).question == "which?"


@pytest.mark.parametrize(("text", "error"), [
    ("{", "not JSON"),
    ("[]", "JSON object"),
    ('{"action":"dance"}', "action must be one of"),
    ('{"action":"delegate","subtasks":[]}', "non-empty subtasks"),
    ('{"action":"delegate","subtasks":[{"instructions":" "}]}', "instructions must be"),
    ('{"action":"delegate","subtasks":[{"instructions":"a"},{"instructions":"b"},'
     '{"instructions":"c"}]}', "at most 2"),
    ('{"action":"delegate","subtasks":[{"instructions":"a","files":"x"}]}', "list of strings"),
    ('{"action":"answer","answer":""}', "non-empty answer"),
    ('{"action":"ask"}', "non-empty question"),
])
def test_parse_plan_says_what_is_wrong(text: str, error: str) -> None:
    with pytest.raises(PlanError, match=error):
        parse_plan(text, 2)


def test_conversation_window_keeps_the_newest_within_budget() -> None:
    conv = Conversations(lambda t: len(t.split()), max_contexts=2)
    for i in range(4):
        conv.add("c1", "user", f"message {i} " + "word " * 5)
    window = conv.window("c1", 22)
    assert [e.text.split()[1] for e in window.entries] == ["2", "3"]
    assert window.dropped == 2 and window.tokens == 2 * (7 + 4)
    assert conv.window("c1", 0).entries == () and conv.window("nobody", 99).dropped == 0
    conv.add("c2", "user", "x")
    conv.add("c3", "user", "y")  # over max_contexts: the least recently used goes
    assert conv.window("c1", 99).entries == () and len(conv) == 2


def test_synthesis_record_is_camel_case_and_failures_are_named() -> None:
    ok = Outcome("p1", "find it", result=WorkerResult("found", 2, 30, 1, "answer"))
    bad = Outcome("p2", "read it", error="tool exploded")
    rows = summary([ok, bad])
    assert rows[0] == {"id": "p1", "instructions": "find it", "answer": "found", "turns": 2,
                       "tokens": 30, "toolCalls": 1, "finishReason": "answer"}
    assert rows[1]["finishReason"] == "failed" and rows[1]["error"] == "tool exploded"
    assert missing_note([ok]) == ""
    assert "[p2] read it: tool exploded" in missing_note([ok, bad])


GUIDED_PARTS = ("Which file checks the weight?", 'What does "heavy" mean?')
PROJECT_FILES = ("courier/parcels.py", "courier/routes.py")


def _guided(instructions: list[str], files: list[list[str]] | None = None) -> str:
    files = files or [[] for _ in instructions]
    return json.dumps({"action": "delegate", "subtasks": [
        {"instructions": i, "files": f, "tools": []} for i, f in zip(instructions, files,
                                                                       strict=True)]},
        separators=(",", ":"), ensure_ascii=False)


def test_a_guided_grammar_admits_one_subtask_per_part_opening_with_it() -> None:
    import re

    schema = plan_schema(3, ("read_file",), ("delegate",), 60, files=PROJECT_FILES,
                         parts=GUIDED_PARTS)
    language = re.compile(grammar_regex(schema_to_gbnf(schema)))
    good = [
        _guided(list(GUIDED_PARTS)),
        _guided(list(GUIDED_PARTS),
                [["courier/parcels.py"], ["courier/routes.py", "courier/parcels.py"]]),
    ]
    for text in good:
        assert language.fullmatch(text), text
        plan = parse_plan(text, 3)
        assert [s.instructions[:len(p)] for s, p in zip(plan.subtasks, GUIDED_PARTS,
                                                        strict=True)] == list(GUIDED_PARTS)
    bad = [
        _guided([GUIDED_PARTS[0]]),  # a part left out
        _guided(list(reversed(GUIDED_PARTS))),  # out of order
        _guided([*GUIDED_PARTS, GUIDED_PARTS[1]]),  # one too many
        _guided(["This is a test.", GUIDED_PARTS[1]]),  # instructions of its own
        _guided(list(GUIDED_PARTS), [["courier/nowhere.py"], []]),  # not a project file
        _guided([GUIDED_PARTS[0] + " Look at parcels.py.", GUIDED_PARTS[1]]),  # past the part
    ]
    for text in bad:
        assert not language.fullmatch(text), text


def test_the_length_bound_covers_the_longest_guided_plan() -> None:
    schema = plan_schema(3, ("read_file", "grep"), ("delegate",), 60, files=PROJECT_FILES,
                         parts=GUIDED_PARTS)
    # every string and list at its longest: the longer file name four times, and so on
    longest = _guided([p + "x" * GUIDED_EXTRA for p in GUIDED_PARTS], [[PROJECT_FILES[0]] * 4] * 2)
    longest = longest.replace('"tools":[]', '"tools":["read_file","read_file"]')
    assert len(longest.encode()) <= max_plan_chars(schema)
    assert max_plan_chars(schema) - len(longest.encode()) < 16


def test_guided_schemas_follow_the_request() -> None:
    cfg = AgentConfig(style="guided", max_subtasks=2, files=PROJECT_FILES,
                      actions=("delegate",))
    schema = cfg.schema("Who calls plan_route, and what does dispatch raise? Also why?")
    (delegate,) = schema["oneOf"]
    items = delegate["properties"]["subtasks"]["prefixItems"]
    assert [i["properties"]["instructions"]["x-startsWith"] for i in items] == [
        "Who calls plan_route?", "What does dispatch raise? Also why?"]
    assert cfg.schema("")["oneOf"][0]["properties"]["subtasks"]["items"]  # nothing to split
    with pytest.raises(ValueError, match="style"):
        AgentConfig(style="creative").validate()
    with pytest.raises(ValueError, match="3 request parts"):
        plan_schema(2, parts=("a", "b", "c"))
