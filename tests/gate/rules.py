"""Tests' one way to build a gate under any policy: the product's (``floor``, ``none``) by
name, a comparison policy (:mod:`mesh.sim.policies`) with its rule."""

from __future__ import annotations

from typing import Any

from mesh.engine.interface import Engine
from mesh.gate.admission import FloorGate
from mesh.gate.config import POLICIES, GateConfig
from mesh.gate.decide import WorkerRule
from mesh.gate.model import ThroughputModel
from mesh.sim.policies import ProjectionRule, parse_rule


def config_and_rule(policy: str = "floor", *, slow_start: bool = False,
                    slow_start_s: float = 2.0,
                    **cfg: Any) -> tuple[GateConfig, WorkerRule | None]:
    """``policy``'s config and rule; ``projection`` without slow start unless asked (a
    fake engine never measures a worker)."""
    if policy.strip().lower() in POLICIES:
        return GateConfig.create(policy=policy, **cfg), None
    rule = parse_rule(policy)
    if isinstance(rule, ProjectionRule):
        rule = ProjectionRule(slow_start=slow_start, slow_start_s=slow_start_s)
    return GateConfig.create(policy=rule.name, **cfg), rule


def floor_gate(engine: Engine, policy: str = "floor", model: ThroughputModel | None = None,
               **cfg: Any) -> FloorGate:
    config, rule = config_and_rule(policy, **cfg)
    return FloorGate(engine, config, model, rule=rule)
