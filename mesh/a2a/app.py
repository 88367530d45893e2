"""The coordinator's ASGI app, assembled from the SDK's route factories.

``build_app`` builds every object here (no module-level singletons); the ones with a life
(the SQLite engine, the push client, the request handler's running tasks) are opened and
closed by the app's ``lifespan``:

* startup: create ``DATA_DIR/tasks.db`` if needed, then mark tasks a previous process left
  running as failed "interrupted by restart";
* shutdown: cancel running tasks (workers detach, tickets are released), mark them failed
  "interrupted by restart", close the push client and the engine.

Routes, in match order (the SDK's HTTP+JSON routes end in a catch-all ``/{tenant}`` mount,
so they come last): the agent card, ``/healthz``, ``extra_routes`` (the lead's
``/capacity``, ``/metrics``, ``/v1/sessions``), JSON-RPC at ``/`` (1.0 and 0.3), HTTP+JSON
under ``config.rest_prefix`` (1.0, and 0.3 under ``PREFIX/v1``).

Middleware, outermost first: :class:`BearerAuth` (401s; card and ``/healthz`` public),
then :class:`RequestGuard` (413, request validation, 429 from the gate's queue check). Both
cover ``extra_routes`` too.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_jsonrpc_routes, create_rest_routes
from a2a.types import a2a_pb2 as pb
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from mesh.a2a.auth import BearerAuth
from mesh.a2a.card import CARD_PATH, LEGACY_CARD_PATH, Skill, build_agent_card, card_routes
from mesh.a2a.config import CoordinatorConfig
from mesh.a2a.executor import CoordinatorExecutor, WorkerFactory
from mesh.a2a.push import build_push_sender, make_push_url_validator
from mesh.a2a.store import Stores, mark_interrupted, open_stores
from mesh.a2a.taskboard import ObservedTaskStore, TaskBoard
from mesh.a2a.validation import RequestGuard
from mesh.agent.task import Agent
from mesh.engine.types import PoolInfo
from mesh.gate.types import Admission

__all__ = ["Coordinator", "build_app", "run_server"]

logger = logging.getLogger(__name__)

HEALTH_PATH = "/healthz"


@dataclass
class Coordinator:
    """What ``build_app`` built, reachable as ``app.state.coordinator`` (tests, the CLI)."""

    config: CoordinatorConfig
    card: pb.AgentCard
    stores: Stores
    executor: CoordinatorExecutor
    handler: DefaultRequestHandler
    push_client: httpx.AsyncClient
    interrupted_at_start: tuple[str, ...] = ()


def build_app(
    config: CoordinatorConfig,
    *,
    worker_factory: WorkerFactory,
    admission: Admission,
    pool_info: PoolInfo | None,
    extra_routes: Sequence[BaseRoute] = (),
    skills: Sequence[Skill | Mapping[str, Any]] = (),
    task_board: TaskBoard | None = None,
    public_paths: Sequence[str] = (),
    on_shutdown: Sequence[Callable[[], Awaitable[None]]] = (),
    on_startup: Sequence[Callable[[], Awaitable[None]]] = (),
    agent: Agent | None = None,
) -> Starlette:
    """The A2A coordinator as a Starlette app (see the module docstring for what it mounts).

    ``worker_factory`` makes one worker per admitted subtask; ``admission`` is the gate's
    async face (its ``check_queue`` also drives the 429 answer); ``pool_info`` goes on the
    card; ``task_board``, if given, sees every task the handler saves (the dashboard);
    ``public_paths`` are served without auth next to the card and ``/healthz``;
    ``on_startup`` runs in the serving loop at start-up (the dashboard's history);
    ``on_shutdown`` runs first at shutdown (the session API's ``aclose``); ``agent``
    (optional) plans messages without explicit subtasks. Raises
    ``ValueError`` if ``config`` does not validate. Does no I/O.
    """
    config.validate()
    card = build_agent_card(config, skills, pool_info)
    stores = open_stores(config.data_dir)
    url_validator = make_push_url_validator(config.allow_private_push)
    push_client = httpx.AsyncClient(timeout=httpx.Timeout(10.0))
    executor = CoordinatorExecutor(
        worker_factory,
        admission,
        max_subtasks=config.max_subtasks,
        text_flush_s=config.text_flush_s,
        agent=agent,
    )
    push_sender = build_push_sender(push_client, stores.push_configs, url_validator,
                                    allow_private=config.allow_private_push)
    handler = DefaultRequestHandler(
        executor,
        stores.tasks if task_board is None else ObservedTaskStore(stores.tasks, task_board),
        card,
        push_config_store=stores.push_configs,
        push_sender=push_sender,
        push_url_validator=url_validator,
    )
    coordinator = Coordinator(config, card, stores, executor, handler, push_client)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await stores.initialize()
        marked = await mark_interrupted(stores)
        if marked:
            logger.warning("marked %d task(s) left running failed: interrupted", len(marked))
        coordinator.interrupted_at_start = tuple(marked)
        try:
            for start in on_startup:
                await start()
            yield
        finally:
            try:
                for close in on_shutdown:
                    await close()
                await handler.aclose()
                await mark_interrupted(stores)
            finally:
                await push_sender.aclose()  # stop background deliveries before the client
                await push_client.aclose()
                await stores.aclose()

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True, "running_tasks": executor.num_running})

    routes: list[BaseRoute] = [
        *card_routes(card, f"public, max-age={config.card_max_age_s}"),
        Route(HEALTH_PATH, healthz, methods=["GET"]),
        *extra_routes,
        *create_jsonrpc_routes(handler, "/", enable_v0_3_compat=True),
        *create_rest_routes(handler, enable_v0_3_compat=True, path_prefix=config.rest_prefix),
    ]

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        hint = f"A2A JSON-RPC is at POST /, HTTP+JSON under {config.rest_prefix}"
        text = {
            404: f"no route for {request.method} {request.url.path}; {hint}",
            405: f"{request.method} is not allowed on {request.url.path}; {hint}",
        }.get(status, str(getattr(exc, "detail", "error")))
        grpc = {404: "NOT_FOUND", 405: "UNIMPLEMENTED"}.get(status, "INVALID_ARGUMENT")
        return JSONResponse(
            {"error": {"code": status, "status": grpc, "message": text}}, status_code=status
        )

    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(
                BearerAuth,
                tokens=config.tokens,
                public_paths=(CARD_PATH, LEGACY_CARD_PATH, HEALTH_PATH, *public_paths),
            ),
            Middleware(RequestGuard, config=config, check_queue=admission.check_queue),
        ],
        exception_handlers={404: http_error, 405: http_error},
        lifespan=lifespan,
    )
    app.state.coordinator = coordinator
    return app


def run_server(
    app: Starlette,
    host: str,
    port: int,
    *,
    log_level: str = "info",
    graceful_s: int = 5,
    sock: socket.socket | None = None,
) -> int:
    """Serve ``app`` with uvicorn until SIGINT/SIGTERM; returns an exit status.

    ``sock``: an already bound, listening socket to serve on (``mesh serve`` binds the port
    before its slow start-up, so a port in use fails at once); without it uvicorn binds
    ``host:port`` itself.

    On a signal uvicorn stops accepting, gives open streams ``graceful_s`` seconds, then
    runs the app's shutdown: running tasks are cancelled (sessions freed) and recorded as
    failed "interrupted by restart", and the store is closed cleanly.
    """
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            lifespan="on",
            timeout_graceful_shutdown=graceful_s,
        )
    )
    server.run(sockets=[sock] if sock is not None else None)
    return 0 if server.started else 1
