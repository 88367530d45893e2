"""Fixtures of the A2A server tests: the app over ``httpx.ASGITransport`` (lifespan run)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from mesh.a2a.app import build_app
from mesh.a2a.config import CoordinatorConfig
from tests.support.coord_helpers import POOL_INFO, FakeAdmission, Probe, ScriptedWorker


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


AsgiFactory = Callable[..., AbstractAsyncContextManager[tuple[httpx.AsyncClient, Starlette]]]


@pytest.fixture
def asgi(tmp_path: Path) -> AsgiFactory:
    """``async with asgi(**config) as (client, app)``: the app with its lifespan running."""

    @asynccontextmanager
    async def make(
        *, admission: FakeAdmission | None = None, extra_routes: Any = (), **config: Any
    ) -> AsyncIterator[tuple[httpx.AsyncClient, Starlette]]:
        config.setdefault("data_dir", str(tmp_path / "data"))
        probe = Probe()
        app = build_app(
            CoordinatorConfig(allow_private_push=True, **config),
            worker_factory=lambda: ScriptedWorker(probe),
            admission=admission or FakeAdmission(),
            pool_info=POOL_INFO,
            extra_routes=extra_routes,
        )
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://testserver", headers={"A2A-Version": "1.0"}
            ) as client:
                yield client, app

    return make
