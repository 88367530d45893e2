"""The coordinator's Starlette app: bearer auth, the app built around the SDK's routes, and
serving it on uvicorn.

**Auth** (:class:`BearerAuth`): the SDK declares security schemes on the card but enforces
none. Every HTTP request but the public paths (the card, ``/healthz``) must carry
``Authorization: Bearer TOKEN`` for a configured token, else 401 with ``WWW-Authenticate:
Bearer``. Every token is compared, in constant time, on every request: timing reveals
neither the token nor which one matched. A match becomes ``scope["user"]``
(``caller-<sha256 prefix>``), the SDK's ``ServerCallContext.user``, by which the task store
scopes every read and write: a caller sees only its own tasks.

**Serving** (:func:`run_server`): on one loop, the app's lifespan start-up, uvicorn on the
socket, then the lifespan's shutdown; uvicorn's own lifespan and signal handling are off, so
every object is built, used and closed on the loop that serves it. A SIGINT or SIGTERM:

* at start-up: the start-up is cancelled and what it built closed; exit status
  ``128 + signal`` (130 for Ctrl-C);
* while serving: uvicorn stops accepting, gives open streams ``graceful_s`` seconds (a
  second SIGINT cuts that short), then the app closes (running tasks cancelled and recorded
  failed "interrupted by restart", sessions freed, the store closed); exit status 0;
* while closing: ignored (closing is under way and bounded).

**The app** (:func:`create_app`): the one composition root of ``mesh serve``, its ``--node``
form, the tests and the benchmarks. Its *compose* step builds the live objects (pool, gate,
peer and node clients, session and OpenAI APIs) as :class:`AppParts` in the lifespan, on the
serving loop; what it registers on the :class:`~contextlib.AsyncExitStack` is closed there,
in reverse, after the A2A side (:func:`build_app`: parts built beforehand). The lifespan
(docs/architecture.md, "Start and stop"): with ``task_store``, check PostgreSQL answers;
compose; assemble card, stores, handler and routes; open the stores and mark tasks left
running failed; ``on_startup``. At shutdown: ``on_shutdown``; running tasks cancelled and
marked; push client and stores closed; then what compose registered.

Routes, in match order (the SDK's HTTP+JSON routes end in a catch-all ``/{tenant}`` mount):
the card, ``/healthz``, ``extra_routes`` (``/capacity``, ``/metrics``, ``/v1/sessions``),
JSON-RPC at ``/`` (1.0 and 0.3), HTTP+JSON under ``config.rest_prefix`` (1.0; 0.3 under
``PREFIX/v1``). Middleware, outermost first, covering ``extra_routes`` too: :class:`BearerAuth`,
then :class:`~mesh.a2a.validation.RequestGuard` (413, validation, 429 from the gate's queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import signal
import socket
import sys
import threading
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_jsonrpc_routes, create_rest_routes
from a2a.types import a2a_pb2 as pb
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, SimpleUser
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from mesh.a2a.card import Skill, build_agent_card, card_routes
from mesh.a2a.config import CoordinatorConfig
from mesh.a2a.executor import CoordinatorExecutor
from mesh.a2a.postgres import PostgresStores, check_postgres
from mesh.a2a.push import BackgroundPushSender, make_push_url_validator
from mesh.a2a.store import TaskBoard, TaskStores, open_stores
from mesh.a2a.validation import CheckedContextBuilder, RequestGuard, rest_error, send_json
from mesh.a2a_names import CARD_PATH, LEGACY_CARD_PATH
from mesh.agent.task import Agent, WorkerFactory
from mesh.engine.interface import PoolInfo
from mesh.gate.queue import Admission, QueueCheck

__all__ = [
    "AppParts", "BearerAuth", "Compose", "Coordinator", "build_app", "caller_name", "create_app",
    "run_server", "serve_app",
]


# -------------------- auth ----------------------------------------------------

def caller_name(token: str) -> str:
    """The stable, non-secret name of the caller holding ``token``."""
    return "caller-" + hashlib.sha256(token.encode("utf-8")).hexdigest()[:16]


class BearerAuth:
    """Reject requests without a valid bearer token; name the caller of those with one."""

    def __init__(self, app: ASGIApp, tokens: Iterable[str], public_paths: Iterable[str]) -> None:
        self.app = app
        self._tokens = [(t.encode("utf-8"), caller_name(t)) for t in tokens]
        self._public = frozenset(public_paths)

    def _match(self, header: str | None) -> str | None:
        scheme, _, presented = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not presented:
            return None
        candidate = presented.strip().encode("utf-8")
        found: str | None = None
        for token, name in self._tokens:
            # No early exit: each token is compared on every request.
            if hmac.compare_digest(candidate, token):
                found = name
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._tokens or scope["path"] in self._public:
            await self.app(scope, receive, send)
            return
        header = next((value.decode("latin-1") for key, value in scope.get("headers", ())
                       if key == b"authorization"), None)
        name = self._match(header)
        if name is None:
            why = "invalid" if header is not None else "missing"
            message = (f"{why} bearer token; send 'Authorization: Bearer TOKEN' "
                       "(mesh commands: --token or MESH_TOKEN)")
            await send_json(send, 401, rest_error(401, "UNAUTHENTICATED", message),
                            [(b"www-authenticate", b'Bearer realm="mesh"')])
            return
        scope["user"] = SimpleUser(name)
        scope["auth"] = AuthCredentials(["authenticated"])
        await self.app(scope, receive, send)

# -------------------- serving -------------------------------------------------

logger = logging.getLogger(__name__)
# uvicorn's own lifespan lines, written where it would write them (operators and tests read
# "Application startup complete." and "Application shutdown complete."); none before the
# start-up, whose error is then the only line.
lifespan_log = logging.getLogger("uvicorn.error")

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handling: :class:`_Stop` handles the signals
    for the whole life (uvicorn's would re-raise a signal after serving, before the app
    is closed: a SIGTERM then killed the process with the pool still open)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _Stop:
    """What a signal does in the current phase (see the module docstring)."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task[Any]) -> None:
        self.server = server
        self.task = task
        self.phase = "starting"
        self.signal: int | None = None
        self.cancelled = False

    def __call__(self, sig: int) -> None:
        if self.signal is None:
            self.signal = sig
        if self.phase == "starting":
            if not self.cancelled:
                self.cancelled = True
                self.task.cancel()
        elif self.phase == "serving":
            self.server.handle_exit(sig, None)
        else:
            logger.info("signal %d while closing: already stopping", sig)


@contextlib.contextmanager
def _handlers(loop: asyncio.AbstractEventLoop, stop: _Stop) -> Iterator[None]:
    """Route SIGINT/SIGTERM to ``stop`` while serving (main thread only; elsewhere, e.g. a
    test's server thread, the caller stops the server through ``should_exit``)."""
    before: dict[signal.Signals, Any] = {}
    # asyncio routes signals only on a Unix loop in the main thread.
    routable = sys.platform != "win32" and threading.current_thread() is threading.main_thread()
    try:
        for sig in HANDLED_SIGNALS if routable else ():
            previous = signal.getsignal(sig)
            loop.add_signal_handler(sig, stop, sig)
            before[sig] = previous
        yield
    finally:
        for sig, previous in before.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, previous)  # the caller's handler, not asyncio's default


async def serve_app(app: Any, config: uvicorn.Config,
                    sock: socket.socket | None = None) -> int:
    """Start ``app``'s lifespan, serve it with uvicorn (``config.lifespan`` must be
    ``"off"``), close it, on the running loop; returns the exit status (1 if uvicorn could
    not start). The start-up's exceptions propagate (the CLI turns them into one line)."""
    if config.lifespan != "off":
        raise ValueError("serve_app runs the app's lifespan itself: pass "
                         "uvicorn.Config(..., lifespan='off')")
    server = _Server(config)
    task = asyncio.current_task()
    assert task is not None
    stop = _Stop(server, task)
    with _handlers(asyncio.get_running_loop(), stop):
        try:
            async with app.router.lifespan_context(app):
                lifespan_log.info("Application startup complete.")
                stop.phase = "serving"
                try:
                    await server.serve(sockets=[sock] if sock is not None else None)
                finally:
                    stop.phase = "closing"
                    lifespan_log.info("Waiting for application shutdown.")
            lifespan_log.info("Application shutdown complete.")
        except asyncio.CancelledError:
            if not stop.cancelled:
                raise
            task.uncancel()
            assert stop.signal is not None
            return 128 + stop.signal
    return 0 if server.started else 1


def run_server(app: Any, host: str, port: int, *, log_level: str = "info", graceful_s: int = 5,
               sock: socket.socket | None = None) -> int:
    """Serve ``app`` until SIGINT/SIGTERM on a new event loop (:func:`serve_app`); returns
    an exit status. ``sock``: a bound, listening socket (``mesh serve`` binds before its
    slow start-up, so a port in use fails at once); without it uvicorn binds ``host:port``."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=graceful_s)
    factory = getattr(config, "get_loop_factory", None)  # uvicorn >= 0.36
    with asyncio.Runner(loop_factory=factory() if factory is not None else None) as runner:
        return runner.run(serve_app(app, config, sock))

# -------------------- the app -------------------------------------------------


HEALTH_PATH = "/healthz"

Hook = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class AppParts:
    """What a composition root hands the app. ``worker_factory`` makes one worker per
    admitted subtask; ``admission`` is the gate's async face (its ``check_queue`` drives the
    429 too); ``pool_info`` goes on the card; ``task_board`` sees every task saved (the
    dashboard); ``on_startup`` runs once the stores are ready, ``on_shutdown`` first at
    shutdown; ``agent`` (optional) plans messages without explicit subtasks."""

    worker_factory: WorkerFactory
    admission: Admission
    pool_info: PoolInfo | None
    extra_routes: Sequence[BaseRoute] = ()
    skills: Sequence[Skill | Mapping[str, Any]] = ()
    task_board: TaskBoard | None = None
    agent: Agent | None = None
    on_startup: Sequence[Hook] = ()
    on_shutdown: Sequence[Hook] = ()


# Builds the parts on the serving loop; what it registers on the stack is closed there.
Compose = Callable[[AsyncExitStack], Awaitable[AppParts]]


@dataclass
class Coordinator:
    """What the lifespan assembled, reachable as ``app.state.coordinator`` once it started
    (tests, the CLI)."""

    config: CoordinatorConfig
    card: pb.AgentCard
    stores: TaskStores
    executor: CoordinatorExecutor
    handler: DefaultRequestHandler
    push_client: httpx.AsyncClient
    interrupted_at_start: tuple[str, ...] = ()


class _Live:
    """The gate of the running lifespan, for the middleware built before it started."""

    admission: Admission | None = None

    def check_queue(self, *, places: int = 1, caller: str = "") -> QueueCheck:
        if self.admission is None:
            raise RuntimeError("the app is not started: run its lifespan (uvicorn and "
                               "run_server do; tests: app.router.lifespan_context(app))")
        return self.admission.check_queue(places=places, caller=caller)


def create_app(config: CoordinatorConfig, compose: Compose | AppParts, *,
               public_paths: Sequence[str] = ()) -> Starlette:
    """The A2A coordinator as a Starlette app (see the module docstring). ``compose`` builds
    the parts in the lifespan (or is the parts); ``public_paths`` are served without auth
    too. Raises ``ValueError`` if ``config`` does not validate; does no I/O."""
    config.validate()
    live = _Live()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if config.task_store is not None:
            await check_postgres(config.task_store)  # one line naming --task-store, early
        async with AsyncExitStack() as stack:
            parts = compose if isinstance(compose, AppParts) else await compose(stack)
            coordinator, push_sender = _assemble(config, parts)
            # Invariant: no request is served before this (uvicorn and run_server serve
            # after the lifespan started), so the routes may be filled in here.
            app.router.routes[:] = _routes(config, coordinator, parts)
            live.admission = parts.admission
            app.state.coordinator = coordinator
            async with _running(coordinator, parts, push_sender):
                yield

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        hint = f"A2A JSON-RPC is at POST /, HTTP+JSON under {config.rest_prefix}"
        text = {
            404: f"no route for {request.method} {request.url.path}; {hint}",
            405: f"{request.method} is not allowed on {request.url.path}; {hint}",
        }.get(status, str(getattr(exc, "detail", "error")))
        grpc = {404: "NOT_FOUND", 405: "UNIMPLEMENTED"}.get(status, "INVALID_ARGUMENT")
        return JSONResponse(rest_error(status, grpc, text), status_code=status)

    public = (CARD_PATH, LEGACY_CARD_PATH, HEALTH_PATH, *public_paths)
    return Starlette(
        routes=[],
        middleware=[Middleware(BearerAuth, tokens=config.tokens, public_paths=public),
                    Middleware(RequestGuard, config=config, check_queue=live.check_queue)],
        exception_handlers={404: http_error, 405: http_error},
        lifespan=lifespan,
    )


def build_app(config: CoordinatorConfig, *, worker_factory: WorkerFactory, admission: Admission,
              pool_info: PoolInfo | None, extra_routes: Sequence[BaseRoute] = (),
              skills: Sequence[Skill | Mapping[str, Any]] = (), task_board: TaskBoard | None = None,
              public_paths: Sequence[str] = (), on_shutdown: Sequence[Hook] = (),
              on_startup: Sequence[Hook] = (), agent: Agent | None = None) -> Starlette:
    """:func:`create_app` with parts the caller built (tests, benchmarks); see
    :class:`AppParts` for each argument."""
    parts = AppParts(worker_factory, admission, pool_info, extra_routes, skills, task_board,
                     agent, on_startup, on_shutdown)
    return create_app(config, parts, public_paths=public_paths)


def _assemble(config: CoordinatorConfig,
              parts: AppParts) -> tuple[Coordinator, BackgroundPushSender]:
    """The card, stores, executor and SDK handler over ``parts`` (no I/O yet), and the
    push sender the shutdown closes."""
    card = build_agent_card(config, parts.skills, parts.pool_info)
    stores: TaskStores = (open_stores(config.data_dir) if config.task_store is None
                          else PostgresStores(config.task_store))
    url_validator = make_push_url_validator(config.allow_private_push)
    push_client = httpx.AsyncClient(timeout=httpx.Timeout(10.0))
    executor = CoordinatorExecutor(parts.worker_factory, parts.admission,
                                   text_flush_s=config.text_flush_s, agent=parts.agent)
    push_sender = BackgroundPushSender(push_client, stores.push_configs, url_validator,
                                       allow_private=config.allow_private_push)
    handler = stores.request_handler(executor, card, board=parts.task_board,
                                     push_sender=push_sender, push_url_validator=url_validator)
    return Coordinator(config, card, stores, executor, handler, push_client), push_sender


def _routes(config: CoordinatorConfig, coordinator: Coordinator,
            parts: AppParts) -> list[BaseRoute]:
    executor, handler = coordinator.executor, coordinator.handler

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True, "running_tasks": executor.num_running})

    return [
        *card_routes(coordinator.card, f"public, max-age={config.card_max_age_s}"),
        Route(HEALTH_PATH, healthz, methods=["GET"]),
        *parts.extra_routes,
        # the guard's checked message reaches the executor in the call context
        *create_jsonrpc_routes(handler, "/", enable_v0_3_compat=True,
                               context_builder=CheckedContextBuilder()),
        *create_rest_routes(handler, enable_v0_3_compat=True, path_prefix=config.rest_prefix,
                            context_builder=CheckedContextBuilder()),
    ]


@asynccontextmanager
async def _running(coordinator: Coordinator, parts: AppParts,
                   push_sender: BackgroundPushSender) -> AsyncIterator[None]:
    """The A2A side's life: stores opened and swept, ``on_startup``; at the end
    ``on_shutdown``, running tasks cancelled and marked, push and stores closed."""
    stores, handler = coordinator.stores, coordinator.handler
    await stores.initialize()
    marked = await stores.mark_interrupted()
    if marked:
        logger.warning("marked %d task(s) left running failed: interrupted", len(marked))
    coordinator.interrupted_at_start = tuple(marked)
    try:
        for start in parts.on_startup:
            await start()
        yield
    finally:
        try:
            for close in parts.on_shutdown:
                await close()
            await handler.aclose()
            await stores.mark_interrupted(is_shutdown=True)
        finally:
            await push_sender.aclose()  # stop background deliveries before the client
            await coordinator.push_client.aclose()
            await stores.aclose()
