"""Callers of the OpenAI API, with auth on, over the real tiny model's pool.

Issue 27 hole 4: the conversation cache is scoped by caller. Caller B replaying caller A's
exact history (A's reply included) is served from the shared prefix only: ``cached_tokens``
equals the prefix, so B learns nothing of A's conversation.

Issue 42 item 4: each request takes one of its caller's places in the gate's queue, as an
A2A subtask or a session does. A caller flooding ``/v1/chat/completions`` and
``/v1/completions`` gets 429 + Retry-After for what is past its share while another
caller's request still queues, and is served.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware

from mesh.a2a.app import BearerAuth, caller_name
from mesh.api.openai_api import OpenAIAPI
from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from mesh.gate.queue import Hold
from tests.api.test_openai import CHAT, SYSTEM, open_mesh, system

pytestmark = pytest.mark.anyio

TOKENS = {"a": "token-of-caller-a", "b": "token-of-caller-b"}


async def test_caller_b_replaying_a_history_sees_only_the_prefix(tiny_model_path: Path) -> None:
    pool, gate = await open_mesh(tiny_model_path)
    api = OpenAIAPI(pool, gate, CHAT, SYSTEM, tokenize=pool.tokenize)
    app = Starlette(routes=api.routes, middleware=[
        Middleware(BearerAuth, tokens=list(TOKENS.values()), public_paths=[])])
    prefix = pool.info.prefix_tokens
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mesh",
                               timeout=60)

    async def chat(who: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
        r = await client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0},
            headers={"Authorization": f"Bearer {TOKENS[who]}"})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def cached(body: dict[str, Any]) -> int:
        return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])

    try:
        async with client:
            r = await client.post("/v1/chat/completions", json={"messages": [system()]})
            assert r.status_code == 401  # auth is on
            history = [system(), {"role": "user", "content": "A's secret question."}]
            first = await chat("a", history)
            assert cached(first) == prefix
            history += [first["choices"][0]["message"],
                        {"role": "user", "content": "And the next step?"}]
            # B sends A's exact history, A's reply included: only the prefix is shared.
            replay = await chat("b", history)
            assert cached(replay) == prefix, replay["usage"]
            # A's own next turn still continues A's conversation, beyond the prefix.
            again = await chat("a", history)
            assert cached(again) > prefix, again["usage"]
            assert cached(again) >= first["usage"]["prompt_tokens"]
    finally:
        await api.aclose()
        await pool.aclose()


async def test_a_flooding_caller_is_refused_past_its_share_while_another_is_served(
        tiny_model_path: Path) -> None:
    """One worker at a time (``static:1``), a queue of 4 places, 2 per caller. With the
    worker held, caller A's chat and completion queue; A's next chat and completion are
    429 ``queue_full`` with Retry-After, naming the share; B's request still queues. Once
    the worker is free, A's two and B's one are all served, and no place is left over."""
    pool, _ = await open_mesh(tiny_model_path)
    gate = FloorGate(pool, GateConfig.create(policy="none", max_workers=1, max_queue=4,
                                             max_queue_per_caller=2))
    api = OpenAIAPI(pool, gate, CHAT, SYSTEM, tokenize=pool.tokenize)
    app = Starlette(routes=api.routes, middleware=[
        Middleware(BearerAuth, tokens=list(TOKENS.values()), public_paths=[])])
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mesh",
                               timeout=60)
    a, b = caller_name(TOKENS["a"]), caller_name(TOKENS["b"])

    def post(who: str, n: int, *, chat: bool = True) -> asyncio.Task[httpx.Response]:
        headers = {"Authorization": f"Bearer {TOKENS[who]}"}
        if chat:
            coro = client.post("/v1/chat/completions", headers=headers, json={
                "messages": [system(), {"role": "user", "content": f"{who} asks {n}"}],
                "max_tokens": 4, "temperature": 0})
        else:
            coro = client.post("/v1/completions", headers=headers, json={
                "prompt": f"{who} asks {n}", "max_tokens": 4, "temperature": 0})
        return asyncio.ensure_future(coro)

    async def queued(caller: str, n: int) -> None:
        with anyio.fail_after(30):
            while gate.queued_by(caller) != n:
                await anyio.sleep(0.01)

    try:
        async with client:
            blocker = await Hold.acquire(gate, "blocker")  # the one worker slot
            flood = [post("a", 1), post("a", 2, chat=False)]
            await queued(a, 2)
            for chat in (True, False):  # past A's share, on either route
                r = await post("a", 3, chat=chat)
                assert r.status_code == 429, r.text
                assert float(r.headers["retry-after"]) >= 1
                error = r.json()["error"]
                assert error["code"] == "queue_full"
                assert "max_queue_per_caller" in error["message"], error
            other = post("b", 1)
            await queued(b, 1)  # B is not refused: it waits behind A's two
            assert not other.done()
            await blocker.aclose()
            served = [await t for t in (*flood, other)]
            assert [r.status_code for r in served] == [200, 200, 200], [r.text for r in served]
            assert gate.queued_by(a) == gate.queued_by(b) == 0 and gate.num_tickets == 0
    finally:
        await api.aclose()
        await pool.aclose()
