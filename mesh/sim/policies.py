"""The comparison policies: the admission rules the floor gate is measured against.

Each is a :class:`~mesh.gate.decide.WorkerRule`: it admits a worker for its life on its own
rule, its workers' turns run as soon as asked (no decode gate), and a step beside decoding
workers carries the prefill of a :class:`~mesh.gate.decode_gate.FloorBudget`. ``mesh serve
--policy NAME`` takes these names only for the simulation and the benches.

* ``projection``: the floor gate before the decode gate: admit only if, with one more,
  every worker's *projected* tokens/s (:func:`~mesh.gate.decide.project`) keeps the floor,
  new workers joining at most as many at a time as are measured.
* ``legacy``: admit while the slowest *measured* worker keeps the floor (over-subscribes on
  bursts).
* ``static:N``: at most N workers, whatever their speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mesh.gate.config import GateConfig
from mesh.gate.decide import GateInput, Projection, WorkerRule

__all__ = ["COMPARISON_POLICIES", "Legacy", "ProjectionRule", "Static", "parse_rule"]

COMPARISON_POLICIES = ("projection", "legacy", "static:N")


@dataclass(frozen=True)
class ProjectionRule:
    """Admit while the projection with one more worker clears the floor."""

    # New workers join at most as many at a time as are already measured (1, 2, 4, ...).
    slow_start: bool = True
    # A new worker counts as measured once it has decoded for this long (or 16 tokens).
    slow_start_s: float = 2.0
    name: str = "projection"
    needs_seed: bool = True

    def room(self, inp: GateInput, proj: Projection, config: GateConfig,
             now: float) -> tuple[int, str]:
        floor = config.floor_tps
        if proj.headroom > 0:
            room, why = proj.headroom, ""
        elif inp.num_workers == 0:
            # Nobody runs, so nobody can be slowed down: one worker always starts, or a
            # floor above what the hardware does alone would starve the queue forever.
            return 1, (f"projected {proj.tps_next:.2f} tok/s is below the floor of {floor:g} "
                       "even alone; admitting one worker since none is running")
        else:
            return 0, (f"projected {proj.tps_next:.2f} tok/s per worker with one more, "
                       f"below the floor of {floor:g}")
        if self.slow_start:
            # A worker cannot be taken back, so the projection is checked against real
            # steps before the next wave instead of trusted for a burst. A session that has
            # not decoded within min_duty_age_s (an API session left idle) is not waited
            # for. Ages are as of the snapshot; a pool with nothing to decode takes no new
            # one, so the time since it was taken is added (else an idle one never ages).
            since = max(0.0, now - inp.load.taken_at)
            measured = sum(
                1 for s in inp.load.sessions
                if (s.decode_tps is not None
                    and (s.age_s + since >= self.slow_start_s or s.num_generated >= 16))
                or s.age_s + since >= config.min_duty_age_s)
            unmeasured = inp.num_workers - measured
            if unmeasured >= max(1, measured):
                return 0, f"slow start: {unmeasured} new workers are not measured yet"
        return room, why

    def admit_reason(self, proj: Projection, room: int, config: GateConfig) -> str:
        if proj.tps_next >= config.floor_tps:
            return (f"admit: projected {proj.tps_next:.2f} tok/s per worker with one more, "
                    f"at or above the floor of {config.floor_tps:g}")
        return "admit: the one worker that always runs when none is running"


@dataclass(frozen=True)
class Legacy:
    """Admit while the slowest measured worker keeps the floor."""

    name: str = "legacy"
    needs_seed: bool = True

    def room(self, inp: GateInput, proj: Projection, config: GateConfig,
             now: float) -> tuple[int, str]:
        measured = [s.decode_tps for s in inp.load.sessions if s.decode_tps is not None]
        slowest = min(measured, default=math.inf)
        if slowest >= config.floor_tps or inp.num_workers == 0:
            return proj.hard_room, ""
        return 0, (f"slowest measured worker runs {slowest:.2f} tok/s, below the floor of "
                   f"{config.floor_tps:g}")

    def admit_reason(self, proj: Projection, room: int, config: GateConfig) -> str:
        return f"admit: room for {room} more worker(s) under policy {self.name}"


@dataclass(frozen=True)
class Static:
    """At most ``slots`` workers."""

    slots: int
    needs_seed: bool = False

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"static policy needs slots >= 1, got {self.slots}")

    @property
    def name(self) -> str:
        return f"static:{self.slots}"

    def room(self, inp: GateInput, proj: Projection, config: GateConfig,
             now: float) -> tuple[int, str]:
        room = min(self.slots - inp.num_workers, proj.hard_room)
        if room > 0:
            return room, ""
        return 0, f"all {self.slots} static slots are in use"

    def admit_reason(self, proj: Projection, room: int, config: GateConfig) -> str:
        return f"admit: room for {room} more worker(s) under policy {self.name}"


def parse_rule(text: str) -> WorkerRule:
    """``projection``, ``legacy`` or ``static:N`` (case-insensitive); ValueError names the
    choices."""
    raw = text.strip().lower()
    name, sep, arg = raw.partition(":")
    if name == "static":
        if not arg:
            raise ValueError(f"policy {text!r} needs a slot count, e.g. static:4")
        try:
            return Static(int(arg))
        except ValueError as e:
            if "slots" in str(e):
                raise
            raise ValueError(f"policy {text!r}: slot count {arg!r} is not an integer") from None
    if sep:
        raise ValueError(f"policy {name!r} takes no argument, got {text!r}")
    if name == "projection":
        return ProjectionRule()
    if name == "legacy":
        return Legacy()
    raise ValueError(f"unknown gate policy {text!r}; expected floor or none (or, to compare, "
                     f"{', '.join(COMPARISON_POLICIES)})")
