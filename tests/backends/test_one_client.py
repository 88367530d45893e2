"""One HTTP client per object's life (issue 26 follow-up): ``mesh serve`` builds and serves on
one loop, so :class:`OpenAIEngine` makes one client (in ``start``), closes it once in
``aclose``, cancels its background tasks there, and refuses use after close with an error
naming the fix.

``httpx.AsyncClient`` is replaced by a counting subclass on a MockTransport, so what is
counted is exactly the clients the engine makes (no sockets).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import pytest

from mesh.backends.openai import BackendConfig, OpenAIEngine
from mesh.engine.config import SamplingParams

pytestmark = pytest.mark.anyio

Route = Callable[[httpx.Request], httpx.Response]


class Clients:
    """The clients made while installed, and how often each was closed."""

    def __init__(self, route: Route) -> None:
        self.made: list[httpx.AsyncClient] = []
        self.closes: list[httpx.AsyncClient] = []
        self.route = route

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        log = self

        class Counting(httpx.AsyncClient):  # defined before the patch: the real base
            def __init__(self, **kw: Any) -> None:
                super().__init__(transport=httpx.MockTransport(log.route), **kw)
                log.made.append(self)

            async def aclose(self) -> None:
                log.closes.append(self)
                await super().aclose()

        monkeypatch.setattr(httpx, "AsyncClient", Counting)


def backend(request: httpx.Request) -> httpx.Response:
    """A completions server: one model, Prometheus metrics, "ok" streamed."""
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"data": [{"id": "m", "owned_by": "llamacpp"}]})
    if request.url.path == "/metrics":
        return httpx.Response(200, text="llamacpp:requests_processing 1\n")
    if not json.loads(request.content).get("stream"):  # the warm-up
        return httpx.Response(200, json={"choices": [{"text": "x"}]})
    chunks = [{"choices": [{"index": 0, "text": "ok", "finish_reason": None}]},
              {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}]
    data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return httpx.Response(200, content=data + b"data: [DONE]\n\n")


async def test_openai_engine_starts_and_serves_on_one_client_closed_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The client that listed the models and warmed the prefix is the one the turns use
    (it used to be closed at the end of start and made anew); the metrics poll runs from
    start on; aclose cancels it and closes the client once; use after close is refused."""
    clients = Clients(backend)
    clients.install(monkeypatch)
    eng = OpenAIEngine(BackendConfig(url="http://backend", poll_metrics=True), "PREFIX")
    await eng.start()
    poll = eng._metrics_task
    assert poll is not None and not poll.done()  # started by start, not by a first use
    with anyio.fail_after(5):
        while eng.backend_metrics() is None:
            await anyio.sleep(0.01)
    s = await eng.attach()
    s.append("hi")
    gen = s.generate(SamplingParams(max_tokens=4, temperature=0.0))
    assert "".join([p.text async for p in gen]) == "ok"
    await s.detach()
    assert len(clients.made) == 1 and not clients.closes
    (client,) = clients.made
    await eng.aclose()
    await eng.aclose()  # idempotent
    assert clients.closes == [client] and client.is_closed
    assert poll.cancelled()
    with pytest.raises(RuntimeError, match=r"engine is closed.*new OpenAIEngine"):
        _ = eng.http
    assert len(clients.made) == 1  # nothing made after close


async def test_openai_engine_leaves_a_given_client_open() -> None:
    http = httpx.AsyncClient(transport=httpx.MockTransport(backend))
    eng = OpenAIEngine(BackendConfig(url="http://backend", poll_metrics=False), "PREFIX",
                       http=http)
    await eng.start()
    assert eng.http is http
    await eng.aclose()
    assert not http.is_closed  # its owner's to close
    await http.aclose()

