"""The prefill budget: the largest chunk that keeps a step within 1/floor_tps."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from mesh.gate.decode_gate import MIN_CHUNK, BudgetState, DecodeGate, FloorBudget, prefill_budget
from mesh.gate.model import StepCost
from mesh.sim.fake import FakeEngine
from tests.gate.rules import floor_gate

COST = StepCost(a=0.010, b=0.010, c=0.0, d=0.001, e=0.0)


def test_budget_fills_the_step_up_to_the_floor() -> None:
    # floor 10 tok/s: 100 ms a step; 4 rows cost 50 ms; 50 ms / 1 ms = 50 tokens.
    assert prefill_budget(COST, 10.0, 4, 0) == 50
    # The projected step with that chunk is within the floor, one more token is not.
    assert COST.step_s(4, 0, 50) <= 0.1 + 1e-12 < COST.step_s(4, 0, 51 + MIN_CHUNK)


def test_cells_in_use_shrink_the_budget() -> None:
    cost = StepCost(a=0.010, b=0.010, c=0.0, d=0.001, e=1e-7)
    small = prefill_budget(cost, 10.0, 4, 1_000)
    large = prefill_budget(cost, 10.0, 4, 50_000)
    assert small > large >= MIN_CHUNK
    n = prefill_budget(cost, 10.0, 4, 5_000)
    assert n > MIN_CHUNK
    assert cost.step_s(4, 0, n, 5_000) <= 0.1 + 1e-9 < cost.step_s(4, 0, n + 1, 5_000)


def test_over_the_floor_already_the_step_at_most_doubles() -> None:
    # floor 100 tok/s: 10 ms a step; 8 rows alone cost 90 ms, so no chunk keeps the floor.
    # The budget lets the step double (90 tokens at 1 ms) rather than crawl at MIN_CHUNK.
    n = prefill_budget(COST, 100.0, 8, 0)
    assert n == 90
    assert COST.step_s(8, 0, n) <= 2 * COST.step_s(8, 0, 0) + 1e-12
    # A decode step too cheap to pay for min_chunk tokens still progresses by min_chunk.
    cheap = StepCost(a=0.001, b=0.0, c=0.0, d=0.001, e=0.0)
    assert prefill_budget(cheap, 2000.0, 1, 0) == MIN_CHUNK


def test_nothing_decoding_is_unbounded() -> None:
    assert prefill_budget(COST, 10.0, 0, 10_000) >= 1 << 20


def test_a_slower_machine_now_shrinks_the_budget() -> None:
    assert prefill_budget(COST, 10.0, 4, 0, scale=1.5) < prefill_budget(COST, 10.0, 4, 0)


@pytest.mark.parametrize(
    ("floor", "n", "cells", "kw"),
    [
        (0.0, 1, 0, {}),
        (float("inf"), 1, 0, {}),
        (float("nan"), 1, 0, {}),
        (5.0, -1, 0, {}),
        (5.0, 1, -1, {}),
        (5.0, 1, 0, {"scale": 0.0}),
        (5.0, 1, 0, {"min_chunk": 0}),
    ],
)
def test_bad_input_is_a_value_error(floor: float, n: int, cells: int, kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        prefill_budget(COST, floor, n, cells, **kw)  # type: ignore[arg-type]


@given(n=st.integers(1, 64), cells=st.integers(0, 100_000), floor=st.floats(0.5, 50.0))
def test_budget_is_monotone_in_load_while_the_floor_can_hold(
    n: int, cells: int, floor: float
) -> None:
    cost = StepCost(a=0.005, b=0.004, c=1e-6, d=0.0005, e=5e-8)

    def holds(n: int, cells: int, floor: float) -> bool:  # decode rows alone within 1/floor
        return cost.step_s(n, cells * n, 0, cells) < 1.0 / floor

    b = prefill_budget(cost, floor, n, cells)
    assert b >= MIN_CHUNK
    if holds(n + 1, cells, floor):
        assert prefill_budget(cost, floor, n + 1, cells) <= b
    if holds(n, cells + 1000, floor):
        assert prefill_budget(cost, floor, n, cells + 1000) <= b
    if holds(n, cells, floor * 2):
        assert prefill_budget(cost, floor * 2, n, cells) <= b
    if not holds(n, cells, floor):  # past the floor: the step at most doubles
        fixed = cost.step_s(n, cells * n, 0, cells)
        assert cost.step_s(n, cells * n, b, cells) <= 2 * fixed + cost.d * MIN_CHUNK


def test_pool_budget_per_policy_and_follows_the_model() -> None:
    engine = FakeEngine()
    assert FloorGate(engine, GateConfig.create(policy="none")).pool_budget() is None
    floor = FloorGate(engine, GateConfig.create(policy="floor"))
    assert isinstance(floor.pool_budget(), DecodeGate)  # the decode gate budgets prefill
    assert floor.pool_budget() is floor.decode_gate()
    gate = floor_gate(engine, "projection", floor_tps=5.0)  # a comparison policy's budget
    budget = gate.pool_budget()
    assert isinstance(budget, FloorBudget)
    assert gate.pool_budget() is budget
    assert budget(2, 100) == prefill_budget(gate.model.params, 5.0, 2, 100,
                                            context_per_row=None)
    budget.update(BudgetState(StepCost(0.0, 0.001, 0.0, 0.001, 0.0)))
    assert budget(2, 100) == 198
    gate.gate_input(0)  # a snapshot refreshes the state from the model
    assert budget.state.cost == gate.model.params
    for policy in ("legacy", "static:3"):
        assert floor_gate(engine, policy).pool_budget() is not None
