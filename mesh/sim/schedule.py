"""The neighbour's schedule: when the second tenant is on, as a pure function of a spec
and a seed, so every policy of a comparison sees the same one.

Two forms of spec:

* ``random:LO-HI`` or ``random:ON_LO-ON_HI/OFF_LO-OFF_HI`` — alternating phases, off
  first (a quiet start), each phase's length drawn uniformly from its range (seconds) by
  ``random.Random(seed)``;
* ``off:5,on:10,off:3,...`` — explicit phases, repeated from the start when they run out.

:func:`plan_phases` lays the phases out up to a horizon; the run starts and stops the load
at those times and records when it actually did (:class:`~mesh.sim.types.PhaseRecord`).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["PlannedPhase", "Schedule", "iter_phases", "parse_schedule", "plan_phases"]

_HELP = ("--neighbour-schedule random:LO-HI[/LO-HI] (seconds on[/off]) or on:S,off:S,... "
         "(repeated)")


@dataclass(frozen=True)
class Schedule:
    """A parsed spec: ``explicit`` phases, or the ``on`` / ``off`` ranges to draw from."""

    explicit: tuple[tuple[bool, float], ...] = ()  # (on, seconds)
    on: tuple[float, float] = (5.0, 15.0)
    off: tuple[float, float] = (5.0, 15.0)


@dataclass(frozen=True)
class PlannedPhase:
    on: bool
    start: float
    end: float


def _range(text: str, spec: str) -> tuple[float, float]:
    lo, sep, hi = text.partition("-")
    try:
        low = float(lo)
        high = float(hi) if sep else low
    except ValueError:
        raise ValueError(f"bad neighbour schedule {spec!r}; pass {_HELP}") from None
    if not 0 < low <= high:
        raise ValueError(f"neighbour schedule {spec!r}: a range needs 0 < LO <= HI")
    return low, high


def parse_schedule(spec: str) -> Schedule:
    """Parse a schedule spec (see the module docstring); ``ValueError`` names the forms."""
    text = spec.strip().lower()
    if text.startswith("random:"):
        on, _, off = text[len("random:"):].partition("/")
        on_range = _range(on, spec)
        return Schedule(on=on_range, off=_range(off, spec) if off else on_range)
    phases: list[tuple[bool, float]] = []
    for item in text.split(","):
        state, sep, secs = item.strip().partition(":")
        if not sep or state not in ("on", "off"):
            raise ValueError(f"bad neighbour schedule {spec!r}; pass {_HELP}")
        length = _range(secs, spec)[0]
        phases.append((state == "on", length))
    if not any(on for on, _ in phases):
        raise ValueError(f"neighbour schedule {spec!r} is never on; add an on:S phase")
    return Schedule(explicit=tuple(phases))


def iter_phases(spec: str, seed: int) -> Iterator[PlannedPhase]:
    """The phases from 0 on, without end (the caller stops). Pure: the same spec and seed
    give the same phases whatever runs beside them."""
    schedule = parse_schedule(spec)
    rng = random.Random(seed)
    t = 0.0
    for i in itertools.count():
        if schedule.explicit:
            on, length = schedule.explicit[i % len(schedule.explicit)]
        else:
            on = i % 2 == 1  # off first: a quiet start
            lo, hi = schedule.on if on else schedule.off
            length = rng.uniform(lo, hi)
        yield PlannedPhase(on, round(t, 3), round(t + length, 3))
        t += length


def plan_phases(spec: str, seed: int, horizon_s: float) -> list[PlannedPhase]:
    """The phases from 0 to at least ``horizon_s`` (the last one crosses it)."""
    out: list[PlannedPhase] = []
    for phase in iter_phases(spec, seed):
        if phase.start >= horizon_s and out:
            break
        out.append(phase)
    return out
