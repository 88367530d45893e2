"""Small readings of a run shared by the summary (:mod:`mesh.sim.report`) and the
per-phase figures (:mod:`mesh.sim.phases`). Pure."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mesh.sim.types import Sample, SimRun

__all__ = ["cap_num", "floor_of", "num", "percentile", "workers"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def cap_num(cap: Mapping[str, Any], *keys: str) -> float | None:
    """The number at ``cap[keys[0]][keys[1]]...`` of a ``/capacity`` document (None where
    a key is missing or the value is not a number)."""
    value: Any = cap
    for key in keys:
        value = value.get(key) if isinstance(value, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def workers(sample: Sample) -> int:
    """Admitted workers in a sample (the gate's tickets, else every session)."""
    cap = sample.capacity
    tickets = num(cap.get("tickets"))
    if tickets is not None:
        return int(tickets)
    return int(num(cap.get("sessions", {}).get("total")) or 0)


def floor_of(run: SimRun) -> float | None:
    """The floor the server applied (from its samples), else the configured one; under
    ``floor-auto`` the configured one, the reference its windows are measured against."""
    if run.config.policy == "floor-auto" and run.config.floor_tps is not None:
        return run.config.floor_tps
    for s in run.samples:
        floor = num(s.capacity.get("floor_tps"))
        if floor is not None:
            return floor
    return run.config.floor_tps


