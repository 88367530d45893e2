"""The tools' shape limits, the grammar's cost and bounds, and repeated calls (issue 27 hole
1, issue 29 part 1 c and d): pure checks, then the real tiny model."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mesh.api.openai_tools import (
    ARRAY_BOUNDED_MAX,
    MAX_ENUM,
    MAX_KEY_CHARS,
    MAX_PROPERTIES,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
    MAX_TOOLS,
    MAX_TYPE_LIST,
    STRING_BOUNDED_MAX,
    Bounds,
    ToolChoice,
    ToolsError,
    cached_grammar,
    parse_tools,
    split_calls,
    tools_grammar,
)
from mesh.engine.config import EngineConfig
from mesh.engine.pool import SharedKVPool
from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from tests.api.test_openai import CHAT, SYSTEM, Mesh, system
from tests.api.test_openai_hostile import hostile_tool


def tool(params: dict[str, Any], name: str = "f") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": params}}


def obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required or []}


def refused(tools: list[Any]) -> ToolsError:
    with pytest.raises(ToolsError) as info:
        parse_tools(tools)
    return info.value


# ------------------------------------------------------------------ limits


def test_each_limit_is_a_clear_error_naming_it() -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    cases: list[tuple[list[Any], str, int]] = [
        ([hostile_tool()], "'type' list", MAX_TYPE_LIST),
        ([tool(obj({"x": {"enum": list(range(MAX_ENUM + 1))}}))], "enum values", MAX_ENUM),
        ([tool(obj({f"k{i}": {"type": "string"} for i in range(MAX_PROPERTIES + 1)}))],
         "properties of one object", MAX_PROPERTIES),
        ([tool(obj({"k" * (MAX_KEY_CHARS + 1): {"type": "string"}}))], "property name",
         MAX_KEY_CHARS),
        ([tool(obj({"x": deep}))], "nesting depth", MAX_SCHEMA_DEPTH),
        ([tool(obj({"x": {"enum": list(range(MAX_ENUM))}}), f"t{i}") for i in range(20)],
         "schema nodes", MAX_SCHEMA_NODES),
        ([tool(obj({}), f"t{i}") for i in range(MAX_TOOLS + 1)], "number of tools",
         MAX_TOOLS),
    ]
    for tools, words, limit in cases:
        err = refused(tools)
        assert words in str(err) and f"limit of {limit}" in str(err), str(err)
        assert err.param.startswith("tools")


def test_the_hostile_body_is_refused_before_any_grammar_work() -> None:
    t0 = time.perf_counter()
    err = refused([hostile_tool()])
    assert time.perf_counter() - t0 < 1.0  # the old code spent 5-36 s building first
    assert err.param.endswith(".type")


def test_grammar_is_linear_in_optional_properties() -> None:
    """The old encoding repeated every later optional member in each alternative (n²
    members, n³ with nesting); now each optional property is one chained rule."""
    def size(n: int) -> int:
        inner = obj({f"i{j}": {"type": ["string", "null"]} for j in range(n)})
        specs = parse_tools([tool(obj({f"k{j}": inner for j in range(n)}))])
        grammar = tools_grammar(specs, ToolChoice("required"))
        assert grammar is not None
        return len(grammar)

    small, large = size(8), size(32)
    assert large < 16 * 1.5 * small  # 4x the properties per level, two levels: ~16x


def test_string_and_array_bounds_follow_max_tokens() -> None:
    specs = parse_tools([tool(obj({"s": {"type": "string"},
                                   "a": {"type": "array", "items": {"type": "integer"}}}))])
    for max_tokens in (10, 50, 300, 4000):
        grammar = tools_grammar(specs, ToolChoice("required"), max_tokens=max_tokens)
        assert grammar is not None
        bounds = Bounds.of(max_tokens)
        if max_tokens <= STRING_BOUNDED_MAX:
            assert f"char{{0,{max_tokens}}}" in grammar and bounds.string == max_tokens
        else:
            assert "char*" in grammar and bounds.string is None
        if max_tokens // 2 <= ARRAY_BOUNDED_MAX:
            assert f"int){{0,{max_tokens // 2 - 1}}}" in grammar
        else:
            assert "int)*" in grammar and bounds.array is None
    # The old fixed caps were 200 characters and 16 items.
    assert Bounds.of(300).string == 300 and Bounds.of(100).array == 50


def test_grammar_cache_returns_the_same_build() -> None:
    specs = parse_tools([tool(obj({"s": {"type": "string"}}))])
    key = json.dumps([tool(obj({"s": {"type": "string"}}))], sort_keys=True)
    a = cached_grammar(key, specs, ToolChoice("auto"), parallel=True, max_tokens=64)
    b = cached_grammar(key, specs, ToolChoice("auto"), parallel=True, max_tokens=64)
    c = cached_grammar(key, specs, ToolChoice("auto"), parallel=True, max_tokens=640)
    assert a is b and a != c


def test_a_call_repeated_word_for_word_is_kept_once_unless_asked() -> None:
    specs = parse_tools([tool(obj({"x": {"type": "integer"}}), "g")])
    one = '<tool_call>{"name":"g","arguments":{"x":1}}</tool_call>'
    two = '<tool_call>{"name":"g","arguments":{"x":2}}</tool_call>'
    content, calls = split_calls("\n".join([one, one, two, one]), specs)
    assert content is None
    assert [c["function"]["arguments"] for c in calls] == ['{"x":1}', '{"x":2}']
    _, calls = split_calls("\n".join([one, one, two]), specs, repeats=True)
    assert len(calls) == 3


# ------------------------------------------------------------------ the tiny model


@pytest.fixture
async def mesh(tiny_model_path: Path) -> AsyncIterator[Mesh]:
    cfg = EngineConfig(model_path=str(tiny_model_path), max_sessions=4, session_budget=2048,
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


@pytest.mark.anyio
async def test_a_wide_optional_schema_compiles_in_llama_cpp(mesh: Mesh) -> None:
    """Every property optional, at the limit: llama.cpp accepts the grammar (it refuses a
    repeated group over 2,000 elements, which the old all-alternatives encoding made)."""
    props = {f"k{i}": {"type": "integer"} for i in range(MAX_PROPERTIES)}
    r = await mesh.chat([system(), {"role": "user", "content": "go"}],
                        tools=[tool(obj(props), "wide")], tool_choice="required",
                        max_tokens=40, seed=1)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("tool_calls", "length")


@pytest.mark.anyio
async def test_parallel_calls_default_on_and_repeats_dropped(mesh: Mesh) -> None:
    """A tool without parameters: every call the grammar admits is the same call. With
    ``parallel_tool_calls`` left at its default (true) the tiny model writes several in
    one reply for some seeds; they come back once, or all with ``repeat_tool_calls``."""
    ping = tool(obj({}), "ping")
    msgs = [system(), {"role": "user", "content": "ping"}]
    repeated = 0
    for seed in range(8):
        body: dict[str, Any] = {"tools": [ping], "tool_choice": "required", "seed": seed,
                                "max_tokens": 120, "temperature": 1.0}
        r = await mesh.chat(msgs, **body)
        assert r.status_code == 200, r.text
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert len(calls) == 1, calls
        r = await mesh.chat(msgs, **body, repeat_tool_calls=True)
        assert r.status_code == 200, r.text
        repeated += len(r.json()["choices"][0]["message"]["tool_calls"]) > 1
    assert repeated, "no seed wrote a repeated call: the test checks nothing"
