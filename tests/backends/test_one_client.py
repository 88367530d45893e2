"""One HTTP client per object's life (issue 26 follow-up): ``mesh serve`` builds and serves on
one loop, so :class:`NodePool`, :class:`NodeClient` and :class:`OpenAIEngine` each make one
client (on first use, or in ``start``), close it once in ``aclose``, cancel their
background tasks there, and refuse use after close with an error naming the fix.

``httpx.AsyncClient`` is replaced by a counting subclass on a MockTransport, so what is
counted is exactly the clients these classes make (no sockets).
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
from mesh.fleet.node_cards import Node
from mesh.fleet.node_worker import NodeClient
from mesh.fleet.nodes import NodePool

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


def capacity(request: httpx.Request) -> httpx.Response:
    """Every node admits, with room for 4."""
    return httpx.Response(200, json={"verdict": "admit", "headroom": 4,
                                     "sessions": {"total": 0}})


async def test_node_pool_holds_one_client_and_closes_it_with_its_tasks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Polls, the first admission and a capacity re-read all go through one client; aclose
    cancels the poller and the re-reads and closes the client once; afterwards /capacity
    still reports (polling nothing) and admit is refused naming the fix."""
    clients = Clients(capacity)
    clients.install(monkeypatch)
    pool = NodePool([Node(url="http://a"), Node(url="http://b")], poll_s=0.01)
    ticket = await pool.admit("t/s1")
    pool.answered(ticket.node)  # a re-read of that node's capacity, in the background
    await anyio.sleep(0.05)  # a few polls
    assert pool.capacity()["verdict"] == "admit"
    poller = pool._poller
    assert poller is not None and not poller.done()
    pool.answered(ticket.node)
    background = list(pool._background)
    await ticket.release()
    assert len(clients.made) == 1 and not clients.closes
    await pool.aclose()
    await pool.aclose()  # idempotent
    assert clients.closes == clients.made and clients.made[0].is_closed
    assert poller.done() and pool._poller is None
    assert all(t.done() for t in background) and not pool._background
    assert pool.capacity()["nodes"][0]["up"]  # what was known; no poller restarted
    assert pool._poller is None
    pool.answered(ticket.node)  # a late answer re-reads nothing
    assert not pool._background
    with pytest.raises(RuntimeError, match=r"node pool is closed.*new NodePool"):
        await pool.admit("t/s2")
    assert len(clients.made) == 1


async def test_node_client_holds_one_client_closed_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clients = Clients(capacity)
    clients.install(monkeypatch)
    client = NodeClient(token="t")
    first = client.http
    assert client.http is first and first.headers["authorization"] == "Bearer t"
    await client.aclose()
    await client.aclose()  # idempotent
    assert clients.closes == [first] and first.is_closed
    with pytest.raises(RuntimeError, match=r"node client is closed.*new NodeClient"):
        _ = client.http
    assert clients.made == [first]
