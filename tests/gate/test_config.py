"""GateConfig and policy parsing: clear errors, no I/O."""

from __future__ import annotations

from typing import Any

import pytest

from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from mesh.sim.fake import FakeEngine
from mesh.sim.policies import Legacy, ProjectionRule, Static, parse_rule


@pytest.mark.parametrize(
    ("text", "rule"),
    [(" Legacy ", Legacy()), ("static:4", Static(4)), ("projection", ProjectionRule())],
)
def test_comparison_policies_parse_and_print_back(text: str, rule: object) -> None:
    parsed = parse_rule(text)
    assert parsed == rule
    assert parse_rule(parsed.name) == parsed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fast", "unknown gate policy"),
        ("static", "needs a slot count"),
        ("static:", "needs a slot count"),
        ("static:x", "not an integer"),
        ("static:0", "slots >= 1"),
        ("floor:3", "takes no argument"),
    ],
)
def test_bad_policies_say_why(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_rule(text)


def test_the_product_gate_takes_floor_or_none_and_a_comparison_only_with_its_rule() -> None:
    for name in ("floor", " None "):
        FloorGate(FakeEngine(), GateConfig.create(policy=name))
    with pytest.raises(ValueError, match="needs its rule"):
        FloorGate(FakeEngine(), GateConfig.create(policy="legacy"))
    with pytest.raises(ValueError, match="does not implement"):
        FloorGate(FakeEngine(), GateConfig.create(policy="legacy"), rule=Static(2))
    gate = FloorGate(FakeEngine(), GateConfig.create(policy="static:2"), rule=Static(2))
    assert gate.capacity()["policy"] == "static:2"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"floor_tps": 0}, "floor_tps"),
        ({"floor_tps": float("nan")}, "floor_tps"),
        ({"floor_tps": float("inf")}, "floor_tps"),
        ({"max_queue": -1}, "max_queue"),
        ({"max_workers": 0}, "max_workers"),
        ({"recheck_s": 0}, "recheck_s"),
        ({"default_retry_s": 500.0}, "default_retry_s"),
        ({"new_worker_cells": -1}, "new_worker_cells"),
    ],
)
def test_bad_configs_say_why(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GateConfig.create(**kwargs)


def test_create_normalizes_and_validates() -> None:
    assert GateConfig.create(floor_tps=4.0, policy=" Floor ", max_queue=0).policy == "floor"
    assert GateConfig().policy == "floor"
    GateConfig().validate()
    with pytest.raises(ValueError, match="auto needs --policy floor"):
        GateConfig.create(policy="none", auto_floor=True)
