"""Issue 27 hole 4: the OpenAI conversation cache is scoped by caller. With auth on, caller B
replaying caller A's exact history (A's reply included) is served from the shared prefix
only: ``cached_tokens`` equals the prefix, so B learns nothing of A's conversation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware

from mesh.a2a.auth import BearerAuth
from mesh.api.openai import OpenAIAPI
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
