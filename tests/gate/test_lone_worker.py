"""lone_worker_tps: what one worker alone gets, behind serve's unreachable-floor warning."""

from __future__ import annotations

import pytest

from mesh.gate.decide import lone_worker_tps
from mesh.gate.model import StepCost, ThroughputModel


def test_one_row_over_the_prefix_and_its_own_cells() -> None:
    cost = StepCost(a=0.010, b=0.002, c=1e-6, d=0.0, e=2e-7)
    model = ThroughputModel(prior=cost)
    cells = 6000 + 256
    step = 0.010 + 0.002 + 1e-6 * cells + 2e-7 * cells
    assert lone_worker_tps(model, 6000, 256) == pytest.approx(1.0 / step)


def test_a_longer_prefix_is_slower() -> None:
    model = ThroughputModel(prior=StepCost(a=0.01, b=0.002, c=1e-6, e=1e-7))
    assert lone_worker_tps(model, 30000, 256) < lone_worker_tps(model, 1200, 256)
