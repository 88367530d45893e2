"""The whole app of ``mesh serve`` (coordinator + ``/capacity``, ``/metrics``,
``/v1/sessions``) on the fake engine, in-process over ``httpx.ASGITransport``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette

from mesh.a2a.app import build_app
from mesh.a2a.config import CoordinatorConfig
from mesh.api.sessions import SessionAPI, api_routes
from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from mesh.sim.fake import FakeEngine
from tests.support.coord_helpers import Probe, ScriptedWorker


@dataclass
class FakeStack:
    client: httpx.AsyncClient
    app: Starlette
    engine: FakeEngine
    gate: FloorGate
    probe: Probe
    sessions: SessionAPI


@asynccontextmanager
async def fake_stack(
    tmp: Path, *, policy: str = "none", max_queue: int = 16, **coord: Any
) -> AsyncIterator[FakeStack]:
    engine = FakeEngine(max_sessions=4, session_budget=256)
    gate = FloorGate(engine, GateConfig.create(policy=policy, max_queue=max_queue))
    probe = Probe()
    probe.unblock.set()  # "block ..." tasks finish at once unless a test clears it
    sessions = SessionAPI(engine, gate)
    app = build_app(
        CoordinatorConfig(data_dir=str(tmp / "data"), **coord),
        worker_factory=lambda: ScriptedWorker(probe),
        admission=gate,
        pool_info=engine.info,
        extra_routes=api_routes(engine, gate, sessions),
        on_shutdown=[sessions.aclose],
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://mesh", headers={"A2A-Version": "1.0"}
        ) as client:
            yield FakeStack(client, app, engine, gate, probe, sessions)
    await engine.aclose()
