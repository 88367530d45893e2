"""The session API over FakeEngine and FloorGate, through httpx.ASGITransport."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from httpx_sse import aconnect_sse
from starlette.applications import Starlette
from starlette.types import Message

from mesh.api.sessions import SessionAPI
from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from mesh.sim.fake import FakeEngine

pytestmark = pytest.mark.anyio


class Mesh:
    def __init__(self, policy: str = "floor", max_queue: int = 8, max_workers: int | None = None,
                 **engine_kw: Any) -> None:
        self.engine = FakeEngine(**engine_kw)
        config = GateConfig.create(floor_tps=1.0, policy=policy, max_queue=max_queue,
                                   max_workers=max_workers)
        self.gate = FloorGate(self.engine, config)
        self.api = SessionAPI(self.engine, self.gate)
        self.app = Starlette(routes=self.api.routes)
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://mesh"
        )

    async def create(self, **body: Any) -> str:
        r = await self.client.post("/v1/sessions", json=body)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    m = Mesh()
    async with m.client:
        yield m
    await m.api.aclose()


def error_code(r: httpx.Response) -> str:
    body = r.json()
    assert set(body["error"]) == {"code", "message"} and body["error"]["message"]
    return str(body["error"]["code"])


async def test_attach_with_empty_or_no_body(mesh: Mesh) -> None:
    r = await mesh.client.post("/v1/sessions", json={})
    assert r.status_code == 201
    sid = r.json()["id"]
    assert r.headers["location"] == f"/v1/sessions/{sid}"
    assert r.json()["context_len"] == 100
    r = await mesh.client.post("/v1/sessions", content=b"")
    assert r.status_code == 201
    assert mesh.gate.num_tickets == 2
    listed = (await mesh.client.get("/v1/sessions")).json()["sessions"]
    assert {s["id"] for s in listed} == {sid, r.json()["id"]}
    assert all(s["state"] == "idle" and s["in_turn"] is False for s in listed)


async def test_turn_returns_json(mesh: Mesh) -> None:
    sid = await mesh.create()
    r = await mesh.client.post(
        f"/v1/sessions/{sid}/turns", json={"text": "alpha beta", "max_tokens": 3}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == "alpha beta alpha"
    assert body["finish_reason"] == "length" and body["num_generated"] == 3
    assert body["context_len"] == 100 + 2 + 3
    got = (await mesh.client.get(f"/v1/sessions/{sid}")).json()
    assert got["context_len"] == 105 and got["num_generated"] == 3


async def test_turn_streams_tokens_then_done(mesh: Mesh) -> None:
    sid = await mesh.create()
    events = []
    async with aconnect_sse(
        mesh.client,
        "POST",
        f"/v1/sessions/{sid}/turns",
        json={"text": "one two", "max_tokens": 4, "stream": True},
    ) as source:
        assert source.response.headers["content-type"].startswith("text/event-stream")
        async for sse in source.aiter_sse():
            events.append((sse.event, json.loads(sse.data)))
    assert [e for e, _ in events] == ["token"] * 4 + ["done"]
    assert "".join(d["text"] for _, d in events[:-1]) == "one two one two"
    assert events[-1][1]["finish_reason"] == "length"
    # The session is free for the next turn.
    r = await mesh.client.post(f"/v1/sessions/{sid}/turns", json={"text": "x", "max_tokens": 1})
    assert r.status_code == 200


async def test_delete_detaches_and_releases(mesh: Mesh) -> None:
    sid = await mesh.create()
    r = await mesh.client.delete(f"/v1/sessions/{sid}")
    assert r.status_code == 204 and r.content == b""
    assert mesh.gate.num_tickets == 0 and not mesh.engine.sessions
    assert (await mesh.client.get(f"/v1/sessions/{sid}")).status_code == 404


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/sessions/nope", None),
        ("DELETE", "/v1/sessions/nope", None),
        ("POST", "/v1/sessions/nope/turns", {"text": "hi"}),
    ],
)
async def test_unknown_ids_are_404(
    mesh: Mesh, method: str, path: str, body: dict[str, Any] | None
) -> None:
    r = await mesh.client.request(method, path, json=body)
    assert r.status_code == 404
    assert error_code(r) == "not_found"


@pytest.mark.parametrize(
    ("content", "status", "code"),
    [
        (b"{not json", 400, "bad_json"),
        (b"\xff\xfe", 400, "bad_json"),
        (b"[]", 422, "invalid_request"),
        (b'{"max_tokens": 5}', 422, "invalid_request"),  # text is required
        (b'{"text": "x", "bogus": 1}', 422, "invalid_request"),  # extra="forbid"
        (b'{"text": "x", "max_tokens": "5"}', 422, "invalid_request"),  # strict types
        (b'{"text": "x", "max_tokens": 0}', 422, "invalid_request"),
        (b'{"text": "x", "max_tokens": 100000}', 422, "invalid_request"),  # > session budget
        (b'{"text": "x", "temperature": -1}', 422, "invalid_request"),
        (b'{"text": "x", "top_p": 0}', 422, "invalid_request"),
        (b'{"text": "x", "stop": [""]}', 422, "invalid_request"),
        (b'{"text": "x", "stream": "yes"}', 422, "invalid_request"),
    ],
)
async def test_malformed_turns(mesh: Mesh, content: bytes, status: int, code: str) -> None:
    sid = await mesh.create()
    r = await mesh.client.post(f"/v1/sessions/{sid}/turns", content=content)
    assert r.status_code == status, r.text
    assert error_code(r) == code
    # Nothing reached the engine; the session still works.
    r = await mesh.client.post(f"/v1/sessions/{sid}/turns", json={"text": "ok", "max_tokens": 1})
    assert r.status_code == 200


@pytest.mark.parametrize("content", [b'{"wat": 1}', b'{"key": 5}', b'{"max_wait_s": -1}', b"{"])
async def test_malformed_attach(mesh: Mesh, content: bytes) -> None:
    r = await mesh.client.post("/v1/sessions", content=content)
    assert r.status_code in (400, 422)
    assert error_code(r) in ("bad_json", "invalid_request")
    assert mesh.gate.num_tickets == 0


async def test_refused_attach_is_429_with_retry_after() -> None:
    m = Mesh(policy="none", max_workers=1, max_queue=0)
    async with m.client:
        await m.create()
        r = await m.client.post("/v1/sessions", json={})
        assert r.status_code == 429
        assert error_code(r) == "queue_full"
        assert int(r.headers["retry-after"]) >= 1
        assert m.gate.num_tickets == 1
    await m.api.aclose()
    assert m.gate.num_tickets == 0


async def test_attach_that_waits_too_long_is_429() -> None:
    m = Mesh(policy="none", max_workers=1, max_queue=4)
    async with m.client:
        await m.create()
        r = await m.client.post("/v1/sessions", json={"max_wait_s": 0.02})
        assert r.status_code == 429 and error_code(r) == "not_admitted"
        assert int(r.headers["retry-after"]) >= 1
        assert m.gate.queue_len == 0 and m.gate.num_tickets == 1
    await m.api.aclose()


async def test_context_overflow_is_422_and_the_session_survives() -> None:
    m = Mesh(session_budget=20)
    async with m.client:
        sid = await m.create()
        r = await m.client.post(f"/v1/sessions/{sid}/turns", json={"text": "w " * 30})
        assert r.status_code == 422 and error_code(r) == "context_overflow"
        r = await m.client.post(f"/v1/sessions/{sid}/turns", json={"text": "hi", "max_tokens": 2})
        assert r.status_code == 200
    await m.api.aclose()


async def test_failed_session_is_410_and_forgotten(mesh: Mesh) -> None:
    sid = await mesh.create()
    mesh.engine.fail_next = "decode failed"
    r = await mesh.client.post(f"/v1/sessions/{sid}/turns", json={"text": "hi"})
    assert r.status_code == 410 and error_code(r) == "session_failed"
    assert (await mesh.client.get(f"/v1/sessions/{sid}")).status_code == 404
    assert mesh.gate.num_tickets == 0


async def test_second_turn_while_one_runs_is_409() -> None:
    m = Mesh(step_delay_s=0.001)
    async with m.client:
        sid = await m.create()
        results: list[httpx.Response] = []

        async def long_turn() -> None:
            body = {"text": "a", "max_tokens": 200}
            results.append(await m.client.post(f"/v1/sessions/{sid}/turns", json=body))

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_turn)
            for _ in range(10_000):
                if m.engine.sessions[sid].num_generated:
                    break
                await anyio.sleep(0)
            r = await m.client.post(f"/v1/sessions/{sid}/turns", json={"text": "b"})
            assert r.status_code == 409 and error_code(r) == "session_busy"
        assert results[0].status_code == 200
    await m.api.aclose()


async def test_client_disconnect_stops_the_stream() -> None:
    """Drive the ASGI app by hand: the client goes away after the first token."""
    m = Mesh(step_delay_s=0.001)
    async with m.client:
        sid = await m.create()
    body = json.dumps({"text": "a b", "max_tokens": 1000, "stream": True}).encode()
    sent: list[Message] = []
    first_token = anyio.Event()
    request_sent = False

    async def receive() -> Message:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await first_token.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and b"event: token" in message["body"]:
            first_token.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": f"/v1/sessions/{sid}/turns",
        "raw_path": f"/v1/sessions/{sid}/turns".encode(),
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "server": ("mesh", 80),
        "client": ("127.0.0.1", 1234),
        "root_path": "",
    }
    with anyio.fail_after(30):
        await m.app(scope, receive, send)
    session = m.engine.sessions[sid]
    assert 1 <= session.num_generated < 1000
    assert sent[0]["status"] == 200
    # The turn ended cleanly: the session takes the next one.
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=m.app), base_url="http://mesh"
    ) as client:
        r = await client.post(f"/v1/sessions/{sid}/turns", json={"text": "c", "max_tokens": 1})
        assert r.status_code == 200
    await m.api.aclose()


async def test_aclose_detaches_everything(mesh: Mesh) -> None:
    for _ in range(3):
        await mesh.create()
    await mesh.api.aclose()
    assert not mesh.engine.sessions and mesh.gate.num_tickets == 0
    assert (await mesh.client.get("/v1/sessions")).json() == {"sessions": []}


async def test_sessions_are_scoped_to_their_caller() -> None:
    """With two tokens, caller B can neither see, drive nor delete caller A's session."""
    from mesh.a2a.app import BearerAuth

    m = Mesh()
    app = BearerAuth(m.app, ["token-a", "token-b"], public_paths=())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://mesh") as client:
        a = {"Authorization": "Bearer token-a"}
        b = {"Authorization": "Bearer token-b"}
        r = await client.post("/v1/sessions", json={}, headers=a)
        assert r.status_code == 201
        sid = r.json()["id"]
        listed = (await client.get("/v1/sessions", headers=a)).json()["sessions"]
        assert [s["id"] for s in listed] == [sid]
        assert (await client.get("/v1/sessions", headers=b)).json()["sessions"] == []
        for method, path, body in (("GET", f"/v1/sessions/{sid}", None),
                                   ("POST", f"/v1/sessions/{sid}/turns", {"text": "hi"}),
                                   ("DELETE", f"/v1/sessions/{sid}", None)):
            r = await client.request(method, path, json=body, headers=b)
            assert r.status_code == 404, (method, path, r.text)
        assert (await client.post(f"/v1/sessions/{sid}/turns", json={"text": "hi"},
                                  headers=a)).status_code == 200
        assert (await client.delete(f"/v1/sessions/{sid}", headers=a)).status_code == 204
    await m.api.aclose()


async def test_turn_json_names_the_stop_string(mesh: Mesh) -> None:
    sid = await mesh.create()
    r = await mesh.client.post(
        f"/v1/sessions/{sid}/turns",
        json={"text": "call a.py </call> more", "max_tokens": 10, "stop": ["</call>"]},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["finish_reason"] == "stop" and body["stop"] == "</call>"
    assert body["text"] == "call a.py "


# --------------------------------------------------------------------------- issue 12


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_idle_sessions_expire_release_and_answer_404_with_the_reason() -> None:
    clock = Clock()
    m = Mesh()
    m.api = SessionAPI(m.engine, m.gate, idle_s=300, clock=clock)
    m.app = Starlette(routes=m.api.routes)
    m.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=m.app), base_url="http://m")
    async with m.client:
        idle, busy = await m.create(), await m.create()
        clock.now += 200
        assert (await m.client.get(f"/v1/sessions/{busy}")).status_code == 200  # touches it
        clock.now += 150
        assert await m.api.expire_idle() == [idle]
        assert m.gate.num_tickets == 1 and idle not in m.engine.sessions
        for r in (
            await m.client.get(f"/v1/sessions/{idle}"),
            await m.client.post(f"/v1/sessions/{idle}/turns", json={"text": "a"}),
        ):
            assert r.status_code == 404 and error_code(r) == "expired"
            assert "300 s" in r.json()["error"]["message"]
    await m.api.aclose()
    assert m.gate.num_tickets == 0


async def test_the_reaper_expires_sessions_on_its_own() -> None:
    m = Mesh()
    m.api = SessionAPI(m.engine, m.gate, idle_s=0.2)
    m.app = Starlette(routes=m.api.routes)
    m.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=m.app), base_url="http://m")
    async with m.client:
        await m.create()
        with anyio.fail_after(5):
            while m.gate.num_tickets:
                await anyio.sleep(0.05)
    await m.api.aclose()


async def test_each_caller_has_a_cap() -> None:
    """An authenticated caller holds at most half the pool (the other half stays for the
    others); tests/api/test_session_caps.py has the concurrent and the auth-off cases."""
    from mesh.a2a.app import BearerAuth

    m = Mesh(max_sessions=8)
    app = BearerAuth(m.app, ["token-a", "token-b"], public_paths=())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://mesh") as client:
        assert m.api.max_per_caller == 4
        for _ in range(4):
            r = await client.post("/v1/sessions", json={},
                                  headers={"Authorization": "Bearer token-a"})
            assert r.status_code == 201, r.text
        r = await client.post("/v1/sessions", json={}, headers={"Authorization": "Bearer token-a"})
        assert r.status_code == 429 and error_code(r) == "too_many_sessions"
        assert "retry-after" in r.headers
        assert m.gate.num_tickets == 4
        r = await client.post("/v1/sessions", json={}, headers={"Authorization": "Bearer token-b"})
        assert r.status_code == 201, r.text
    await m.api.aclose()


async def test_a_bad_idle_timeout_is_refused() -> None:
    engine = FakeEngine()
    gate = FloorGate(engine, GateConfig.create(policy="none"))
    with pytest.raises(ValueError, match="idle timeout"):
        SessionAPI(engine, gate, idle_s=0)
