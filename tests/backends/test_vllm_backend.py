"""``--engine openai:URL`` on vLLM, against a fake vLLM (httpx.MockTransport) that answers
as vLLM 0.32 does: ``owned_by: "vllm"`` in ``/v1/models``, a grammar only through
``structured_outputs`` (its ``grammar`` field is silently ignored), prefix-cache counters in
``/metrics``. The real vLLM-CPU run is in docs/vllm.md."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from mesh.backends.openai import (
    BackendConfig,
    OpenAIEngine,
    backend_counters,
    grammar_fields,
    parse_prometheus,
)
from mesh.engine.config import SamplingParams
from mesh.engine.interface import ModelError

pytestmark = pytest.mark.anyio

METRICS = """# HELP vllm:prefix_cache_queries Prefix cache queries, in queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="smollm2"} 12180.0
vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 10368.0
vllm:num_requests_running{engine="0",model_name="smollm2"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.05
"""


class FakeServer:
    """Answers /v1/models as ``owner`` serves it, streams "ok" for every completion and
    keeps every completion request's body."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "smollm2", "object": "model", "owned_by": self.owner}]})
        if request.url.path == "/metrics":
            return httpx.Response(200, text=METRICS)
        body = json.loads(request.content)
        self.bodies.append(body)
        if not body.get("stream"):  # the warm-up
            return httpx.Response(200, json={"choices": [{"text": "x"}]})
        chunks = [{"choices": [{"index": 0, "text": "ok", "finish_reason": None}]},
                  {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}]
        data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
        return httpx.Response(200, content=data + b"data: [DONE]\n\n")


async def start(owner: str, *, poll: bool = False) -> tuple[OpenAIEngine, FakeServer]:
    fake = FakeServer(owner)
    http = httpx.AsyncClient(transport=httpx.MockTransport(fake))
    eng = OpenAIEngine(BackendConfig(url="http://backend", poll_metrics=poll), "PREFIX",
                       http=http)
    await eng.start()
    return eng, fake


async def grammar_turn(eng: OpenAIEngine) -> None:
    s = await eng.attach()
    s.append("hi")
    gen = s.generate(SamplingParams(max_tokens=4, temperature=0.0, grammar='root ::= "ok"'))
    assert "".join([p.text async for p in gen]) == "ok"


async def test_vllm_gets_the_grammar_as_structured_outputs() -> None:
    """vLLM ignores llama.cpp's ``grammar`` field without a word: mesh's plan and tool-call
    grammars must go in ``structured_outputs.grammar`` (xgrammar reads GBNF)."""
    eng, fake = await start("vllm")
    assert eng.owner == "vllm"
    await grammar_turn(eng)
    body = fake.bodies[-1]
    assert body["structured_outputs"] == {"grammar": 'root ::= "ok"'}
    assert "grammar" not in body
    assert body["prompt"] == "PREFIXhi" and body["model"] == "smollm2"
    await eng.aclose()


@pytest.mark.parametrize("owner", ["llamacpp", "mesh", "me"])
async def test_llama_cpp_servers_keep_the_grammar_field(owner: str) -> None:
    eng, fake = await start(owner)
    await grammar_turn(eng)
    assert fake.bodies[-1]["grammar"] == 'root ::= "ok"'
    assert "structured_outputs" not in fake.bodies[-1]
    await eng.aclose()


def test_grammar_fields_by_owner() -> None:
    assert grammar_fields("sglang", "g") == {"ebnf": "g"}
    assert grammar_fields(None, "g") == {"grammar": "g"}


async def test_vllm_prefix_cache_counters_reach_backend_metrics() -> None:
    """/capacity's engine.backend shows how much of mesh's prompts vLLM's prefix cache
    served (the counters are in prompt tokens)."""
    eng, _ = await start("vllm", poll=True)
    for _ in range(100):
        if eng.backend_metrics():
            break
        await asyncio.sleep(0.01)
    m = eng.backend_metrics()
    assert m is not None
    assert m["prefix_cache_queries"] == 12180.0 and m["prefix_cache_hits"] == 10368.0
    assert m["prefix_cache_hit_rate"] == pytest.approx(10368 / 12180)
    assert m["running"] == 1.0 and m["kv_usage"] == 0.05
    await eng.aclose()


def test_no_counters_where_the_backend_has_none() -> None:
    assert backend_counters(parse_prometheus("llamacpp:requests_processing 1\n")) == {}
    zero = "vllm:prefix_cache_queries_total 0\nvllm:prefix_cache_hits_total 0\n"
    assert backend_counters(parse_prometheus(zero)) == {
        "prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0}


@pytest.mark.parametrize("max_model_len, ok", [(4096, True), (2050, True), (2049, False)])
async def test_a_context_shorter_than_prefix_plus_session_is_refused_at_start(
        max_model_len: int, ok: bool) -> None:
    """vLLM lists its ``max_model_len``; a session that outgrows it fails mid-turn with
    HTTP 400, so a backend that cannot hold prefix + --session-budget is refused at start,
    with the fix in the message. (No tokenizer: "PREFIX" counts as 2 tokens.)"""

    def route(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [
                {"id": "smollm2", "owned_by": "vllm", "max_model_len": max_model_len}]})
        return httpx.Response(200, json={"choices": [{"text": "x"}]})

    http = httpx.AsyncClient(transport=httpx.MockTransport(route))
    eng = OpenAIEngine(BackendConfig(url="http://backend", poll_metrics=False,
                                     session_budget=2048), "PREFIX", http=http)
    if ok:
        await eng.start()
    else:
        with pytest.raises(ModelError, match=r"--max-model-len 2050\) .*--session-budget to 2047"):
            await eng.start()
    await eng.aclose()
