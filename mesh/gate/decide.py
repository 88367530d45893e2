"""The pure admission decision: ``decide(GateInput, GateConfig, ThroughputModel, now)``.

``decide`` asks the active policy how many more workers fit now (``floor`` reads the
projection of :mod:`mesh.gate.projection`; ``legacy`` the slowest measured worker;
``static:N`` a count; ``none`` only the hard limits), then keeps the queue first-come
first-served: admit only with room *and* nobody queued ahead; otherwise wait while the queue
has room, else refuse. It never mutates its inputs. The clock (``now``) is an input so that
callers and tests control time; the decision only echoes it back.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from mesh.gate.config import GateConfig, PolicyKind
from mesh.gate.model import ThroughputModel
from mesh.gate.projection import GateInput, Projection, WorkerTps, project

__all__ = ["Decision", "GateInput", "Projection", "Verdict", "WorkerTps", "decide", "project"]


class Verdict(enum.StrEnum):
    ADMIT = "admit"
    WAIT = "wait"  # queue it; retry_after_s estimates when
    REFUSE = "refuse"  # the queue is full


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    retry_after_s: float  # 0.0 when admitted
    headroom: int  # more workers that fit now under the active policy
    projection: Projection
    reasons: tuple[str, ...]
    decided_at: float

    @property
    def admitted(self) -> bool:
        return self.verdict is Verdict.ADMIT


def _policy_room(inp: GateInput, config: GateConfig, proj: Projection) -> tuple[int, str]:
    """How many more workers the active policy allows now, and why (when zero)."""
    floor = config.floor_tps
    kind = config.policy.kind
    if proj.hard_room <= 0:
        return 0, f"no free worker slot ({inp.num_workers} workers hold or await one)"
    if inp.attach_block:
        return 0, f"the pool cannot attach now: {inp.attach_block}"
    if kind is PolicyKind.FLOOR:
        # The decode gate holds the floor turn by turn; a worker is admitted by memory.
        return proj.hard_room, ""
    if kind is PolicyKind.PROJECTION:
        if proj.headroom > 0:
            return proj.headroom, ""
        if inp.num_workers == 0:
            # Nobody runs, so nobody can be slowed down: one worker always starts, or a
            # floor above what the hardware does alone would starve the queue forever.
            return 1, (
                f"projected {proj.tps_next:.2f} tok/s is below the floor of {floor:g} even "
                "alone; admitting one worker since none is running"
            )
        return 0, (
            f"projected {proj.tps_next:.2f} tok/s per worker with one more, "
            f"below the floor of {floor:g}"
        )
    if kind is PolicyKind.LEGACY:
        measured = [s.decode_tps for s in inp.load.sessions if s.decode_tps is not None]
        slowest = min(measured, default=math.inf)
        if slowest >= floor or inp.num_workers == 0:
            return proj.hard_room, ""
        return 0, f"slowest measured worker runs {slowest:.2f} tok/s, below the floor of {floor:g}"
    if kind is PolicyKind.STATIC:
        slots = config.policy.slots or 0
        room = min(slots - inp.num_workers, proj.hard_room)
        if room > 0:
            return room, ""
        return 0, f"all {slots} static slots are in use"
    return proj.hard_room, ""


def _admit_reason(config: GateConfig, proj: Projection, room: int) -> str:
    """Why an admission happened, in words that never pair *admit* with a projection
    under the floor unexplained: the figure that decided, or what decided instead."""
    floor, kind = config.floor_tps, config.policy.kind
    if kind is PolicyKind.FLOOR:
        return (f"admit: room for {room} more worker(s) in memory; each turn then waits for "
                f"the decode gate, which starts it only while every decoding worker keeps "
                f"{floor:g} tok/s")
    if kind is PolicyKind.PROJECTION and proj.tps_next >= floor:
        return (f"admit: projected {proj.tps_next:.2f} tok/s per worker with one more, at "
                f"or above the floor of {floor:g}")
    if kind is PolicyKind.PROJECTION:  # the lone-worker rule above said why
        return "admit: the one worker that always runs when none is running"
    return f"admit: room for {room} more worker(s) under policy {config.policy}"


def _retry_after(inp: GateInput, config: GateConfig, slots_needed: int) -> float:
    if inp.mean_hold_s is not None and inp.mean_hold_s > 0:
        interval = inp.mean_hold_s / max(1, inp.num_workers)
    else:
        interval = config.default_retry_s
    return min(max(slots_needed * interval, config.recheck_s), config.max_retry_s)


def decide(inp: GateInput, config: GateConfig, model: ThroughputModel, now: float) -> Decision:
    """Admit, wait or refuse one more worker. Pure: reads its inputs, mutates nothing."""
    proj = project(inp, config, model)
    room, why = _policy_room(inp, config, proj)
    reasons: list[str] = [why] if why else []
    if room > 0 and config.policy.kind is PolicyKind.PROJECTION and config.slow_start:
        # Slow start: a worker cannot be taken back, so new workers join at most as many
        # at a time as are already measured (1, 2, 4, ...) and the projection is checked
        # against real steps before the next wave, instead of trusting it for a burst.
        # A session that has not decoded within min_duty_age_s (an API session left idle)
        # is not waited for any longer.
        # Ages are as of the snapshot; a pool with nothing to decode takes no new one, so
        # the time since it was taken is added (else an idle session never ages out).
        since = max(0.0, now - inp.load.taken_at)
        measured = sum(
            1
            for s in inp.load.sessions
            if (s.decode_tps is not None
                and (s.age_s + since >= config.slow_start_s or s.num_generated >= 16))
            or s.age_s + since >= config.min_duty_age_s
        )
        unmeasured = inp.num_workers - measured
        if unmeasured >= max(1, measured):
            reasons.append(f"slow start: {unmeasured} new workers are not measured yet")
            room = 0
    if room > 0 and inp.queue_ahead == 0:
        reasons.append(_admit_reason(config, proj, room))
        return Decision(Verdict.ADMIT, 0.0, room, proj, tuple(reasons), now)
    if room > 0:
        reasons.append(f"{inp.queue_ahead} requests are queued ahead")
    if inp.queue_ahead < config.max_queue:
        retry = _retry_after(inp, config, inp.queue_ahead + 1)
        return Decision(Verdict.WAIT, retry, room, proj, tuple(reasons), now)
    reasons.append(f"the wait queue is full ({inp.queue_ahead} of {config.max_queue})")
    retry = _retry_after(inp, config, inp.queue_ahead - config.max_queue + 1)
    return Decision(Verdict.REFUSE, retry, room, proj, tuple(reasons), now)
