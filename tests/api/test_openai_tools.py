"""OpenAI tools on the real tiny model: under the call grammar even its noise is a call."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mesh.api.openai_tools import (
    ToolChoice,
    ToolsError,
    parse_tool_choice,
    parse_tools,
    render_calls,
    split_calls,
    tools_grammar,
)
from mesh.engine.config import EngineConfig
from mesh.engine.pool import SharedKVPool
from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from tests.api.test_openai import CHAT, SYSTEM, Mesh, system

READ = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the project.",
    "parameters": {"type": "object", "required": ["path"], "properties": {
        "path": {"type": "string"}, "lines": {"type": "integer"},
        "mode": {"enum": ["head", "tail"]}}}}}
GREP = {"type": "function", "function": {
    "name": "grep", "parameters": {"type": "object", "properties": {
        "text": {"type": "string"}, "regex": {"type": "boolean"}}}}}
SPECS = parse_tools([READ, GREP])


@pytest.fixture
async def mesh(tiny_model_path: Path) -> AsyncIterator[Mesh]:
    # The tools' description is a few hundred tokens: a larger session budget than test_openai.
    cfg = EngineConfig(model_path=str(tiny_model_path), max_sessions=4, session_budget=1024,
                       n_threads=1)
    pool = SharedKVPool(cfg, CHAT.prefix_text(SYSTEM))
    await pool.start()
    gate = FloorGate(pool, GateConfig.create(policy="none", max_queue=8))
    m = Mesh(pool, gate)
    try:
        async with m.client:
            yield m
    finally:
        await m.api.aclose()
        await pool.aclose()


def check_call(call: dict[str, Any]) -> dict[str, Any]:
    """A call of a listed tool whose arguments obey its schema; returns the arguments."""
    assert call["type"] == "function" and call["id"].startswith("call_")
    args = json.loads(call["function"]["arguments"])
    assert isinstance(args, dict)
    if call["function"]["name"] == "read_file":
        assert isinstance(args["path"], str)
        assert set(args) <= {"path", "lines", "mode"}
        assert "lines" not in args or isinstance(args["lines"], int)
        assert "mode" not in args or args["mode"] in ("head", "tail")
    else:
        assert call["function"]["name"] == "grep"
        assert set(args) <= {"text", "regex"}
        assert "regex" not in args or isinstance(args["regex"], bool)
    return args


# ------------------------------------------------------------------ pure parts


def test_split_calls_and_render_round_trip() -> None:
    text = ('Looking.\n<tool_call>{"name":"read_file","arguments":{"path":"a.py"}}</tool_call>'
            '\n<tool_call>{"name":"grep","arguments":{}}</tool_call>')
    content, calls = split_calls(text, SPECS)
    assert content == "Looking."
    assert [c["function"]["name"] for c in calls] == ["read_file", "grep"]
    assert render_calls(calls) == text.split("\n", 1)[1]
    # An unknown tool, bad JSON or an unclosed block stays prose.
    for bad in ('<tool_call>{"name":"rm","arguments":{}}</tool_call>',
                '<tool_call>{"name":"grep","arguments":[]}</tool_call>',
                '<tool_call>{"name":"grep",</tool_call>', '<tool_call>{"name":"grep"'):
        assert split_calls(bad, SPECS) == (bad, [])


def test_bad_tools_and_choices_name_the_param() -> None:
    cases: list[tuple[Any, str]] = [
        ([{"type": "retrieval"}], "tools[0]"),
        ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
        ([READ, READ], "tools[1].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
         "tools[0].function.parameters"),
    ]
    for tools, param in cases:
        with pytest.raises(ToolsError) as info:
            parse_tools(tools)
        assert info.value.param == param
    for choice in ("always", {"type": "function", "function": {"name": "nope"}}, 3):
        with pytest.raises(ToolsError, match="tool_choice"):
            parse_tool_choice(choice, SPECS)
    with pytest.raises(ToolsError, match="needs tools"):
        parse_tool_choice("required", ())
    assert parse_tool_choice(None, SPECS) == ToolChoice("auto")
    assert parse_tool_choice(None, ()) == ToolChoice("none")
    assert tools_grammar(SPECS, ToolChoice("none")) is None


# ------------------------------------------------------------------ the tiny model


@pytest.mark.anyio
@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_required_calls_are_always_valid_calls(mesh: Mesh, seed: int) -> None:
    msgs = [system(), {"role": "user", "content": "Read the parcel module."}]
    r = await mesh.chat(msgs, tools=[READ, GREP], tool_choice="required", max_tokens=250,
                        temperature=1.0, seed=seed, parallel_tool_calls=False)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    check_call(call)


@pytest.mark.anyio
async def test_a_named_tool_and_the_follow_up_turn(mesh: Mesh) -> None:
    msgs: list[dict[str, Any]] = [system(), {"role": "user", "content": "Where is Parcel?"}]
    forced = {"type": "function", "function": {"name": "read_file"}}
    r = await mesh.chat(msgs, tools=[READ, GREP], tool_choice=forced, max_tokens=250,
                        temperature=1.0, seed=7)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["read_file"]
    check_call(message["tool_calls"][0])
    # The client runs the tool and sends the result back, as an agent framework does.
    msgs += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                       "content": "class Parcel: ..."}]
    r = await mesh.chat(msgs, tools=[READ, GREP], tool_choice="none", max_tokens=8)
    assert r.status_code == 200, r.text
    body = r.json()["choices"][0]
    assert body["finish_reason"] in ("stop", "length")
    assert "tool_calls" not in body["message"]


@pytest.mark.anyio
async def test_auto_is_a_call_or_prose_and_streams_the_same(mesh: Mesh) -> None:
    msgs = [system(), {"role": "user", "content": "Any tool?"}]
    for seed in range(3):
        body = {"messages": msgs, "tools": [READ, GREP], "max_tokens": 250,
                "temperature": 1.0, "seed": seed}
        r = await mesh.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        whole = r.json()["choices"][0]
        if whole["finish_reason"] == "tool_calls":
            for call in whole["message"]["tool_calls"]:
                check_call(call)
        else:
            assert not (whole["message"]["content"] or "").startswith("<")
        chunks = []
        async with mesh.client.stream("POST", "/v1/chat/completions",
                                      json={**body, "stream": True}) as s:
            async for line in s.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        deltas = [c["choices"][0] for c in chunks if c.get("choices")]
        assert deltas[-1]["finish_reason"] == whole["finish_reason"]
        streamed = [d["delta"] for d in deltas if d["delta"].get("tool_calls")]
        if whole["finish_reason"] == "tool_calls":
            names = [c["function"]["name"] for c in streamed[0]["tool_calls"]]
            assert names == [c["function"]["name"] for c in whole["message"]["tool_calls"]]
        else:
            assert streamed == []
