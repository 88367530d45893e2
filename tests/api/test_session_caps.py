"""The session API's per-caller cap (issue 27, hole 5): checked and taken in one step, so
concurrent creates cannot all pass it; and with auth off the one caller may use the whole
pool. Over FakeEngine, whose attach yields to other tasks as the pool's does, and the tiny
model's pool.

Issue 42 item 4c: with parking on, "the whole pool" is what parking can hold attached
(``max_attached``, default 4 × ``max_sessions``), not the resident slots: on a real
``mesh serve --model tiny --max-sessions 4`` one caller's fifth idle session is created
(it parks another), and its turns run after a resume."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from mesh.a2a.app import BearerAuth
from mesh.api.sessions import SessionAPI
from mesh.engine.config import EngineConfig
from mesh.engine.interface import Engine
from mesh.engine.pool import SharedKVPool
from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from mesh.sim.fake import FakeEngine
from tests.reliability.serve_proc import running, small_project

pytestmark = pytest.mark.anyio

TOKENS = ("token-alpha-123", "token-bravo-456")


@asynccontextmanager
async def serve(*, auth: bool, max_sessions: int = 8, engine: Engine | None = None, **gate: Any
                ) -> AsyncIterator[tuple[httpx.AsyncClient, SessionAPI, FloorGate]]:
    engine = engine or FakeEngine(max_sessions=max_sessions)
    config = GateConfig.create(floor_tps=1.0, policy=gate.pop("policy", "none"),
                               max_queue=8, **gate)
    admission = FloorGate(engine, config)
    api = SessionAPI(engine, admission)
    app: Any = Starlette(routes=api.routes)
    if auth:
        app = BearerAuth(app, TOKENS, public_paths=())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://mesh") as client:
        try:
            yield client, api, admission
        finally:
            await api.aclose()


def as_caller(i: int) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[i]}"}


async def create_many(client: httpx.AsyncClient, n: int, headers: dict[str, str] | None = None,
                      ) -> list[httpx.Response]:
    return list(await asyncio.gather(*(
        client.post("/v1/sessions", json={}, headers=headers or {})
        for _ in range(n))))


async def test_concurrent_creates_cannot_all_pass_the_cap() -> None:
    """8 creates at once from one caller whose cap is 4: exactly 4 sessions, 4 refusals
    naming the cap (they were checked before an await, so all 8 got through)."""
    async with serve(auth=True) as (client, api, gate):
        assert api.max_per_caller == 4
        got = await create_many(client, 8, as_caller(0))
        codes = Counter(r.status_code for r in got)
        assert codes == {201: 4, 429: 4}, [r.text for r in got]
        assert all(r.json()["error"]["code"] == "too_many_sessions"
                   for r in got if r.status_code == 429)
        assert gate.num_tickets == 4 and len(api.engine.load().sessions) == 4
        # the other caller still gets its half of the pool
        other = await create_many(client, 4, as_caller(1))
        assert [r.status_code for r in other] == [201] * 4
        # a deleted session gives its place back to its caller
        sid = next(r.json()["id"] for r in got if r.status_code == 201)
        assert (await client.delete(f"/v1/sessions/{sid}", headers=as_caller(0))
                ).status_code == 204
        again = await client.post("/v1/sessions", json={}, headers=as_caller(0))
        assert again.status_code == 201, again.text


async def test_a_refused_create_gives_its_place_back() -> None:
    """A create the gate refuses does not keep the caller's place."""
    async with serve(auth=True, policy="none", max_workers=1,
                     max_queue_per_caller=1) as (client, api, _):
        first = await client.post("/v1/sessions", json={}, headers=as_caller(0))
        assert first.status_code == 201
        for _ in range(api.max_per_caller):  # not admitted within 0 s: 429, place given back
            r = await client.post("/v1/sessions", json={"max_wait_s": 0}, headers=as_caller(0))
            assert r.status_code == 429 and r.json()["error"]["code"] == "not_admitted"
        sid = first.json()["id"]
        assert (await client.delete(f"/v1/sessions/{sid}", headers=as_caller(0))
                ).status_code == 204
        r = await client.post("/v1/sessions", json={}, headers=as_caller(0))
        assert r.status_code == 201, r.text


@pytest.mark.parametrize("concurrent", [False, True])
async def test_without_auth_the_one_caller_may_use_the_whole_pool(concurrent: bool) -> None:
    """`--max-sessions 8` without auth: 8 sessions, not 4 and then 429."""
    async with serve(auth=False) as (client, api, gate):
        if concurrent:
            got = await create_many(client, 8)
        else:
            got = [await client.post("/v1/sessions", json={}) for _ in range(8)]
        assert [r.status_code for r in got] == [201] * 8, [r.text for r in got]
        assert gate.num_tickets == 8 and len(api.engine.load().sessions) == 8
        ninth = await client.post("/v1/sessions", json={})  # the pool is its cap: no wait
        assert ninth.status_code == 429 and ninth.json()["error"]["code"] == "too_many_sessions"


async def test_concurrent_creates_on_the_real_pool(tiny_model_path: Path) -> None:
    """The same on the tiny model's pool, whose attach runs on its engine thread (parking
    off: ``max_attached = max_sessions``, so the pool holds 8)."""
    pool = SharedKVPool(EngineConfig(model_path=str(tiny_model_path), max_sessions=8,
                                     max_attached=8, session_budget=64, n_threads=1), "prefix")
    await pool.start()
    try:
        async with serve(auth=True, engine=pool) as (client, _api, gate):
            got = await create_many(client, 8, as_caller(0))
            assert Counter(r.status_code for r in got) == {201: 4, 429: 4}
            assert gate.num_tickets == 4 and len(pool.load().sessions) == 4
        async with serve(auth=False, engine=pool) as (client, _api, gate):
            got = await create_many(client, 8)
            assert [r.status_code for r in got] == [201] * 8, [r.text for r in got]
    finally:
        await pool.aclose()


def _tiny_pool(model: Path, **config: Any) -> SharedKVPool:
    return SharedKVPool(EngineConfig(model_path=str(model), max_sessions=4, session_budget=64,
                                     n_threads=1, **config), "prefix")


async def test_with_parking_the_caps_count_what_parking_holds(tiny_model_path: Path) -> None:
    """4 resident slots, parking on (16 attached): each authenticated caller holds 8 at
    once, the anonymous caller 16; past that, 429 ``too_many_sessions`` naming the cap
    and ``--max-attached``."""
    pool = _tiny_pool(tiny_model_path)
    await pool.start()
    try:
        async with serve(auth=True, engine=pool) as (client, api, _):
            assert (api.capacity, api.max_per_caller) == (16, 8)
            got = await create_many(client, 10, as_caller(0))
            assert Counter(r.status_code for r in got) == {201: 8, 429: 2}, [r.text for r in got]
            refused = next(r for r in got if r.status_code == 429)
            error = refused.json()["error"]
            assert error["code"] == "too_many_sessions" and "Retry-After" in refused.headers
            assert "8 (max_per_caller, of the 16 sessions" in error["message"], error
            assert "--max-attached" in error["message"], error
            other = await create_many(client, 8, as_caller(1))  # the other caller's half
            assert [r.status_code for r in other] == [201] * 8, [r.text for r in other]
            load = pool.load()
            assert len(load.sessions) == 16 and load.num_parked >= 12
        async with serve(auth=False, engine=pool) as (client, api, _):
            got = [await client.post("/v1/sessions", json={}) for _ in range(17)]
            assert [r.status_code for r in got] == [201] * 16 + [429], [r.text for r in got]
            assert got[-1].json()["error"]["code"] == "too_many_sessions"
    finally:
        await pool.aclose()


async def test_with_parking_off_the_caps_count_the_slots(tiny_model_path: Path) -> None:
    """``max_attached = max_sessions`` (parking off): 4 for the anonymous caller, and the
    refusal says so, naming ``--max-attached`` as the way to hold more."""
    pool = _tiny_pool(tiny_model_path, max_attached=4)
    await pool.start()
    try:
        async with serve(auth=False, engine=pool) as (client, api, _):
            assert (api.capacity, api.max_per_caller) == (4, 2)
            got = [await client.post("/v1/sessions", json={}) for _ in range(5)]
            assert [r.status_code for r in got] == [201] * 4 + [429], [r.text for r in got]
            message = got[-1].json()["error"]["message"]
            assert "all of the pool's 4 session slots" in message, message
            assert "--max-attached" in message, message
    finally:
        await pool.aclose()


def test_mesh_serve_max_sessions_4_holds_a_fifth_idle_session(tmp_path: Path) -> None:
    """The issue's case on a real ``mesh serve --model tiny --max-sessions 4`` (auth off,
    default policy and parking): five idle sessions are created, the first (parked to make
    room) answers a turn, and the seventeenth is refused naming the cap."""
    project = small_project(tmp_path / "project")
    with running(tmp_path / "data", project, tmp_path / "cache",
                 "--max-sessions", "4") as served, httpx.Client(
                     base_url=served.url, timeout=60) as client:
        ids = []
        for _ in range(5):
            r = client.post("/v1/sessions", json={})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        r = client.post(f"/v1/sessions/{ids[0]}/turns", json={"text": "hello", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert 1 <= r.json()["num_generated"] <= 3, r.json()
        parking = client.get("/capacity").json()["parking"]
        assert parking["max_attached"] == 16 and parking["parks"] >= 1, parking
        for _ in range(11):
            assert client.post("/v1/sessions", json={}).status_code == 201
        r = client.post("/v1/sessions", json={})
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_sessions", r.text
        assert "16 sessions the pool can hold attached" in r.json()["error"]["message"]
