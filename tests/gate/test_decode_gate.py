"""The decode gate alone: measured steps in, turns that may start out (no model)."""

from __future__ import annotations

import pytest

from mesh.engine.types import StepSample
from mesh.gate.budget import BudgetState
from mesh.gate.decode_gate import DecodeGate, measured_ratio, turn_room
from mesh.gate.model import StepCost

# 10 ms a step plus 20 ms a decoding row; nothing else.
COST = StepCost(a=0.010, b=0.020, c=0.0, d=0.001, e=0.0)


def steps(rows: int, step_s: float, n: int = 6, prefill: int = 0) -> list[StepSample]:
    return [StepSample(num_decode=rows, num_prefill_tokens=prefill, sum_context=0,
                       step_s=step_s, cells_used=0) for _ in range(n)]


def test_measured_ratio_is_measured_over_modelled() -> None:
    ratio, rows = measured_ratio(COST, steps(2, 0.100))  # modelled 50 ms
    assert ratio == pytest.approx(2.0) and rows == 2
    assert measured_ratio(COST, []) == (1.0, 0)


def test_nothing_running_always_lets_one_turn_in() -> None:
    # Floor 100 tok/s: 10 ms a step; even one row (30 ms) is over it.
    assert turn_room(COST, 100.0, 0, 0, []).room == 1


def test_a_turn_starts_while_one_more_row_fits_the_floor() -> None:
    # Two rows measured at the model's 50 ms; floor 10 allows 100 ms (x 0.92 headroom):
    # a third row projects 70 ms -> in; a fourth would project 90 ms -> in only if
    # measured; past what is measured, one at a time.
    answer = turn_room(COST, 10.0, 2, 0, steps(2, 0.050))
    assert answer.room == 1
    assert answer.projected_now_s == pytest.approx(0.050)
    assert answer.projected_next_s == pytest.approx(0.074)  # + 4 tokens of prefill


def test_measured_steps_over_the_floor_start_no_turn() -> None:
    # A neighbour doubled every step: two rows now take 110 ms > 100 ms.
    answer = turn_room(COST, 10.0, 2, 0, steps(2, 0.110))
    assert answer.room == 0 and answer.ratio == pytest.approx(2.2)


def test_a_slow_neighbour_shrinks_what_fits() -> None:
    assert turn_room(COST, 10.0, 1, 0, steps(1, 0.030)).room == 1
    # The same one row measured 2.5x slower: 75 ms now, 125 ms with two -> none.
    assert turn_room(COST, 10.0, 1, 0, steps(1, 0.075)).room == 0


def test_a_fast_lone_row_is_not_extrapolated_past_what_was_measured() -> None:
    # One row measured at half the model (15 ms); floor 10. As measured, 3 more rows would
    # fit (r=0.5: 4 rows = 45 ms); past one measured row only r >= 1 counts, and one turn
    # starts per step beyond what runs.
    answer = turn_room(COST, 10.0, 1, 0, steps(1, 0.015))
    assert answer.room == 1


def test_within_measured_rows_the_measured_ratio_is_trusted() -> None:
    # Four rows measured fast (r = 0.5: 45 ms); two run now, so up to four are trusted.
    answer = turn_room(COST, 10.0, 2, 0, steps(4, 0.045))
    assert answer.room == 2


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="floor_tps"):
        turn_room(COST, 0.0, 0, 0, [])
    with pytest.raises(ValueError, match="must be >= 0"):
        turn_room(COST, 10.0, -1, 0, [])


def test_the_gate_object_remembers_its_last_answer_and_budgets_prefill() -> None:
    gate = DecodeGate(10.0, BudgetState(COST))
    assert gate.turn_room(2, 0, steps(2, 0.110)) == 0
    assert gate.last is not None and gate.last.room == 0
    # Two rows at the model's 50 ms leave 50 ms: 50 prefill tokens at 1 ms.
    assert gate(2, 0) == 50
    # Decode rows over the floor: prefill still progresses, 16 tokens a step.
    assert gate(5, 0) == 16


def test_projection_error_scores_the_first_step_at_the_projected_rows() -> None:
    now = [100.0]
    gate = DecodeGate(10.0, BudgetState(COST), clock=lambda: now[0])
    assert gate.projection_error()["count"] == 0
    assert gate.turn_room(2, 0, steps(2, 0.050)) == 1  # projects 3 rows at ~74 ms
    # Three rows then measured at 81.4 ms, no prefill: 10 % slower than projected.
    gate.turn_room(3, 0, steps(3, 0.0814))
    err = gate.projection_error()
    assert err["count"] == 1 and err["p50"] == pytest.approx(0.10, abs=0.01)
    now[0] += 61.0
    assert gate.projection_error()["count"] == 0  # older than a minute
