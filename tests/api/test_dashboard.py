"""GET /dashboard, its assets, the SSE feed and the history over FakeEngine + FloorGate;
TaskBoard units."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from a2a.types import a2a_pb2 as pb
from starlette.applications import Starlette
from starlette.middleware import Middleware
from uvicorn import Config, Server

from mesh.a2a.app import BearerAuth
from mesh.a2a.store import TaskBoard, open_stores, owner_context
from mesh.api.dashboard import (
    DASHBOARD_PUBLIC_PATHS,
    DashboardHistory,
    dashboard_routes,
    finite,
    sample_of,
)
from mesh.api.sessions import api_routes
from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from mesh.sim.fake import FakeEngine
from mesh.sim.processes import free_port

pytestmark = pytest.mark.anyio

TOKEN = "s3cret-token"


def _app(
    engine: FakeEngine, gate: FloorGate, board: TaskBoard, *, token: str | None = None, **kw: Any
) -> Starlette:
    routes = [*api_routes(engine, gate), *dashboard_routes(gate, tasks=board, **kw)]
    tokens = [token] if token else []
    mw = [Middleware(BearerAuth, tokens=tokens, public_paths=DASHBOARD_PUBLIC_PATHS)]
    return Starlette(routes=routes, middleware=mw)


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, FakeEngine, FloorGate, TaskBoard]]:
    """A real uvicorn server (SSE needs real streaming, which ASGITransport buffers)."""
    engine = FakeEngine(prefix_tokens=100)
    gate = FloorGate(engine, GateConfig.create(floor_tps=3.0, policy="floor", max_queue=5))
    board = TaskBoard()
    app = _app(engine, gate, board, interval_s=0.2, max_stream_s=1.0, max_streams=2)
    port = free_port()
    server = Server(Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        with anyio.fail_after(10):
            while not server.started:
                await anyio.sleep(0.02)
        yield f"http://127.0.0.1:{port}", engine, gate, board
        server.should_exit = True


async def _frames(client: httpx.AsyncClient, url: str, n: int) -> list[dict[str, Any]]:
    frames: list[dict[str, Any]] = []
    async with client.stream("GET", url + "/dashboard/events") as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and "capacity" in line:
                frames.append(json.loads(line[6:]))
                if len(frames) == n:
                    break
    return frames


async def test_page_and_assets_are_served(served: Any) -> None:
    url = served[0]
    async with httpx.AsyncClient() as client:
        page = await client.get(url + "/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        for ident in ("chart", "verdict", "kvReduction", "tasksTable", "workersTable", "auth",
                      "parkChart", "pAttached", "pResident", "pParked", "pParkedCells",
                      "pBytes", "pMemory"):
            assert f'id="{ident}"' in page.text
        js = await client.get(url + "/dashboard/assets/dashboard.js")
        assert js.status_code == 200 and "javascript" in js.headers["content-type"]
        assert "window.meshDashboard" in js.text and "http" not in js.text.split("fetch(")[1][:20]
        css = await client.get(url + "/dashboard/assets/dashboard.css")
        assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
        assert (await client.get(url + "/dashboard/assets/nope.js")).status_code == 404


async def test_frames_carry_the_capacity_document(served: Any) -> None:
    url, _, gate, board = served
    board.update("t-1", "working")
    async with httpx.AsyncClient() as client:
        for _ in range(2):
            sid = (await client.post(url + "/v1/sessions", json={})).json()["id"]
            r = await client.post(
                url + f"/v1/sessions/{sid}/turns", json={"text": "a b", "max_tokens": 4}
            )
            assert r.status_code == 200
        cap = (await client.get(url + "/capacity")).json()
        frames = await _frames(client, url, 2)
    assert frames[1]["t"] > frames[0]["t"]
    last = frames[-1]
    assert set(last) == {"t", "capacity", "tasks"}
    assert set(last["capacity"]) == set(cap)
    for key in ("floor_tps", "policy", "sessions", "kv_cells", "max_queue", "headroom"):
        assert last["capacity"][key] == cap[key], key
    workers = last["capacity"]["workers"]
    assert len(workers) == 2
    assert set(workers[0]) == {"id", "state", "decodeTps", "dutyCycle", "privateCells", "ageS",
                               "turnPlace"}
    assert sum(w["privateCells"] for w in workers) == cap["kv_cells"]["used"] - 100
    assert last["tasks"]["running"] == 1 and last["tasks"]["live"][0]["id"] == "t-1"
    assert gate.num_tickets == 2


async def test_stream_ends_and_max_streams_then_recovers(served: Any) -> None:
    url = served[0]
    async with httpx.AsyncClient(timeout=10) as client:
        async with client.stream("GET", url + "/dashboard/events") as a, client.stream(
            "GET", url + "/dashboard/events"
        ) as b:
            assert a.status_code == b.status_code == 200
            third = await client.get(url + "/dashboard/events")
            assert third.status_code == 429
            assert int(third.headers["Retry-After"]) >= 1
            assert "streams are open" in third.json()["error"]["message"]
            # max_stream_s=1: the stream closes itself with an end event.
            with anyio.fail_after(5):
                text = "".join([chunk async for chunk in a.aiter_text()])
            assert text.rstrip().endswith('data: {"reason": "max_stream_s"}')
            assert "event: end" in text
        with anyio.fail_after(5):
            while True:  # both slots come back once the streams are closed
                async with client.stream("GET", url + "/dashboard/events") as c:
                    if c.status_code == 200:
                        break
                await anyio.sleep(0.05)


async def test_events_need_the_token_the_page_does_not() -> None:
    engine = FakeEngine(prefix_tokens=10)
    gate = FloorGate(engine, GateConfig.create(floor_tps=3.0))
    app = _app(engine, gate, TaskBoard(), token=TOKEN)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://mesh") as client:
        for path in DASHBOARD_PUBLIC_PATHS:
            assert (await client.get(path)).status_code == 200, path
        r = await client.get("/dashboard/events")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        assert (await client.get("/capacity")).status_code == 401


def test_bad_settings_are_refused() -> None:
    gate = FloorGate(FakeEngine(prefix_tokens=10), GateConfig.create(floor_tps=3.0))
    for kw in ({"interval_s": 0.0}, {"max_stream_s": 0.0}, {"max_streams": 0},
               {"max_streams_per_caller": 0}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            dashboard_routes(gate, tasks=None, **kw)


def test_finite_turns_nan_into_null() -> None:
    doc = {"a": math.nan, "b": [1.0, math.inf], "c": {"d": -math.inf, "e": 2}, "f": "x"}
    assert finite(doc) == {"a": None, "b": [1.0, None], "c": {"d": None, "e": 2}, "f": "x"}


def _task(tid: str, state: pb.TaskState) -> pb.Task:
    return pb.Task(id=tid, context_id="c", status=pb.TaskStatus(state=state))


def test_taskboard_tracks_live_and_recent() -> None:
    now = [100.0]
    board = TaskBoard(max_live=3, max_recent=2, clock=lambda: now[0])
    board.observe(_task("a", pb.TASK_STATE_SUBMITTED))
    board.observe(_task("b", pb.TASK_STATE_WORKING))
    now[0] = 102.0
    board.observe(_task("a", pb.TASK_STATE_WORKING))
    snap = board.snapshot()
    assert (snap["running"], snap["queued"], snap["finishedTotal"]) == (2, 0, 0)
    assert snap["live"][0] == {"id": "a", "state": "working", "ageS": 2.0}
    now[0] = 105.0
    board.observe(_task("a", pb.TASK_STATE_COMPLETED))
    board.observe(_task("a", pb.TASK_STATE_COMPLETED))  # saved again: counted once
    board.observe(_task("c", pb.TASK_STATE_SUBMITTED))
    snap = board.snapshot()
    assert (snap["running"], snap["queued"], snap["finishedTotal"]) == (1, 1, 1)
    assert snap["recent"] == [{"id": "a", "state": "completed", "ageS": 5.0}]
    for tid in ("d", "e", "f"):
        board.observe(_task(tid, pb.TASK_STATE_WORKING))
    assert [r["id"] for r in board.snapshot()["live"]] == ["d", "e", "f"]  # bounded
    for tid in ("x", "y", "z"):
        board.observe(_task(tid, pb.TASK_STATE_FAILED))
    snap = board.snapshot()
    assert [r["id"] for r in snap["recent"]] == ["z", "y"] and snap["finishedTotal"] == 4
    with pytest.raises(ValueError, match="max_live"):
        TaskBoard(max_live=0)


async def test_the_task_store_reports_only_accepted_saves(tmp_path: Any) -> None:
    board = TaskBoard()
    stores = open_stores(tmp_path)
    await stores.initialize()
    stores.tasks.on_saved = board.observe
    await stores.tasks.save(_task("ok", pb.TASK_STATE_WORKING), owner_context(""))
    await stores.aclose()
    with pytest.raises(RuntimeError):  # the store is closed: the save is refused
        await stores.tasks.save(_task("boom", pb.TASK_STATE_WORKING), owner_context(""))
    assert [r["id"] for r in board.snapshot()["live"]] == ["ok"]


def test_simulate_prints_the_dashboard_of_the_server_it_starts(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from mesh.cli.simulate import _watched
    from mesh.sim.processes import serve_command
    from mesh.sim.scenario import SimConfig

    config = SimConfig()
    assert _watched(config)(8123, tmp_path) == serve_command(config, 8123, tmp_path)
    assert "dashboard: http://127.0.0.1:8123/dashboard" in capsys.readouterr().err


# ---------------------------------------------------------------- history (issue 30 item 2)


class _Cap:
    """An admission whose capacity document the test sets (only ``capacity`` is read)."""

    def __init__(self) -> None:
        self.doc: dict[str, Any] = {}
        self.reads = 0

    def capacity(self) -> dict[str, Any]:
        self.reads += 1
        return self.doc


def _cap_doc(tps: float, queue: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "floor_tps": 5.0, "verdict": "admit", "admitted_total": 3, "refused_total": 1,
        "queue_len": queue, "max_queue": 10,
        "kv_cells": {"used": 150, "prefix": 100, "total": 400, "reduction": 2.0},
        "workers": [{"id": "w1", "decodeTps": tps}, {"id": "w2", "decodeTps": None}],
        **extra,
    }


def test_history_keeps_a_bounded_window_of_samples() -> None:
    now = [1000.0]
    cap = _Cap()
    history = DashboardHistory(cap, interval_s=1.0, window_s=10.0,  # type: ignore[arg-type]
                               clock=lambda: now[0])
    for i in range(50):
        cap.doc = _cap_doc(tps=float(i), queue=i % 3)
        history.sample()
        now[0] += 1.0
    # The ring's length is fixed by the settings (11), whatever the traffic.
    assert history._ring.maxlen == 11 and len(history._ring) == 11
    samples = history.samples()  # and what is older than the window is not served
    assert [s["t"] for s in samples] == [1040.0 + i for i in range(10)]
    last = samples[-1]
    assert last == {
        "t": 1049.0, "floor": 5.0, "verdict": "admit", "admitted": 3, "refused": 1,
        "queue": 49 % 3, "maxQueue": 10, "waiting": None,
        "cells": {"used": 150, "prefix": 100, "total": 400},
        "parking": {"attached": None, "resident": None, "parked": None, "parkedCells": None,
                    "parkedBytes": None},
        "workers": [["w1", 49.0]],  # a worker with no measured tok/s is not a point
    }
    now[0] += 60.0  # nothing sampled for a minute: the window is empty
    assert history.samples() == []
    with pytest.raises(ValueError, match="window_s"):
        DashboardHistory(cap, interval_s=2.0, window_s=1.0)  # type: ignore[arg-type]


def test_sample_keeps_resident_and_parked_sessions_cells_and_host_bytes() -> None:
    """Issue 28: the history carries the parking block, so the page's sessions chart has
    a past; junk in it reads as null."""
    parking = {"max_attached": 16, "resident": 4, "parked": 9, "parked_tokens": 5000,
               "parks": 30, "resumes": 21, "swaps": 12, "parked_bytes": 115_200_000}
    s = sample_of(_cap_doc(3.0, sessions={"total": 13}, parking=parking), 5.0)
    assert s["parking"] == {"attached": 13, "resident": 4, "parked": 9, "parkedCells": 5000,
                            "parkedBytes": 115_200_000}
    junk = sample_of(_cap_doc(3.0, sessions=[], parking={"parked": "x"}), 6.0)
    assert junk["parking"]["attached"] is None and junk["parking"]["parked"] is None


async def test_frames_and_history_carry_parking(served: Any) -> None:
    url, _, gate, _ = served
    async with httpx.AsyncClient() as client:
        sid = (await client.post(url + "/v1/sessions", json={})).json()["id"]
        assert sid
        frames = await _frames(client, url, 1)
    parking = frames[-1]["capacity"]["parking"]
    assert {"resident", "parked", "parked_tokens", "parked_bytes", "max_attached"} <= set(parking)
    assert frames[-1]["capacity"]["sessions"]["total"] == 1
    kept = DashboardHistory(gate).sample()  # what /dashboard/history serves
    assert kept["parking"]["attached"] == 1
    assert kept["parking"]["resident"] == parking["resident"]


def test_sample_reads_fields_defensively() -> None:
    # The node pool's document has no floor, workers or cells; a gate with a decode queue
    # reports turns.waiting; NaN and junk become null.
    assert sample_of({"verdict": "wait", "queue_len": 2}, 1.0) == {
        "t": 1.0, "floor": None, "verdict": "wait", "admitted": None, "refused": None,
        "queue": 2, "maxQueue": None, "waiting": None,
        "cells": {"used": None, "prefix": None, "total": None},
        "parking": {"attached": None, "resident": None, "parked": None, "parkedCells": None,
                    "parkedBytes": None},
        "workers": [],
    }
    s = sample_of(_cap_doc(math.nan, turns={"waiting": 4}), 2.0)
    assert s["waiting"] == 4 and s["workers"] == []
    assert sample_of({"turns": "x", "workers": "y", "kv_cells": 3}, 3.0)["waiting"] is None
    many = {"workers": [{"id": i, "decodeTps": 1.0} for i in range(100)]}
    assert len(sample_of(many, 4.0, max_workers=8)["workers"]) == 8


async def test_history_is_sampled_on_a_timer_and_served_behind_auth() -> None:
    engine = FakeEngine(prefix_tokens=10)
    gate = FloorGate(engine, GateConfig.create(floor_tps=3.0))
    history = DashboardHistory(gate, interval_s=0.05, window_s=60.0)
    app = _app(engine, gate, TaskBoard(), token=TOKEN, history=history)
    await history.start()  # what serve's on_startup does: no dashboard request needed
    try:
        with anyio.fail_after(5):
            while len(history.samples()) < 4:
                await anyio.sleep(0.02)
    finally:
        await history.aclose()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://mesh") as client:
        assert (await client.get("/dashboard/history")).status_code == 401
        r = await client.get("/dashboard/history", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    doc = r.json()
    assert doc["windowS"] == 60.0 and doc["intervalS"] == 0.05
    ts = [s["t"] for s in doc["samples"]]
    assert len(ts) >= 4 and ts == sorted(ts)
    assert all(s["floor"] == 3.0 and s["cells"]["prefix"] == 10 for s in doc["samples"])


async def test_history_starts_with_the_first_dashboard_request() -> None:
    cap = _Cap()
    cap.doc = _cap_doc(tps=7.0)
    app = Starlette(routes=dashboard_routes(cap, tasks=None))  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://mesh") as client:
        assert (await client.get("/dashboard/history")).json()["samples"] == []
        with anyio.fail_after(5):  # the default sampler: one sample a second
            while not (await client.get("/dashboard/history")).json()["samples"]:
                await anyio.sleep(0.1)


# ------------------------------------------- per-caller dashboard streams (issue 27 hole 5)


@contextlib.asynccontextmanager
async def _uvicorn(app: Starlette) -> AsyncIterator[str]:
    port = free_port()
    server = Server(Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        with anyio.fail_after(10):
            while not server.started:
                await anyio.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True


async def test_one_caller_cannot_take_every_dashboard_stream() -> None:
    engine = FakeEngine(prefix_tokens=10)
    gate = FloorGate(engine, GateConfig.create(floor_tps=3.0))
    routes = dashboard_routes(gate, tasks=None, max_streams=4, max_streams_per_caller=2)
    app = Starlette(routes=routes, middleware=[
        Middleware(BearerAuth, tokens=["a-token", "b-token", "c-token"],
                   public_paths=DASHBOARD_PUBLIC_PATHS)])
    auth = {name: {"Authorization": f"Bearer {name}-token"} for name in ("a", "b", "c")}
    async with _uvicorn(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        async with contextlib.AsyncExitStack() as a_streams:
            # A asks for every slot there is: it gets its share, no more.
            codes = []
            for _ in range(4):
                r = await a_streams.enter_async_context(
                    client.stream("GET", "/dashboard/events", headers=auth["a"]))
                codes.append(r.status_code)
                if r.status_code == 429:
                    await r.aread()
                    message = r.json()["error"]["message"]
                    assert "this caller has 2 dashboard streams open" in message
            assert codes == [200, 200, 429, 429]
            # B is not starved by A.
            async with client.stream("GET", "/dashboard/events", headers=auth["b"]) as b1, \
                    client.stream("GET", "/dashboard/events", headers=auth["b"]) as b2:
                assert b1.status_code == b2.status_code == 200
                # The global limit still holds: 4 open, C waits.
                c = await client.get("/dashboard/events", headers=auth["c"])
                assert c.status_code == 429 and "4 dashboard streams are open" in c.text
        # A closed its streams: its share is back.
        with anyio.fail_after(5):
            while True:
                async with client.stream("GET", "/dashboard/events", headers=auth["a"]) as r:
                    if r.status_code == 200:
                        break
                await anyio.sleep(0.05)


async def test_without_auth_the_one_caller_may_use_every_stream() -> None:
    engine = FakeEngine(prefix_tokens=10)
    gate = FloorGate(engine, GateConfig.create(floor_tps=3.0))
    app = _app(engine, gate, TaskBoard(), max_streams=3, max_streams_per_caller=1)
    async with _uvicorn(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as client, \
            contextlib.AsyncExitStack() as streams:
        for _ in range(3):
            r = await streams.enter_async_context(client.stream("GET", "/dashboard/events"))
            assert r.status_code == 200
        assert (await client.get("/dashboard/events")).status_code == 429
