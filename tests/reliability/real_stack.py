"""The coordinator on the real engine (tiny model) in-process: what ``mesh serve`` wires,
minus the CLI, so a test can reach into the pool (monkeypatch a decode, read its cells)."""

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
from mesh.engine.config import EngineConfig
from mesh.engine.pool import SharedKVPool
from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from mesh.template.loader import load_template
from mesh.template.prefix import build_prefix
from mesh.worker.loop import AgentWorker
from mesh.worker.tools import ProjectTools
from tests.reliability.serve_proc import small_project


@dataclass
class RealStack:
    client: httpx.AsyncClient
    app: Starlette
    pool: SharedKVPool
    gate: FloorGate
    sessions: SessionAPI


@asynccontextmanager
async def real_stack(
    model: Path, tmp: Path, *, session_budget: int = 512, max_sessions: int = 4,
    native: bool | None = None, **coord: Any
) -> AsyncIterator[RealStack]:
    template = load_template("light")
    project = small_project(tmp / "project")
    prefix = build_prefix(template, project, lambda text: len(text) // 3, target_tokens=128)
    pool = SharedKVPool(
        EngineConfig(model_path=str(model), max_sessions=max_sessions,
                     session_budget=session_budget, n_threads=1, native=native),
        prefix.text,
    )
    info = await pool.start()
    try:
        gate = FloorGate(pool, GateConfig.create(policy="none", max_queue=16))
        tools = ProjectTools(project).as_tools()
        sessions = SessionAPI(pool, gate)
        app = build_app(
            CoordinatorConfig(data_dir=str(tmp / "data"), **coord),
            worker_factory=lambda: AgentWorker(pool, template, tools),
            admission=gate,
            pool_info=info,
            extra_routes=api_routes(pool, gate, sessions),
            on_shutdown=[sessions.aclose],
        )
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://mesh", headers={"A2A-Version": "1.0"},
                timeout=60,
            ) as client:
                yield RealStack(client, app, pool, gate, sessions)
    finally:
        await pool.aclose()
