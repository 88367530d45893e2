"""``GET /capacity`` (JSON) and ``GET /metrics`` (Prometheus text) over an Admission.

Both read only :meth:`~mesh.gate.queue.Admission.capacity`, so they work with any gate.
The metrics registry is built per call of :func:`capacity_routes` (no global registry):
each scrape asks the gate for a fresh document.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from mesh.gate.queue import Admission

__all__ = ["CapacityCollector", "capacity_routes"]


def _num(value: Any) -> float | None:
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float):
        return float(value)
    return None


# (metric, help, where in the capacity document)
_GAUGES = (
    ("gate_floor_tps", "Floor tokens/s per worker.", "floor_tps"),
    ("session_tps_min", "Slowest measured session, tokens/s.", "measured_tps.min"),
    ("session_tps_p50", "Median measured session, tokens/s.", "measured_tps.p50"),
    ("gate_projected_tps_next", "Projected tokens/s of the slowest worker if one more is "
     "admitted.", "projected_tps_next"),
    ("gate_headroom", "More workers that fit now.", "headroom"),
    ("gate_queue_length", "Requests waiting for admission.", "queue_len"),
    ("gate_retry_after_seconds", "Retry-After a refused caller gets.", "retry_after_s"),
    ("gate_projected_idle_estimate", "1 if workers are counted by their duty cycle.",
     "projected_idle_estimate"),
    ("kv_reduction", "Naive / pooled KV cells.", "kv_cells.reduction"),
    ("gate_admitted", "Admissions granted since start.", "admitted_total"),
    ("gate_refused", "Requests refused since start.", "refused_total"),
    ("pool_sessions_attached", "Sessions attached to the pool since start.",
     "pool_totals.sessions_attached"),
    ("pool_prefill_tokens", "Suffix tokens prefilled since start.", "pool_totals.prefill_tokens"),
)


def _at(doc: Any, path: str) -> Any:
    for key in path.split("."):
        doc = doc.get(key) if isinstance(doc, Mapping) else None
    return doc


class CapacityCollector(Collector):
    """Prometheus gauges built from one ``capacity()`` document per scrape."""

    def __init__(self, admission: Admission, namespace: str = "mesh") -> None:
        self._admission = admission
        self._ns = namespace

    def _labelled(self, name: str, doc: str, label: str,
                  values: Mapping[str, Any]) -> GaugeMetricFamily:
        g = GaugeMetricFamily(f"{self._ns}_{name}", doc, labels=[label])
        for key, value in values.items():
            v = _num(value)
            if v is not None:
                g.add_metric([key], v)
        return g

    def collect(self) -> Iterator[Metric]:
        cap = self._admission.capacity()
        for name, doc, path in _GAUGES:
            value = _num(_at(cap, path))
            if value is not None:
                yield GaugeMetricFamily(f"{self._ns}_{name}", doc, value=value)
        sessions = {k: v for k, v in cap.get("sessions", {}).items() if k != "total"}
        kv = {k: v for k, v in cap.get("kv_cells", {}).items() if k != "reduction"}
        yield self._labelled("sessions", "Sessions by state.", "state", sessions)
        yield self._labelled("kv_cells", "KV cells by kind.", "kind", kv)
        yield self._labelled("kv_bytes", "KV cache bytes: allocated, used, per cell.", "kind",
                             cap.get("kv_bytes", {}))


def capacity_routes(admission: Admission) -> list[BaseRoute]:
    """``GET /capacity`` and ``GET /metrics``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CapacityCollector(admission))

    async def capacity(request: Request) -> Response:
        return JSONResponse(admission.capacity(), headers={"Cache-Control": "no-store"})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return [
        Route("/capacity", capacity, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
