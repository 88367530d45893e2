"""``GET /dashboard``: a live operator page over the same document ``/capacity`` serves.

Routes:

* ``GET /dashboard`` and ``GET /dashboard/assets/{dashboard.js,dashboard.css}``: static files
  shipped in the package (no build step, no CDN). Public: they hold no data.
* ``GET /dashboard/events``: Server-Sent Events, one ``data:`` frame every ``interval_s``::

      {"t": unix seconds, "capacity": Admission.capacity(), "tasks": TaskBoard.snapshot(),
       "nodes": [...] or null}

  Non-finite numbers are sent as ``null``. It sits behind the app's bearer auth like
  ``/capacity`` (mount :data:`DASHBOARD_PUBLIC_PATHS` as the app's public paths, not the
  events). At most ``max_streams`` streams are open at once (the next caller gets 429 with
  ``Retry-After``), and each ends with ``event: end`` after ``max_stream_s``, so no client
  holds a connection forever; the page reconnects.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Any, Protocol

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from mesh.gate.types import Admission

__all__ = [
    "DASHBOARD_PUBLIC_PATHS",
    "NodesSource",
    "TaskSource",
    "dashboard_routes",
    "finite",
    "poll_nodes",
]

_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
DASHBOARD_PUBLIC_PATHS = ("/dashboard", *(f"/dashboard/assets/{name}" for name in _ASSETS))
MIN_INTERVAL_S = 0.2  # "at most a few times a second"


class TaskSource(Protocol):
    """What the dashboard reads tasks from (:class:`mesh.coordinator.taskboard.TaskBoard`)."""

    def snapshot(self) -> dict[str, Any]: ...


# An async callable returning one JSON-able dict per node (its name, URL and capacity).
NodesSource = Callable[[], Awaitable[list[dict[str, Any]]]]


def finite(value: Any) -> Any:
    """``value`` with every NaN/inf float replaced by ``None`` (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def poll_nodes(
    urls: list[str],
    client: httpx.AsyncClient,
    *,
    token: str | None = None,
    min_interval_s: float = 0.5,
) -> NodesSource:
    """A :data:`NodesSource` reading each node's ``/capacity``, at most once per
    ``min_interval_s`` however many dashboards stream. A node that does not answer shows
    ``{"url", "capacity": null, "error"}``; nothing raises."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    cache: list[dict[str, Any]] = []
    fetched_at = -math.inf
    lock = anyio.Lock()

    async def one(url: str) -> dict[str, Any]:
        try:
            r = await client.get(url.rstrip("/") + "/capacity", headers=headers)
            r.raise_for_status()
            return {"url": url, "capacity": r.json(), "error": None}
        except (httpx.HTTPError, ValueError) as exc:
            return {"url": url, "capacity": None, "error": f"{type(exc).__name__}: {exc}"}

    async def nodes() -> list[dict[str, Any]]:
        nonlocal cache, fetched_at
        async with lock:
            if time.monotonic() - fetched_at >= min_interval_s:
                results: list[dict[str, Any]] = [{} for _ in urls]

                async def fill(i: int, url: str) -> None:
                    results[i] = await one(url)

                async with anyio.create_task_group() as tg:
                    for i, url in enumerate(urls):
                        tg.start_soon(fill, i, url)
                cache, fetched_at = results, time.monotonic()
            return cache

    return nodes


def _static(name: str) -> bytes:
    return resources.files("mesh.api").joinpath("static", name).read_bytes()


class _CountedStream(StreamingResponse):
    """A streaming response that releases its slot however it ends (even unstarted)."""

    def __init__(self, body: AsyncIterator[str], release: Callable[[], None]) -> None:
        super().__init__(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def dashboard_routes(
    admission: Admission,
    *,
    tasks: TaskSource | None,
    nodes: NodesSource | None = None,
    interval_s: float = 0.5,
    max_stream_s: float = 600.0,
    max_streams: int = 8,
) -> list[BaseRoute]:
    """The page, its two assets and the SSE feed (see the module docstring)."""
    if not interval_s >= MIN_INTERVAL_S:
        raise ValueError(f"interval_s must be >= {MIN_INTERVAL_S} s, got {interval_s!r}")
    if not max_stream_s > 0:
        raise ValueError(f"max_stream_s must be > 0, got {max_stream_s!r}")
    if max_streams < 1:
        raise ValueError(f"max_streams must be >= 1, got {max_streams!r}")
    page = _static("dashboard.html")
    assets = {name: _static(name) for name in _ASSETS}
    open_streams = 0

    async def frame() -> str:
        doc = {
            "t": time.time(),
            "capacity": admission.capacity(),
            "tasks": tasks.snapshot() if tasks is not None else None,
            "nodes": await nodes() if nodes is not None else None,
        }
        return "data: " + json.dumps(finite(doc), allow_nan=False) + "\n\n"

    async def stream() -> AsyncIterator[str]:
        deadline = time.monotonic() + max_stream_s
        yield f"retry: {int(interval_s * 1000)}\n\n"
        while True:
            yield await frame()
            left = deadline - time.monotonic()
            if left <= 0:
                yield 'event: end\ndata: {"reason": "max_stream_s"}\n\n'
                return
            await anyio.sleep(min(interval_s, left))

    def release() -> None:
        nonlocal open_streams
        open_streams -= 1

    async def events(request: Request) -> Response:
        nonlocal open_streams
        if open_streams >= max_streams:
            retry = max(1, math.ceil(interval_s * 4))
            return JSONResponse(
                {
                    "error": {
                        "code": 429,
                        "status": "RESOURCE_EXHAUSTED",
                        "message": f"{max_streams} dashboard streams are open; close one "
                        f"or retry after {retry} s",
                    }
                },
                status_code=429,
                headers={"Retry-After": str(retry)},
            )
        open_streams += 1
        return _CountedStream(stream(), release)

    async def html(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8")

    def asset(name: str) -> Callable[[Request], Awaitable[Response]]:
        async def serve(request: Request) -> Response:
            return Response(
                assets[name],
                media_type=f"{_ASSETS[name]}; charset=utf-8",
                headers={"Cache-Control": "no-cache"},
            )

        return serve

    return [
        Route("/dashboard", html, methods=["GET"]),
        Route("/dashboard/events", events, methods=["GET"]),
        *(Route(f"/dashboard/assets/{n}", asset(n), methods=["GET"]) for n in _ASSETS),
    ]
