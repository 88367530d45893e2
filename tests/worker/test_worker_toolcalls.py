"""Parsing tool calls and answers in both syntaxes; garbage never raises."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.template.loader import ToolCallSyntax
from mesh.worker.grammar import ToolCall, parse_turn

JSON = ToolCallSyntax(style="json")
CALL = ToolCallSyntax(style="call", open="<call>", close="</call>")


def test_json_call() -> None:
    call = '{"name": "read_file", "arguments": {"path": "a.py"}}'
    text = f"Let me look. <tool_call>{call}</tool_call>"
    parsed = parse_turn(text, JSON)
    assert parsed.calls == (ToolCall("read_file", {"path": "a.py"}),)
    assert parsed.answer is None and parsed.errors == ()


def test_call_syntax_with_literal_arguments() -> None:
    parsed = parse_turn("<call>grep(text='def go', max_matches=5)</call>", CALL)
    assert parsed.calls == (ToolCall("grep", {"text": "def go", "max_matches": 5}),)


def test_unterminated_call_at_the_end_is_accepted() -> None:
    parsed = parse_turn('<tool_call>{"name": "list_files", "arguments": {}}', JSON)
    assert parsed.calls == (ToolCall("list_files", {}),)


def test_answer_tags() -> None:
    parsed = parse_turn("thinking... <answer> It is in a.py. </answer> trailing", JSON)
    assert parsed.answer == "It is in a.py."
    assert parsed.calls == ()


def test_format_round_trips() -> None:
    for syntax in (JSON, CALL):
        text = syntax.format("read_file", {"path": "x.py", "start": 3})
        assert parse_turn(text, syntax).calls == (
            ToolCall("read_file", {"path": "x.py", "start": 3}),
        )


def test_garbage_becomes_errors() -> None:
    cases = [
        ("<tool_call>not json</tool_call>", JSON),
        ('<tool_call>["read_file"]</tool_call>', JSON),
        ('<tool_call>{"arguments": {}}</tool_call>', JSON),
        ('<tool_call>{"name": "x", "arguments": 3}</tool_call>', JSON),
        ("<call>read_file('a.py')</call>", CALL),
        ("<call>__import__('os').system('x')</call>", CALL),
        ("<call>read_file(path=open('x'))</call>", CALL),
        ("<call>read_file(**kw)</call>", CALL),
        ("<call>" + "(" * 5000 + "</call>", CALL),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", JSON),
    ]
    for text, syntax in cases:
        parsed = parse_turn(text, syntax)
        assert parsed.calls == (), text[:40]
        assert len(parsed.errors) == 1, text[:40]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("<>/{}()[]\"'=,: _acdeflmnorstu")), max_size=200))
def test_parse_never_raises(text: str) -> None:
    for syntax in (JSON, CALL):
        parse_turn(text, syntax)
        parse_turn("<tool_call>" + text, syntax)
        parse_turn("<call>" + text + "</call>", syntax)
