"""The decode gate alone: measured steps in, turns that may start (or pause) out."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.engine.interface import StepSample
from mesh.gate.decode_gate import BudgetState, DecodeGate, measured_ratio, turn_room
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
    # Two rows measured at 50 ms, one at 30 ms: a row costs 20 ms. Floor 10 allows 92 ms
    # (x 0.92 headroom): a third row is predicted at 70 ms -> in; past what is measured,
    # one at a time.
    answer = turn_room(COST, 10.0, 2, 0, steps(1, 0.030) + steps(2, 0.050))
    assert answer.room == 1
    assert answer.projected_now_s == pytest.approx(0.050)
    assert answer.projected_next_s == pytest.approx(0.070)
    assert answer.slope_s == pytest.approx(0.020)


def test_one_measured_row_count_predicts_a_row_at_the_average_row() -> None:
    # Only two rows measured (50 ms): the next row is guessed at 25 ms (linear) -> 75 ms.
    answer = turn_room(COST, 10.0, 2, 0, steps(2, 0.050))
    assert answer.room == 1 and answer.projected_next_s == pytest.approx(0.075)
    # At 62 ms the guess is 93 ms: within 100 ms but not within the 92 % headroom.
    assert turn_room(COST, 10.0, 2, 0, steps(2, 0.062)).room == 0


def test_steps_just_under_the_floor_start_nothing_and_shed_nothing() -> None:
    # Two rows at 95 ms: over the grow threshold, under the floor (the hysteresis gap).
    assert turn_room(COST, 10.0, 2, 0, steps(2, 0.095)).room == 0


def test_measured_steps_over_the_floor_shed_rows_between_steps() -> None:
    # A neighbour: the last eight steps at four rows took 160 ms > 100 ms: a row costs at
    # least a quarter of the average row (10 ms) -> shed ceil(68 / 10), at most half: 2.
    answer = turn_room(COST, 10.0, 4, 0, steps(1, 0.040) + steps(4, 0.160, n=8))
    assert answer.room == -2 and answer.client_step_s == pytest.approx(0.160)
    # 105 ms at three rows: just over -> one.
    assert turn_room(COST, 10.0, 3, 0, steps(3, 0.105, n=8)).room == -1
    # The last running turn is never paused, however slow its steps (here: prefill).
    assert turn_room(COST, 10.0, 2, 0, steps(1, 0.05) + steps(2, 0.500, n=8)).room == -1
    slow = steps(1, 0.05) + steps(1, 0.500, n=8, prefill=64)
    assert turn_room(COST, 10.0, 1, 0, slow).room == 0


def test_after_a_shed_the_next_steps_are_measured_first() -> None:
    # Shed from four rows to three: until eight steps ran at three, no second shed.
    recent = steps(4, 0.160, n=8) + steps(3, 0.130, n=3)
    assert turn_room(COST, 10.0, 3, 0, recent).room == 0
    assert turn_room(COST, 10.0, 3, 0, recent + steps(3, 0.130, n=5)).room == -1


def test_one_slow_step_in_a_window_sheds_nothing() -> None:
    # One 200 ms step among seven of 60 ms: the reader's 8-token window reads 77.5 ms.
    recent = steps(3, 0.060, n=7) + steps(3, 0.200, n=1)
    assert turn_room(COST, 10.0, 3, 0, recent).room >= 0


def test_rows_come_back_when_the_neighbour_leaves() -> None:
    # Shed to one row under the neighbour; it leaves: one row measures 30 ms again and the
    # slow two-row steps have aged out of the fresh window -> a row starts at once.
    slow = steps(2, 0.130, n=3)
    fast = steps(1, 0.030, n=24)
    assert turn_room(COST, 10.0, 1, 0, slow + fast).room == 1


def test_a_slow_neighbour_shrinks_what_fits() -> None:
    assert turn_room(COST, 10.0, 1, 0, steps(1, 0.030)).room == 1
    # The same one row measured 2.5x slower: 75 ms now, 150 ms with two -> none.
    assert turn_room(COST, 10.0, 1, 0, steps(1, 0.075)).room == 0


def test_a_fast_lone_row_starts_one_more_at_a_time() -> None:
    # One row measured at 15 ms; floor 10: many would fit, but past what is measured one
    # turn starts per step, so the next step measures it first.
    assert turn_room(COST, 10.0, 1, 0, steps(1, 0.015)).room == 1


def test_one_turn_starts_a_step_and_only_over_measured_rows() -> None:
    # Four rows measured at 45 ms; two run now: room for more, one a step.
    answer = turn_room(COST, 10.0, 2, 0, steps(2, 0.030) + steps(4, 0.045))
    assert answer.room == 1 and answer.projected_next_s == pytest.approx(0.0375)
    # Three run, never measured yet (the new one still prefills): wait for a measurement.
    assert turn_room(COST, 10.0, 3, 0, steps(2, 0.030)).room == 0


def test_prefill_beside_rows_counts_for_the_reader_and_is_priced_as_measured() -> None:
    # Two rows decode at 50 ms; steps with a 20-token chunk take 150 ms: a prefill token
    # costs 5 ms. Three such steps in the window: the reader sees 87.5 ms -> no new row.
    recent = steps(1, 0.030) + steps(2, 0.050, n=5) + steps(2, 0.150, n=3, prefill=20)
    answer = turn_room(COST, 10.0, 2, 0, recent)
    assert answer.prefill_token_s == pytest.approx(0.005)
    assert answer.client_step_s == pytest.approx(0.0875) and answer.room == 0


def test_steps_with_prefill_are_not_taken_for_decode_steps() -> None:
    # Two rows with a 64-token chunk took 150 ms: that says nothing of two rows' step.
    recent = steps(1, 0.030, n=8) + steps(2, 0.050, n=8) + steps(2, 0.150, n=1, prefill=64)
    answer = turn_room(COST, 10.0, 2, 0, recent)
    assert answer.projected_now_s == pytest.approx(0.050)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="floor_tps"):
        turn_room(COST, 0.0, 0, 0, [])
    with pytest.raises(ValueError, match="must be >= 0"):
        turn_room(COST, 10.0, -1, 0, [])


def test_the_gate_object_remembers_its_last_answer_and_budgets_prefill() -> None:
    gate = DecodeGate(10.0, BudgetState(COST))
    # Before any measurement the model prices prefill: two rows at its 50 ms leave 50 ms,
    # 50 prefill tokens at 1 ms.
    assert gate(2, 0) == 50
    assert gate.turn_room(2, 0, steps(1, 0.030) + steps(2, 0.110, n=8)) == -1
    assert gate.last is not None and gate.last.room == -1 and gate.num_shed == 1
    # Measured: one row at 30 ms, a row costs 80 ms (no prefill measured yet: priced as a
    # row): 62 ms left under 92 -> no token beyond the minimum chunk; two rows are over
    # the floor -> 16 tokens (progress).
    assert gate(1, 0) == 4
    assert gate(2, 0) == 16
    # A row count never measured: the model's price again.
    assert gate(5, 0) == 16


def test_projection_error_scores_the_first_step_at_the_projected_rows() -> None:
    now = [100.0]
    gate = DecodeGate(10.0, BudgetState(COST), clock=lambda: now[0])
    assert gate.projection_error()["count"] == 0
    assert gate.turn_room(2, 0, steps(1, 0.026) + steps(2, 0.050)) == 1  # 3 rows at 74 ms
    # Three rows then measured at 81.4 ms, no prefill: 10 % slower than projected.
    gate.turn_room(3, 0, steps(3, 0.0814))
    err = gate.projection_error()
    assert err["count"] == 1 and err["p50"] == pytest.approx(0.10, abs=0.01)
    now[0] += 61.0
    assert gate.projection_error()["count"] == 0  # older than a minute


# ---------------------------------------------------------------- --floor-tps auto


def cpu_like(rows: int, n: int = 6) -> list[StepSample]:
    """A compute-bound CPU: 30 ms for one row, 24 ms for each more (a 6 ms shared part).
    The shared part's share of the step: 1 row 20 %, 2 rows 11 %, 3 rows 8 %."""
    return steps(rows, 0.030 + 0.024 * (rows - 1), n=n)


def light_cpu(rows: int, n: int = 6) -> list[StepSample]:
    """This CPU under the light template (5.6K shared prefix): ~120 ms a step shared, ~17
    ms a row. Aggregate tok/s: 6 rows 27.0, 7 rows 29.3 (+8.4 %), 13 rows 38.1, 20 rows
    43.5: each row still adds well over a quarter of an average row's rate up to ~20."""
    return steps(rows, 0.120 + 0.017 * rows, n=n)


def test_auto_tries_an_untried_row_and_grows_while_the_shared_part_pays() -> None:
    assert turn_room(COST, 1.0, 0, 0, [], auto=True).room == 1
    assert turn_room(COST, 1.0, 1, 0, cpu_like(1), auto=True).room == 1  # two never tried
    # Measured at one and two rows: a second row leaves a 6 ms shared part of a 54 ms
    # step (11 %): the knee is one row on this compute-bound CPU.
    assert turn_room(COST, 1.0, 1, 0, cpu_like(2) + cpu_like(1), auto=True).room == 0


def test_auto_grows_past_ten_percent_aggregate_while_rows_share_the_step() -> None:
    # The rule of "one more row adds 10 % aggregate" stopped at 6 rows here, where the
    # 13 rows legacy ran delivered 40 % more tokens/s. With 12 rows running the 13th
    # leaves a 120 ms shared part of a 341 ms step (35 %): start it.
    recent = light_cpu(10) + light_cpu(11) + light_cpu(12)
    assert turn_room(COST, 1.0, 12, 0, recent, auto=True).room == 1
    # At 21 rows the 22nd would leave 24 %: hold.
    recent = light_cpu(19) + light_cpu(20) + light_cpu(21)
    assert turn_room(COST, 1.0, 21, 0, recent, auto=True).room == 0


def test_auto_grows_while_turns_still_prefill_beside_the_measured_rows() -> None:
    # Measured in the light scenario: 8 turns running, 6 of them decoding, 2 prefilling
    # their tool results; steps with more than a few prefill tokens are not "measured by
    # rows", so 8 rows never were. A rule that waited for 8 to be measured held 5-8 rows
    # for the whole run (13.9 tok/s against legacy's 19.4).
    recent = light_cpu(5) + light_cpu(6)
    assert turn_room(COST, 1.0, 8, 0, recent, auto=True).room == 1
    # With one row count measured and no slope yet, it still waits for the rows running now.
    assert turn_room(COST, 1.0, 8, 0, light_cpu(6), auto=True).room == 0


def test_auto_sheds_a_row_once_the_shared_part_is_under_its_share() -> None:
    # Three rows: the shared part is 8 % of the step: pause one.
    assert turn_room(COST, 1.0, 3, 0, cpu_like(2) + cpu_like(3, n=3), auto=True).room == -1
    # Two rows at 11 % of a 54 ms step, measured beside one row: under the shed share.
    assert turn_room(COST, 1.0, 2, 0, cpu_like(1) + cpu_like(2, n=3), auto=True).room == -1
    # Between the shares (grow needs 25 %, shed below 15 %): hold. 21 rows: 25 %.
    recent = light_cpu(20) + light_cpu(21, n=3)
    assert turn_room(COST, 1.0, 21, 0, recent, auto=True).room == 0


def test_auto_keeps_the_knee_when_a_neighbour_slows_every_part_alike() -> None:
    slow = [StepSample(num_decode=s.num_decode, num_prefill_tokens=0, sum_context=0,
                       step_s=2 * s.step_s, cells_used=0)
            for s in light_cpu(10) + light_cpu(11) + light_cpu(12)]
    assert turn_room(COST, 1.0, 12, 0, slow, auto=True).room == 1


def test_auto_on_a_gpu_like_step_keeps_adding_rows() -> None:
    # 10 ms plus 0.5 ms a row: the shared part is most of the step at these counts.
    recent = steps(3, 0.011) + steps(4, 0.0115)
    assert turn_room(COST, 1.0, 4, 0, recent, auto=True).room == 1


def test_the_auto_gate_reports_the_floor_it_chose() -> None:
    gate = DecodeGate(1.0, BudgetState(COST), auto=True)
    assert gate.effective_floor() is None
    gate.turn_room(2, 0, cpu_like(1) + cpu_like(2))
    floor = gate.effective_floor()
    assert floor is not None and floor == pytest.approx(1 / 0.054)
    assert DecodeGate(7.0, BudgetState(COST)).effective_floor() == 7.0


def test_a_prefill_chunk_priced_past_its_step_divides_by_nothing() -> None:
    # Seen on SmolLM2 under auto: a 64-token chunk priced at a 24 ms slope "explained"
    # more than its 90 ms step; the shed rule then divided by zero in the engine thread.
    recent = cpu_like(1) + cpu_like(2) + steps(3, 0.090, n=3, prefill=64)
    for auto in (False, True):
        assert turn_room(COST, 10.0, 3, 0, recent, auto=auto).room in (-1, 0, 1)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 600),
                            st.floats(1e-5, 2.0, allow_nan=False)), max_size=40),
    running=st.integers(0, 12),
    floor=st.floats(0.1, 500.0),
    auto=st.booleans(),
)
def test_turn_room_answers_every_input_within_its_bounds(
    rows: list[tuple[int, int, float]], running: int, floor: float, auto: bool
) -> None:
    recent = [StepSample(num_decode=d, num_prefill_tokens=p, sum_context=0, step_s=t,
                         cells_used=0) for d, p, t in rows]
    room = turn_room(COST, floor, running, 0, recent, auto=auto).room
    assert room >= (1 if running == 0 else 1 - running)  # progress; the last row stays
    assert room <= 1 or running == 0  # one new turn a step


def test_a_floor_no_row_can_hold_falls_back_to_the_knee() -> None:
    # A neighbour: one row takes 130 ms (floor 10 wants 100). Holding one row would idle
    # the rest of the machine and keep no floor: the rows follow the knee instead.
    slow = [StepSample(num_decode=k, num_prefill_tokens=0, sum_context=0,
                       step_s=0.130 + 0.030 * (k - 1), cells_used=0)
            for k in (1, 2) for _ in range(6)]
    answer = turn_room(COST, 10.0, 2, 0, slow)
    assert answer.infeasible and answer.room == 1  # 3 rows untried: tried
    # Back to a quiet machine: one row at 30 ms fits, the floor rule decides again.
    assert not turn_room(COST, 10.0, 2, 0, cpu_like(1) + cpu_like(2)).infeasible
    # Many rows over the floor say nothing of one row: 10 rows at 120 ms with a 2 ms slope
    # extrapolate one row to 102 ms, but only a measured row counts.
    many = [StepSample(num_decode=k, num_prefill_tokens=0, sum_context=0,
                       step_s=0.102 + 0.002 * (k - 1), cells_used=0)
            for k in (8, 10) for _ in range(6)]
    assert not turn_room(COST, 10.0, 10, 0, many).infeasible


def test_auto_lets_prefill_fill_a_step_up_to_the_knee() -> None:
    # Light template on this CPU: 120 ms shared, 17 ms a row; at 5 rows a 205 ms step. The
    # knee's step is 480 ms (the shared part a quarter of it): prefill may fill the step up
    # to it, 16 tokens at the 17 ms a token costs; capped at 1.25x the decode step, as
    # before round 8, it carried the minimum of 4 while a dozen turns waited to prefill.
    gate = DecodeGate(1.0, BudgetState(COST), auto=True)
    gate.turn_room(5, 0, light_cpu(4) + light_cpu(5))
    assert gate(5, 0) == 16
    # Fixed floors are unchanged: the step may take 1/floor.
    fixed = DecodeGate(2.0, BudgetState(COST))
    fixed.turn_room(5, 0, light_cpu(4) + light_cpu(5))
    assert fixed(5, 0) in (14, 15)  # (0.92 * 0.5 - 0.205) / 0.017 = 15.0, floored
