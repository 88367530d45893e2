"""How a remote session fails and retries, with a scripted transport (httpx.MockTransport).

The happy paths run against a real server in test_openai_backend.py; here the backend
misbehaves on purpose: busy answers, errors, a stream cut or garbled mid-turn.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from mesh.backends import BackendConfig, OpenAIEngine
from mesh.engine.types import SamplingParams, SessionFailed

pytestmark = pytest.mark.anyio
Handler = Callable[[httpx.Request], httpx.Response]


def sse(*docs: dict[str, object]) -> bytes:
    return b"".join(b"data: " + json.dumps(d).encode() + b"\n\n" for d in docs) + (
        b"data: [DONE]\n\n")


def chunk(text: str, finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


async def make(handler: Handler) -> OpenAIEngine:
    def route(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if request.url.path == "/metrics":
            return httpx.Response(404)
        body = json.loads(request.content)
        if not body.get("stream"):  # the warm-up request
            return httpx.Response(200, json={"choices": [{"text": "x"}]})
        return handler(request)

    http = httpx.AsyncClient(transport=httpx.MockTransport(route))
    eng = OpenAIEngine(BackendConfig(url="http://backend", poll_metrics=False), "PREFIX",
                       http=http)
    await eng.start()
    return eng


async def run_turn(eng: OpenAIEngine, text: str = "hi") -> tuple[str, object]:
    s = await eng.attach()
    s.append(text)
    gen = s.generate(SamplingParams(max_tokens=8, temperature=0.0))
    pieces = [p.text async for p in gen]
    return "".join(pieces), gen.result


async def test_busy_answers_are_retried_then_streamed() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content)["prompt"])
        if len(calls) < 3:
            return httpx.Response(429, headers={"Retry-After": "0.1"}, text="busy")
        return httpx.Response(200, content=sse(chunk("a"), chunk(" b", "stop")))

    eng = await make(handler)
    text, result = await run_turn(eng)
    assert text == "a b" and result.finish_reason == "eos"  # type: ignore[attr-defined]
    assert calls == ["PREFIXhi"] * 3  # the prefix first, byte-identical, every time
    await eng.aclose()


@pytest.mark.parametrize("response, match", [
    (httpx.Response(500, text="boom"), "answered HTTP 500: boom"),
    (httpx.Response(200, content=b'data: {"error": {"message": "oom"}}\n\n'), "failed mid-turn"),
    (httpx.Response(200, content=b"data: {garbled\n\n"), "failed mid-turn: JSONDecodeError"),
])
async def test_a_failing_backend_fails_the_session_and_detaches_it(
        response: httpx.Response, match: str) -> None:
    eng = await make(lambda request: response)
    with pytest.raises(SessionFailed, match=match):
        await run_turn(eng)
    assert not eng.sessions  # detached, as the pool detaches a session whose decode failed
    assert eng.check_attach().ok
    await eng.aclose()


async def test_a_cut_connection_fails_the_session() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("peer closed connection", request=request)

    eng = await make(handler)
    with pytest.raises(SessionFailed, match="backend http://backend/v1/completions failed"):
        await run_turn(eng)
    assert not eng.sessions
    await eng.aclose()
