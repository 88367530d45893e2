"""The dashboard's memory: the last few minutes of the capacity document, sampled on a timer.

The page draws these at load (``GET /dashboard/history``), so an operator who opens it after
a burst of work sees that work, not an empty chart. One sample every ``interval_s`` (1 s)
for ``window_s`` (300 s) is kept in a ring whose length is fixed at construction; each
sample is a few numbers and one ``[id, tokens/s]`` pair per decoding worker (at most
``max_workers``), so the memory is bounded by the settings, never by traffic.

A sample (the page turns each live SSE frame into the same shape, see ``sampleOf`` in
``static/dashboard.js``)::

    {"t": unix s, "floor": tok/s or null, "verdict": "admit"|"queue"|"refuse"|...,
     "admitted": n, "refused": n, "queue": n, "maxQueue": n, "waiting": n or null,
     "cells": {"used": n, "prefix": n, "total": n},
     "parking": {"attached": n, "resident": n, "parked": n, "parkedCells": n,
                 "parkedBytes": n},
     "workers": [[id, tok/s], ...]}

``parking`` is ``/capacity``'s ``parking`` block (issue 28): ``attached`` is every session
(``sessions.total``), ``resident`` those holding a sequence id and their cells, ``parked``
those off the KV cache, ``parkedCells`` the suffix tokens they hold off it (their
``parked_tokens``), ``parkedBytes`` the host RAM their swapped suffixes take.

``waiting`` is ``/capacity``'s ``turns.waiting`` (turns queued for a decode slot) when the
gate reports it, else null. Every field is read defensively: an admission whose document
lacks one (the node pool's) gives null there.

The sampler is a :class:`~mesh.api.admit.Periodic` in the serving loop: the app starts it
at start-up (``build_app(on_startup=[history.start])``) and every dashboard request makes
sure it runs (so a server that forgot still remembers from the first page view on).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from mesh.api.admit import Periodic
from mesh.gate.queue import Admission

__all__ = ["DashboardHistory", "sample_of"]

logger = logging.getLogger(__name__)


def _num(value: Any) -> float | int | None:
    """A finite number, else None (JSON has no NaN; a missing field is null)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value if math.isfinite(value) else None


def sample_of(cap: dict[str, Any], t: float, max_workers: int = 64) -> dict[str, Any]:
    """One history sample from a ``/capacity`` document (see the module docstring)."""
    kv = cap.get("kv_cells")
    kv = kv if isinstance(kv, dict) else {}
    turns = cap.get("turns")
    waiting = _num(turns.get("waiting")) if isinstance(turns, dict) else None
    workers: list[list[Any]] = []
    rows = cap.get("workers")
    for row in rows if isinstance(rows, list) else ():
        if not isinstance(row, dict):
            continue
        tps = _num(row.get("decodeTps"))
        if tps is not None and len(workers) < max_workers:
            workers.append([str(row.get("id")), tps])
    verdict = cap.get("verdict")
    parking = cap.get("parking")
    parking = parking if isinstance(parking, dict) else {}
    sessions = cap.get("sessions")
    attached = _num(sessions.get("total")) if isinstance(sessions, dict) else None
    return {
        "t": t,
        "floor": _num(cap.get("floor_tps")),
        "verdict": verdict if isinstance(verdict, str) else None,
        "admitted": _num(cap.get("admitted_total")),
        "refused": _num(cap.get("refused_total")),
        "queue": _num(cap.get("queue_len")),
        "maxQueue": _num(cap.get("max_queue")),
        "waiting": waiting,
        "cells": {k: _num(kv.get(k)) for k in ("used", "prefix", "total")},
        "parking": {"attached": attached, "resident": _num(parking.get("resident")),
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
