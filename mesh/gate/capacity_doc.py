"""The floor gate's ``/capacity`` document: what the gate decides now, over what load.

Pure builders over one snapshot (:meth:`FloorGate.capacity` takes it and decides on it):
every number is finite or null, so the document is JSON as it stands.
"""

from __future__ import annotations

import statistics
from typing import Any, Protocol

from mesh.engine.interface import Engine, PoolLoad, SessionState
from mesh.gate.config import GateConfig
from mesh.gate.decide import Decision
from mesh.gate.decode_gate import DecodeGate, TurnRoom
from mesh.gate.model import ThroughputModel
from mesh.gate.projection import GateInput

__all__ = ["GateView", "capacity_doc"]


class GateView(Protocol):
    """What the document reads of the gate (:class:`~mesh.gate.admission.FloorGate`)."""

    engine: Engine
    config: GateConfig
    model: ThroughputModel
    num_admitted: int
    num_refused: int

    @property
    def queue_len(self) -> int: ...

    @property
    def num_tickets(self) -> int: ...


def capacity_doc(gate: GateView, inp: GateInput, load: PoolLoad, d: Decision,
                 decode_gate: DecodeGate | None, queue_callers: int) -> dict[str, Any]:
    """The ``/capacity`` document of ``gate`` from one snapshot (``inp``, ``load``) and the
    decision ``d`` on it; ``decode_gate`` is the gate's running one (None: not built)."""
    proj = d.projection
    # Workers decoding now: an idle or waiting session's rate is from its last turn
    # (stale: a worker on a tool call is not slowed by anything).
    running = (SessionState.DECODING, SessionState.PREFILLING)
    measured = sorted(s.decode_tps for s in load.sessions
                      if s.decode_tps is not None and s.state in running)
    return {
        "engine": _engine_doc(gate.engine),
        # the floor held now: --floor-tps, or under auto the per-row rate at the knee the
        # decode gate chose (the configured value until it measured a step)
        "floor_tps": _floor_now(gate.config.floor_tps, decode_gate),
        "floor_mode": "auto" if gate.config.auto_floor else "fixed",
        "policy": gate.config.policy,
        "verdict": d.verdict.value,
        "reasons": list(d.reasons),
        "sessions": {
            "total": len(load.sessions),
            **{state.value: load.count(state) for state in SessionState},
        },
        # attached = resident (holding a sequence id and their cells) + parked (cells
        # off the cache, re-prefilled before their next turn; 0 where none park)
        "parking": {"max_attached": load.max_attached, "resident": load.num_resident,
                    "parked": load.num_parked, "parked_tokens": load.parked_tokens,
                    "parks": load.parks, "resumes": load.resumes,
                    "resume_tokens": load.resume_tokens, "swaps": load.swaps,
                    "parked_bytes": load.parked_bytes, "park_memory": load.park_memory},
        "in_flight": inp.num_pending,
        "tickets": gate.num_tickets,
        "measured_tps": {
            "count": len(measured),
            "min": measured[0] if measured else None,
            "p50": statistics.median(measured) if measured else None,
        },
        "projected_tps_next": proj.tps_next,
        "projected_tps_now": proj.tps_now,
        "projected_tps_next_by_worker": {w.id: w.tps for w in proj.per_worker_next},
        "headroom": d.headroom,
        "queue_len": gate.queue_len,
        "max_queue": gate.config.max_queue,
        # each authenticated caller's share of the queue, and how many callers wait
        "max_queue_per_caller": gate.config.queue_share,
        "queue_callers": queue_callers,
        "kv_cells": {
            "used": load.cells_used,
            "total": load.cells_total,
            "prefix": load.prefix_cells,
            "naive_equivalent": load.naive_cells,
            "reduction": load.reduction,
        },
        "retry_after_s": d.retry_after_s,
        "projected_idle_estimate": proj.idle_estimate,
        "model": {**gate.model.describe(), "live_scale": proj.scale},
        "admitted_total": gate.num_admitted,
        "refused_total": gate.num_refused,
        # the pool's totals since start (0 where the engine does not count them)
        "pool_totals": {"sessions_attached": load.sessions_attached,
                        "prefill_tokens": load.prefill_tokens,
                        "sessions_reaped": load.sessions_reaped},
        "workers": _worker_rows(load),
        "turns": _turns_doc(load, decode_gate, _floor_now(gate.config.floor_tps, decode_gate)),
    }


def _floor_now(floor_tps: float, decode_gate: DecodeGate | None) -> float:
    floor = decode_gate.effective_floor() if decode_gate is not None else None
    return floor_tps if floor is None else floor


def _turns_doc(load: PoolLoad, decode_gate: DecodeGate | None, floor_tps: float
               ) -> dict[str, Any]:
    """The decode gate's side of ``/capacity``: turns running and waiting, and the
    measured step its last answer was anchored to (null where no decode gate runs)."""
    last = decode_gate.last if decode_gate is not None else None
    recent = [s for s in load.recent_steps if s.num_decode > 0]
    return {
        "gated": decode_gate is not None,
        "waiting": load.count(SessionState.WAITING),
        "running": load.count(SessionState.DECODING) + load.count(SessionState.PREFILLING),
        "measured_step_s": statistics.median(s.step_s for s in recent[-8:]) if recent
        else None,
        "floor_step_s": 1.0 / floor_tps,
        "ratio": last.ratio if last is not None else None,
        "projected_step_now_s": last.projected_now_s if last is not None else None,
        "projected_step_next_s": last.projected_next_s if last is not None else None,
        "room": last.room if last is not None else None,
        "row_slope_s": last.slope_s if last is not None else None,
        "shed_total": decode_gate.num_shed if decode_gate is not None else None,
        "why": _why(last, decode_gate),
        # measured / projected - 1 for one more turn, scored over the last minute
        "projection_error": decode_gate.projection_error()
        if decode_gate is not None else None,
    }


def _why(last: TurnRoom | None, gate: DecodeGate | None) -> str | None:
    """The decode gate's last answer in words (the floor it held and what decided)."""
    if gate is None or last is None:
        return None
    step = (f"{last.projected_now_s * 1e3:.0f} ms a step now, "
            f"{last.projected_next_s * 1e3:.0f} ms with one more row")
    if gate.auto:
        rule = "auto: rows while one more adds >= 10 % to the aggregate tokens/s"
    else:
        rule = f"floor {gate.floor_tps:g} tok/s: a step within {1e3 / gate.floor_tps:.0f} ms"
    if last.infeasible and not gate.auto:
        rule = (f"floor {gate.floor_tps:g} tok/s is out of reach (one row alone is over "
                f"it): rows at the knee until one fits again")
    verb = ("start one more turn" if last.room > 0 else
            f"pause {-last.room} running turn(s)" if last.room < 0 else "hold the rows")
    return f"{verb} ({rule}; {step})"


def _engine_doc(engine: Engine) -> dict[str, Any]:
    """Which engine runs (``PoolInfo.engine``) and, for a remote backend, the metrics it
    last exposed (``engine.backend_metrics()``, when the engine has one)."""
    try:
        name = engine.info.engine
    except (AttributeError, RuntimeError):  # a stub, or a pool not started yet
        name = None
    metrics = getattr(engine, "backend_metrics", None)
    return {"name": name, "backend": metrics() if callable(metrics) else None}


def _worker_rows(load: PoolLoad) -> list[dict[str, Any]]:
    """One row per pool session for ``capacity()["workers"]`` (the dashboard's chart)."""
    return [
        {
            "id": s.id,
            "state": s.state.value,
            "decodeTps": s.decode_tps,
            "dutyCycle": s.duty_cycle,
            "privateCells": s.private_cells,
            "ageS": round(s.age_s, 3),
        }
        for s in load.sessions
    ]
