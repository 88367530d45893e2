"""The live dashboard (docs/dashboard.md): its recent history, then its routes.

**History.** The last few minutes of the capacity document, one sample every ``interval_s``
for ``window_s`` in a ring of fixed length, each sample a few numbers and one
``[id, tokens/s]`` pair per decoding worker (at most ``max_workers``): memory bounded by
the settings, never by traffic. The page draws them at load (``GET /dashboard/history``).
A sample (the page turns each live SSE frame into the same shape, ``sampleOf`` in
``static/dashboard.js``)::

    {"t": unix s, "floor": tok/s or null, "verdict": "admit"|"queue"|"refuse"|...,
     "admitted": n, "refused": n, "queue": n, "maxQueue": n, "waiting": n or null,
     "cells": {"used": n, "prefix": n, "total": n},
     "parking": {"attached": n, "resident": n, "parked": n, "parkedCells": n,
                 "parkedBytes": n},
     "workers": [[id, tok/s], ...]}

``parking`` is ``/capacity``'s ``parking`` block (``attached`` its ``sessions.total``,
``parkedCells`` its ``parked_tokens``), ``waiting`` its ``turns.waiting``; every field is
read defensively (null where the document lacks it). The sampler is a
:class:`~mesh.api.admit.Periodic` started at start-up and by every dashboard request.

**The dashboard.** ``GET /dashboard`` and its two assets (public: they hold no data);
``GET /dashboard/events``, Server-Sent Events, one ``data:`` frame every ``interval_s``
(``{"t", "capacity", "tasks"}``, non-finite numbers as ``null``), behind the app's bearer
auth like ``/capacity``, at most ``max_streams`` open and ``max_streams_per_caller`` per
caller (429 with ``Retry-After`` past either), each ending with ``event: end`` after
``max_stream_s``; ``GET /dashboard/history``, behind the same auth.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from importlib import resources
from typing import Any, Protocol

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from mesh.api.admit import Periodic, caller_of
from mesh.api.sessions import EventStream
from mesh.gate.queue import Admission

__all__ = [
    "DASHBOARD_PUBLIC_PATHS", "DashboardHistory", "TaskSource", "dashboard_routes", "finite",
    "sample_of",
]


# -------------------- history -------------------------------------------------

logger = logging.getLogger(__name__)


def _num(value: Any) -> float | int | None:
    """A finite number, else None (JSON has no NaN; a missing field is null)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value if math.isfinite(value) else None


def _part(cap: dict[str, Any], key: str) -> dict[str, Any]:
    part = cap.get(key)
    return part if isinstance(part, dict) else {}


def sample_of(cap: dict[str, Any], t: float, max_workers: int = 64) -> dict[str, Any]:
    """One history sample from a ``/capacity`` document (see the module docstring)."""
    kv, parking = _part(cap, "kv_cells"), _part(cap, "parking")
    rows = cap.get("workers")
    rows = [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []
    tps = [(row.get("id"), _num(row.get("decodeTps"))) for row in rows]
    workers = [[str(i), v] for i, v in tps if v is not None][:max_workers]
    verdict = cap.get("verdict")
    return {
        "t": t,
        "floor": _num(cap.get("floor_tps")),
        "verdict": verdict if isinstance(verdict, str) else None,
        "admitted": _num(cap.get("admitted_total")),
        "refused": _num(cap.get("refused_total")),
        "queue": _num(cap.get("queue_len")),
        "maxQueue": _num(cap.get("max_queue")),
        "waiting": _num(_part(cap, "turns").get("waiting")),
        "cells": {k: _num(kv.get(k)) for k in ("used", "prefix", "total")},
        "parking": {"attached": _num(_part(cap, "sessions").get("total")),
                    "resident": _num(parking.get("resident")),
                    "parked": _num(parking.get("parked")),
                    "parkedCells": _num(parking.get("parked_tokens")),
                    "parkedBytes": _num(parking.get("parked_bytes"))},
        "workers": workers,
    }


class DashboardHistory:
    """A ring of :func:`sample_of` samples of ``admission.capacity()``, the newest last.

    ``interval_s``: seconds between samples; ``window_s``: how far back the ring reaches
    (its length is ``ceil(window_s / interval_s) + 1``); ``clock``: unix seconds (tests).
    Call :meth:`start` from the serving loop (or let :meth:`ensure_started` do it) and
    :meth:`aclose` at shutdown.
    """

    def __init__(
        self,
        admission: Admission,
        *,
        interval_s: float = 1.0,
        window_s: float = 300.0,
        max_workers: int = 64,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        if not window_s >= interval_s:
            raise ValueError(f"window_s must be >= interval_s, got {window_s!r}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers!r}")
        self.admission = admission
        self.interval_s, self.window_s, self.max_workers = interval_s, window_s, max_workers
        self._clock = clock
        self._ring: deque[dict[str, Any]] = deque(maxlen=math.ceil(window_s / interval_s) + 1)
        self._periodic = Periodic(self._tick, lambda: self.interval_s)
        self._failed = False

    def sample(self) -> dict[str, Any]:
        """Take one sample now, keep it, and return it."""
        s = sample_of(self.admission.capacity(), self._clock(), self.max_workers)
        self._ring.append(s)
        return s

    def samples(self) -> list[dict[str, Any]]:
        """The kept samples no older than ``window_s``, oldest first (a copy)."""
        cutoff = self._clock() - self.window_s
        while self._ring and self._ring[0]["t"] < cutoff:
            self._ring.popleft()
        return list(self._ring)

    def document(self) -> dict[str, Any]:
        """What ``GET /dashboard/history`` answers."""
        return {"t": self._clock(), "intervalS": self.interval_s, "windowS": self.window_s,
                "samples": self.samples()}

    async def _tick(self) -> None:
        try:
            self.sample()
            self._failed = False
        except Exception:  # the sampler outlives a bad read; say so once per failure run
            if not self._failed:
                logger.exception("dashboard history: could not sample the capacity")
            self._failed = True

    def ensure_started(self) -> None:
        """Start the sampler in the running loop unless it runs already."""
        self._periodic.ensure_started()

    async def start(self) -> None:
        """Sample once now and every ``interval_s`` after (an ``on_startup`` hook)."""
        await self._tick()
        self.ensure_started()

    async def aclose(self) -> None:
        """Stop the sampler (the samples stay readable)."""
        await self._periodic.aclose()

# -------------------- the dashboard -------------------------------------------

_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
DASHBOARD_PUBLIC_PATHS = ("/dashboard", *(f"/dashboard/assets/{name}" for name in _ASSETS))
MIN_INTERVAL_S = 0.2  # "at most a few times a second"
DEFAULT_STREAMS_PER_CALLER = 2


class TaskSource(Protocol):
    """What the dashboard reads tasks from (:class:`mesh.a2a.store.TaskBoard`)."""

    def snapshot(self) -> dict[str, Any]: ...


def finite(value: Any) -> Any:
    """``value`` with every NaN/inf float replaced by ``None`` (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def _static(name: str) -> bytes:
    return resources.files("mesh.api").joinpath("static", name).read_bytes()


def _busy(message: str, retry_s: int) -> Response:
    return JSONResponse(
        {"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "message": message}},
        status_code=429, headers={"Retry-After": str(retry_s)})


def dashboard_routes(
    admission: Admission,
    *,
    tasks: TaskSource | None,
    history: DashboardHistory | None = None,
    interval_s: float = 0.5,
    max_stream_s: float = 600.0,
    max_streams: int = 8,
    max_streams_per_caller: int = DEFAULT_STREAMS_PER_CALLER,
) -> list[BaseRoute]:
    """The page, its two assets, the SSE feed and the history (see the module docstring).

    ``history``: the sampler the app starts at start-up (one is made here if not given; it
    then starts with the first dashboard request)."""
    if not interval_s >= MIN_INTERVAL_S:
        raise ValueError(f"interval_s must be >= {MIN_INTERVAL_S} s, got {interval_s!r}")
    if not max_stream_s > 0:
        raise ValueError(f"max_stream_s must be > 0, got {max_stream_s!r}")
    if max_streams < 1:
        raise ValueError(f"max_streams must be >= 1, got {max_streams!r}")
    if max_streams_per_caller < 1:
        raise ValueError(f"max_streams_per_caller must be >= 1, got {max_streams_per_caller!r}")
    page = _static("dashboard.html")
    assets = {name: _static(name) for name in _ASSETS}
    memory = history if history is not None else DashboardHistory(admission)
    open_streams = 0
    # Streams open per authenticated caller; "" (no auth) is not capped beyond max_streams.
    by_caller: dict[str, int] = {}
    retry = max(1, math.ceil(interval_s * 4))

    async def frame() -> str:
        doc = {
            "t": time.time(),
            "capacity": admission.capacity(),
            "tasks": tasks.snapshot() if tasks is not None else None,
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

    def releaser(caller: str) -> Callable[[], Awaitable[None]]:
        async def release() -> None:
            nonlocal open_streams
            open_streams -= 1
            if caller:
                by_caller[caller] -= 1
                if not by_caller[caller]:
                    del by_caller[caller]  # the map holds only callers with open streams

        return release

    async def events(request: Request) -> Response:
        nonlocal open_streams
        memory.ensure_started()
        caller = caller_of(request)
        # Checked and taken with no await in between: concurrent requests cannot both pass.
        if open_streams >= max_streams:
            return _busy(f"{max_streams} dashboard streams are open; close one or retry "
                         f"after {retry} s", retry)
        if caller and by_caller.get(caller, 0) >= max_streams_per_caller:
            return _busy(f"this caller has {max_streams_per_caller} dashboard streams open "
                         f"(its share of {max_streams}); close one or retry after {retry} s",
                         retry)
        open_streams += 1
        if caller:
            by_caller[caller] = by_caller.get(caller, 0) + 1
        return EventStream(stream(), releaser(caller))

    async def past(request: Request) -> Response:
        memory.ensure_started()
        # Up to ~170 KB (300 samples x 32 workers): encoded off the loop. The samples are
        # finite already (sample_of) and never mutated once kept, so the copy is safe there.
        doc = memory.document()
        body = await anyio.to_thread.run_sync(
            lambda: json.dumps(doc, allow_nan=False, separators=(",", ":")))
        return Response(body, media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    async def html(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8")

    async def asset(name: str, request: Request) -> Response:
        return Response(assets[name], media_type=f"{_ASSETS[name]}; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})

    return [
        Route("/dashboard", html, methods=["GET"]),
        Route("/dashboard/events", events, methods=["GET"]),
        Route("/dashboard/history", past, methods=["GET"]),
        *(Route(f"/dashboard/assets/{n}", partial(asset, n), methods=["GET"]) for n in _ASSETS),
    ]
