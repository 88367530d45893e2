"""How a remote session fails and retries, with a scripted transport (httpx.MockTransport).

The happy paths run against a real server in test_openai_backend.py; here the backend
misbehaves on purpose: busy answers, errors, a stream cut or garbled mid-turn.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from mesh.backends.openai import BackendConfig, OpenAIEngine
from mesh.engine.config import SamplingParams
from mesh.engine.interface import SessionFailed

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


def cut(*docs: dict[str, object]) -> bytes:
    """A stream the server ended early: [DONE] with no finish_reason before it."""
    return sse(*docs)


async def test_a_cut_stream_is_resumed_after_the_streamed_text() -> None:
    bodies: list[dict[str, object]] = []
    answers = [cut(chunk("a"), chunk(" b")), cut(chunk(" c")),
               sse(chunk(" d"), chunk("", "length"))]

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, content=answers[len(bodies) - 1])

    eng = await make(handler)
    text, result = await run_turn(eng)
    assert text == "a b c d"
    assert result.finish_reason == "length"  # type: ignore[attr-defined]
    assert result.num_generated == 4  # type: ignore[attr-defined]
    assert [b["prompt"] for b in bodies] == ["PREFIXhi", "PREFIXhia b", "PREFIXhia b c"]
    assert [b["max_tokens"] for b in bodies] == [8, 6, 5]
    assert eng.resumed_streams == 2
    # The pool's sampler: no repetition penalty, no min-p, whatever the server's defaults.
    assert all(b["repeat_penalty"] == 1.0 and b["min_p"] == 0.0 for b in bodies)
    await eng.aclose()


async def test_an_empty_chunk_is_a_token() -> None:
    eng = await make(lambda request: httpx.Response(200, content=sse(
        chunk("a"), chunk(""), chunk("b"), chunk("", "stop"))))
    text, result = await run_turn(eng)
    assert text == "ab"
    assert result.num_generated == 3  # type: ignore[attr-defined]
    await eng.aclose()


async def test_a_stream_with_no_chunk_fails_at_once_naming_the_context() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(200, content=cut(chunk("a")) if len(calls) == 1 else b"")

    eng = await make(handler)
    with pytest.raises(SessionFailed, match="exceeds its --n_ctx: this session holds"):
        await run_turn(eng)
    assert len(calls) == 2  # the cut one resumed once; the empty one not retried
    assert not eng.sessions
    await eng.aclose()


async def test_a_dropped_kept_alive_connection_is_tried_once_more() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response",
                                            request=request)
        return httpx.Response(200, content=sse(chunk("a"), chunk("", "stop")))

    eng = await make(handler)
    text, result = await run_turn(eng)
    assert (text, len(calls)) == ("a", 2)
    assert result.finish_reason == "eos"  # type: ignore[attr-defined]
    await eng.aclose()
