"""The OpenAI-compatible API on the real tiny model's pool, through httpx.ASGITransport."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette

from mesh.api.openai_api import OpenAIAPI
from mesh.engine.config import EngineConfig
from mesh.engine.pool import SharedKVPool
from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from mesh.gate.queue import QueueCheck
from mesh.template.chat import ChatFormat

pytestmark = pytest.mark.anyio

SYSTEM = "You are one agent of a team. The project's files and notes follow. " * 5
CHAT = ChatFormat.plain()


class Mesh:
    def __init__(self, pool: SharedKVPool, gate: Any, **kw: Any) -> None:
        self.pool = pool
        self.api = OpenAIAPI(pool, gate, CHAT, SYSTEM, tokenize=pool.tokenize, **kw)
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=Starlette(routes=self.api.routes)),
            base_url="http://mesh", timeout=60,
        )

    async def chat(self, messages: list[dict[str, str]], **body: Any) -> httpx.Response:
        return await self.client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0,
            **body})


async def open_mesh(model: Path, max_sessions: int = 4, **kw: Any) -> tuple[SharedKVPool, Any]:
    cfg = EngineConfig(model_path=str(model), max_sessions=max_sessions, session_budget=256,
                       n_threads=1)
    pool = SharedKVPool(cfg, CHAT.prefix_text(SYSTEM))
    await pool.start()
    gate = FloorGate(pool, GateConfig.create(policy="none", max_queue=8))
    return pool, gate


@pytest.fixture
async def mesh(tiny_model_path: Path) -> AsyncIterator[Mesh]:
    pool, gate = await open_mesh(tiny_model_path)
    m = Mesh(pool, gate)
    try:
        async with m.client:
            yield m
    finally:
        await m.api.aclose()
        await pool.aclose()


def system() -> dict[str, str]:
    return {"role": "system", "content": SYSTEM}


async def test_three_turns_reuse_everything_before(mesh: Mesh) -> None:
    prefix_tokens = mesh.pool.info.prefix_tokens
    messages = [system(), {"role": "user", "content": "List the files."}]
    usages, reasons = [], []
    for turn in range(3):
        r = await mesh.chat(messages)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion"
        usages.append(body["usage"])
        reasons.append(body["choices"][0]["finish_reason"])
        reply = body["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": f"Tool result {turn}: README.md courier/"}]
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == prefix_tokens
    for i in (1, 2):
        # Everything the previous turn read and wrote was already in the pool, except the
        # last token of a length-cut reply: it was sampled, never decoded (this turn does).
        before, now = usages[i - 1], usages[i]
        unseen = 1 if reasons[i - 1] == "length" else 0
        assert now["prompt_tokens_details"]["cached_tokens"] == (
            before["prompt_tokens"] + before["completion_tokens"] - unseen)
        assert now["prompt_tokens"] > now["prompt_tokens_details"]["cached_tokens"]
    assert mesh.api.cache.hits == 2 and len(mesh.api.cache) == 1


async def test_prefix_endpoint_and_mismatch_under_the_strict_rule(mesh: Mesh) -> None:
    r = await mesh.client.get("/v1/prefix")
    assert r.json()["system"] == SYSTEM and r.json()["prefix_tokens"] == (
        mesh.pool.info.prefix_tokens)
    wrong = SYSTEM.replace("team", "crew")
    r = await mesh.chat([{"role": "system", "content": wrong},
                         {"role": "user", "content": "hi"}], model="tiny:strict")
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "prefix_mismatch" and "differ at token" in err["message"]
    assert "team" in err["message"] and "crew" in err["message"]
    assert "GET /v1/prefix" in err["message"]
    r = await mesh.chat([{"role": "user", "content": "no system message"}],
                        model="tiny:strict")
    assert r.status_code == 400 and r.json()["error"]["code"] == "prefix_mismatch"


async def test_bad_requests_are_4xx(mesh: Mesh) -> None:
    r = await mesh.client.post("/v1/chat/completions", content=b"{nope")
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_json"
    r = await mesh.chat([system(), {"role": "user", "content": "x"}], max_tokens=10**6)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = await mesh.chat([system(), {"role": "user", "content": "x"}], n=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = await mesh.chat([system(), {"role": "user", "content": "x"}],
                        tools=[{"type": "function", "function": {"name": "no spaces"}}])
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_tools"
    assert r.json()["error"]["param"] == "tools[0].function.name"
    r = await mesh.chat([system(), {"role": "user", "content": "y " * 400}])
    assert r.status_code == 400, r.text
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert mesh.pool.load().sessions == ()  # nothing was left holding a session


async def test_stream_sends_chunks_usage_and_done(mesh: Mesh) -> None:
    msgs = [system(), {"role": "user", "content": "Stream it."}]
    async with mesh.client.stream("POST", "/v1/chat/completions", json={
        "messages": msgs, "max_tokens": 5, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln async for ln in r.aiter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    reasons = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
    assert reasons[-1] in ("stop", "length") and set(reasons[:-1]) == {None}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    # The streamed turn is cached: the next turn reuses it.
    r2 = await mesh.chat([*msgs, {"role": "assistant", "content": text},
                          {"role": "user", "content": "more"}])
    cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    usage = chunks[-1]["usage"]
    assert cached == usage["prompt_tokens"] + usage["completion_tokens"] - (
        1 if reasons[-1] == "length" else 0)


async def test_completions_endpoint_and_seeded_sampling(mesh: Mesh) -> None:
    prompt = CHAT.prefix_text(SYSTEM) + "### User\nSay something.\n\n### Assistant\n"
    bodies = []
    for _ in range(2):
        r = await mesh.client.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": 6, "temperature": 0.9, "top_p": 0.9, "seed": 7})
        assert r.status_code == 200, r.text
        bodies.append(r.json())
    assert bodies[0]["object"] == "text_completion"
    assert bodies[0]["choices"][0]["text"] == bodies[1]["choices"][0]["text"]
    r = await mesh.client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2,
                                                         "model": "x:strict"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "prefix_mismatch"


async def test_idle_conversations_evicted_lru_when_slots_run_out(tiny_model_path: Path) -> None:
    pool, gate = await open_mesh(tiny_model_path, max_sessions=2)
    m = Mesh(pool, gate)
    try:
        async with m.client:
            for name in ("a", "b", "c"):
                r = await m.chat([system(), {"role": "user", "content": f"agent {name}"}])
                assert r.status_code == 200, r.text
            assert m.api.cache.evictions == 1 and len(m.api.cache) == 2
            assert len(pool.load().sessions) == 2
    finally:
        await m.api.aclose()
        await pool.aclose()


class Refusing:
    def check_queue(self, *, places: int = 1, caller: str = "") -> QueueCheck:
        return QueueCheck(ok=False, queue_len=8, retry_after_s=2.5, reason="the queue is full")


async def test_gate_refusal_is_429_with_retry_after(mesh: Mesh) -> None:
    api = OpenAIAPI(mesh.pool, Refusing(), CHAT, SYSTEM,  # type: ignore[arg-type]
                    tokenize=mesh.pool.tokenize)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=Starlette(routes=api.routes)),
                               base_url="http://mesh")
    async with client:
        r = await client.post("/v1/chat/completions", json={
            "messages": [system(), {"role": "user", "content": "hi"}]})
    assert r.status_code == 429 and r.headers["retry-after"] == "3"


async def test_floor_gate_new_conversation_not_stuck_behind_an_idle_one(
        tiny_model_path: Path) -> None:
    """Under the floor gate an idle cached session may count as a worker; a new
    conversation must not wait behind it: it is admitted, beside it or after it gives way
    (the gate's slow start decides which)."""
    pool, _ = await open_mesh(tiny_model_path)
    gate = FloorGate(pool, GateConfig.create(policy="floor", max_queue=8))
    m = Mesh(pool, gate, max_wait_s=10)
    try:
        async with m.client:
            a = [system(), {"role": "user", "content": "agent a"}]
            r = await m.chat(a)
            assert r.status_code == 200, r.text
            a += [r.json()["choices"][0]["message"], {"role": "user", "content": "again"}]
            r = await m.chat(a)  # continues a's session: no new admission needed
            assert r.status_code == 200 and m.api.cache.hits == 1
            r = await m.chat([system(), {"role": "user", "content": "agent b"}])
            assert r.status_code == 200, r.text
            # Either a gave way (1 session left) or both are held: none is leaked.
            assert m.api.cache.evictions + len(pool.load().sessions) == 2
    finally:
        await m.api.aclose()
        await pool.aclose()


async def test_idle_conversations_expire(tiny_model_path: Path) -> None:
    pool, gate = await open_mesh(tiny_model_path)
    m = Mesh(pool, gate, idle_ttl_s=0.3)
    try:
        async with m.client:
            r = await m.chat([system(), {"role": "user", "content": "agent a"}])
            assert r.status_code == 200 and len(pool.load().sessions) == 1
            for _ in range(100):
                if not len(m.api.cache):
                    break
                await anyio.sleep(0.05)
            assert len(m.api.cache) == 0 and m.api.cache.evictions == 1
    finally:
        await m.api.aclose()
        await pool.aclose()


async def test_completions_stream(mesh: Mesh) -> None:
    prompt = CHAT.prefix_text(SYSTEM) + "### User\nStream a completion.\n\n### Assistant\n"
    async with mesh.client.stream("POST", "/v1/completions", json={
        "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln async for ln in r.aiter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert len(mesh.api.cache) == 1  # the finished turn stays cached for the next one


async def test_a_prompt_that_is_only_the_prefix_is_a_400(mesh: Mesh) -> None:
    prefix = (await mesh.client.get("/v1/prefix")).json()["prefix_text"]
    r = await mesh.client.post("/v1/completions", json={"prompt": prefix, "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "empty_input"
    assert mesh.pool.load().sessions == ()  # the session attached for it was let go

