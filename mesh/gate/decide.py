"""The pure admission decision: ``decide(GateInput, GateConfig, ThroughputModel, now)``.

``decide`` asks how many more workers fit now — under the product's policies (``floor``,
``none``) the hard limits alone (the slots and sequence ids of
:func:`~mesh.gate.projection.project`), since the floor is held turn by turn by the decode
gate; under a comparison policy its :class:`WorkerRule` — then keeps the queue
first-come first-served: admit only with room *and* nobody queued ahead; otherwise wait
while the queue has room, else refuse. It never mutates its inputs. The clock (``now``) is
an input so that callers and tests control time; the decision only echoes it back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from mesh.gate.config import GateConfig
from mesh.gate.model import ThroughputModel
from mesh.gate.projection import GateInput, Projection, project

__all__ = ["Decision", "Verdict", "WorkerRule", "decide"]


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


class WorkerRule(Protocol):
    """A comparison policy (:mod:`mesh.sim.policies`): it admits each worker for its life
    on a rule of its own, and its workers' turns run as soon as they are asked for (no
    decode gate). Pure, like :func:`decide`."""

    @property
    def name(self) -> str:
        """The policy's name (``GateConfig.policy`` names it too)."""

    @property
    def needs_seed(self) -> bool:
        """Whether the rule reads the throughput model (the CLI then seeds it)."""

    def room(self, inp: GateInput, proj: Projection, config: GateConfig,
             now: float) -> tuple[int, str]:
        """More workers allowed now, within ``proj.hard_room``; why when zero."""

    def admit_reason(self, proj: Projection, room: int, config: GateConfig) -> str:
        """Why an admission happened, in the rule's own figures."""


def _room(inp: GateInput, config: GateConfig, proj: Projection, rule: WorkerRule | None,
          now: float) -> tuple[int, str]:
    """How many more workers the active policy allows now, and why (when zero)."""
    if proj.hard_room <= 0:
        return 0, f"no free worker slot ({inp.num_workers} workers hold or await one)"
    if inp.attach_block:
        return 0, f"the pool cannot attach now: {inp.attach_block}"
    if rule is not None:
        return rule.room(inp, proj, config, now)
    return proj.hard_room, ""


def _admit_reason(config: GateConfig, proj: Projection, room: int,
                  rule: WorkerRule | None) -> str:
    """Why an admission happened: what decided it, never a projection under the floor
    unexplained."""
    if rule is not None:
        return rule.admit_reason(proj, room, config)
    if config.policy == "floor":
        return (f"admit: room for {room} more worker(s) in memory; each turn then waits for "
                f"the decode gate, which starts it only while every decoding worker keeps "
                f"{config.floor_tps:g} tok/s")
    return f"admit: room for {room} more worker(s) under policy {config.policy}"


def _retry_after(inp: GateInput, config: GateConfig, slots_needed: int) -> float:
    if inp.mean_hold_s is not None and inp.mean_hold_s > 0:
        interval = inp.mean_hold_s / max(1, inp.num_workers)
    else:
        interval = config.default_retry_s
    return min(max(slots_needed * interval, config.recheck_s), config.max_retry_s)


def decide(inp: GateInput, config: GateConfig, model: ThroughputModel, now: float,
           rule: WorkerRule | None = None) -> Decision:
    """Admit, wait or refuse one more worker. Pure: reads its inputs, mutates nothing."""
    proj = project(inp, config, model)
    room, why = _room(inp, config, proj, rule, now)
    reasons: list[str] = [why] if why else []
    if room > 0 and inp.queue_ahead == 0:
        reasons.append(_admit_reason(config, proj, room, rule))
        return Decision(Verdict.ADMIT, 0.0, room, proj, tuple(reasons), now)
    if room > 0:
        reasons.append(f"{inp.queue_ahead} requests are queued ahead")
    if inp.queue_ahead < config.max_queue:
        retry = _retry_after(inp, config, inp.queue_ahead + 1)
        return Decision(Verdict.WAIT, retry, room, proj, tuple(reasons), now)
    reasons.append(f"the wait queue is full ({inp.queue_ahead} of {config.max_queue})")
    retry = _retry_after(inp, config, inp.queue_ahead - config.max_queue + 1)
    return Decision(Verdict.REFUSE, retry, room, proj, tuple(reasons), now)
