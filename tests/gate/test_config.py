"""GateConfig and policy parsing: clear errors, no I/O."""

from __future__ import annotations

from typing import Any

import pytest

from mesh.gate.config import GateConfig, Policy, PolicyKind


@pytest.mark.parametrize(
    ("text", "kind", "slots"),
    [
        ("floor", PolicyKind.FLOOR, None),
        (" Legacy ", PolicyKind.LEGACY, None),
        ("static:4", PolicyKind.STATIC, 4),
        ("none", PolicyKind.NONE, None),
    ],
)
def test_policies_parse_and_print_back(text: str, kind: PolicyKind, slots: int | None) -> None:
    policy = Policy.parse(text)
    assert (policy.kind, policy.slots) == (kind, slots)
    assert Policy.parse(str(policy)) == policy


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
        Policy.parse(text)


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


def test_create_parses_and_validates() -> None:
    config = GateConfig.create(floor_tps=4.0, policy="static:2", max_queue=0)
    assert config.policy == Policy(PolicyKind.STATIC, 2)
    assert GateConfig().policy.kind is PolicyKind.FLOOR
    GateConfig().validate()
