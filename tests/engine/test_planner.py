"""The step planner alone: pure numbers in, a plan out (no llama.cpp)."""

from __future__ import annotations

import pytest

from mesh.engine.scheduler import Candidate, Chunk, StepBudget, plan_step, step_budget


def dec(seq: int) -> Candidate:
    return Candidate(seq=seq, created=float(seq), decoding=True, ready=0)


def pre(seq: int, ready: int, created: float | None = None) -> Candidate:
    return Candidate(seq=seq, created=float(seq) if created is None else created,
                     decoding=False, ready=ready)


def test_every_decoding_session_gets_one_row() -> None:
    plan = plan_step([dec(1), dec(2), pre(3, 0)], StepBudget(tokens=512, output_rows=17))
    assert plan.decode == (1, 2) and plan.prefill == () and not plan.empty


def test_nothing_to_do_is_an_empty_plan() -> None:
    assert plan_step([pre(1, 0)], StepBudget(tokens=512, output_rows=17)).empty


def test_prefill_fills_the_rest_of_the_batch_oldest_first() -> None:
    sessions = [dec(1), pre(2, 300, created=5.0), pre(3, 300, created=1.0)]
    plan = plan_step(sessions, StepBudget(tokens=512, output_rows=17))
    assert plan.prefill == (Chunk(3, 300, True), Chunk(2, 211, False))
    assert plan.num_prefill == 511


def test_a_prefill_budget_caps_prefill_and_the_rest_waits() -> None:
    sessions = [dec(1), dec(2), pre(3, 100), pre(4, 50)]
    plan = plan_step(sessions, StepBudget(tokens=512, output_rows=17, prefill_tokens=64))
    assert plan.decode == (1, 2)
    assert plan.prefill == (Chunk(3, 64, False),)
    # Later steps: the rest of the oldest queue first, then the next session.
    plan = plan_step([dec(1), dec(2), pre(3, 36), pre(4, 50)],
                     StepBudget(tokens=512, output_rows=17, prefill_tokens=64))
    assert plan.prefill == (Chunk(3, 36, True), Chunk(4, 28, False))


def test_a_zero_prefill_budget_decodes_only() -> None:
    plan = plan_step([dec(1), pre(2, 10)], StepBudget(512, 17, prefill_tokens=0))
    assert plan.decode == (1,) and plan.prefill == ()


def test_no_output_row_left_holds_back_the_last_token() -> None:
    plan = plan_step([dec(1), dec(2), pre(3, 5)], StepBudget(tokens=512, output_rows=2))
    assert plan.prefill == (Chunk(3, 4, False),)
    plan = plan_step([dec(1), dec(2), pre(3, 1)], StepBudget(tokens=512, output_rows=2))
    assert plan.prefill == ()


def test_too_many_decoding_sessions_is_an_error() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        plan_step([dec(1), dec(2)], StepBudget(tokens=1, output_rows=4))


class Recorder:
    def __init__(self, answer: int) -> None:
        self.answer = answer
        self.calls: list[tuple[int, int]] = []

    def __call__(self, num_decode: int, cells_used: int) -> int:
        self.calls.append((num_decode, cells_used))
        return self.answer


def test_the_budget_asks_the_prefill_budget_only_while_decoding() -> None:
    rec = Recorder(48)
    idle = step_budget(n_batch=512, output_rows=17, num_decode=0, cells_used=900,
                       prefill_budget=rec)
    assert idle == StepBudget(512, 17, None) and rec.calls == []
    busy = step_budget(n_batch=512, output_rows=17, num_decode=3, cells_used=900,
                       prefill_budget=rec)
    assert busy == StepBudget(512, 17, 48) and rec.calls == [(3, 900)]
    assert step_budget(n_batch=512, output_rows=17, num_decode=3, cells_used=900,
                       prefill_budget=None) == StepBudget(512, 17, None)
    assert step_budget(n_batch=512, output_rows=17, num_decode=1, cells_used=9,
                       prefill_budget=Recorder(-5)).prefill_tokens == 0


def test_with_nothing_decoding_a_step_takes_the_full_batch() -> None:
    budget = step_budget(n_batch=512, output_rows=17, num_decode=0, cells_used=0,
                         prefill_budget=Recorder(8))
    plan = plan_step([pre(1, 2000)], budget)
    assert plan.prefill == (Chunk(1, 512, False),)


def wait(seq: int, asked: float, ready: int = 0) -> Candidate:
    """A session whose turn waits for the decode gate (decoding if nothing is queued)."""
    return Candidate(seq=seq, created=float(seq), decoding=ready == 0, ready=ready,
                     running=False, asked=asked)


def test_waiting_turns_neither_decode_nor_prefill_without_room() -> None:
    plan = plan_step([dec(1), wait(2, 1.0), wait(3, 0.5, ready=20)],
                     StepBudget(512, 17, turn_room=0))
    assert plan.decode == (1,) and plan.prefill == () and plan.started == ()


def test_waiting_turns_start_oldest_asked_first_up_to_the_room() -> None:
    sessions = [dec(1), wait(2, 3.0), wait(3, 1.0, ready=20), wait(4, 2.0)]
    plan = plan_step(sessions, StepBudget(512, 17, turn_room=2))
    assert set(plan.started) == {3, 4}
    assert plan.decode == (1, 4) and plan.prefill == (Chunk(3, 20, True),)


def test_no_turn_room_cap_starts_every_waiting_turn() -> None:
    plan = plan_step([wait(1, 1.0), wait(2, 2.0)], StepBudget(512, 17))
    assert plan.started == (1, 2) and plan.decode == (1, 2)


def test_a_started_turn_is_started_even_when_the_prefill_budget_is_spent() -> None:
    plan = plan_step([dec(1), wait(2, 1.0, ready=10)],
                     StepBudget(512, 17, prefill_tokens=0, turn_room=1))
    assert plan.started == (2,) and plan.prefill == ()


def run_(seq: int, priority: float, asked: float = 0.0) -> Candidate:
    """A running, decoding turn with a completion-order priority."""
    return Candidate(seq=seq, created=float(seq), decoding=True, ready=0, running=True,
                     asked=asked, priority=priority)


def test_waiting_turns_start_in_completion_order() -> None:
    # Session 2's task started first (priority 1.0) but asked last: it still goes first.
    sessions = [dec(1), wait(2, 9.0)._replace(priority=1.0), wait(3, 1.0)._replace(
        priority=5.0), wait(4, 2.0)._replace(priority=5.0)]
    plan = plan_step(sessions, StepBudget(512, 17, turn_room=2))
    assert set(plan.started) == {2, 3}


def test_a_negative_room_pauses_the_last_in_completion_order() -> None:
    sessions = [run_(1, 3.0), run_(2, 1.0), run_(3, 2.0), run_(4, 4.0)]
    plan = plan_step(sessions, StepBudget(512, 17, turn_room=-2))
    assert set(plan.paused) == {1, 4} and plan.decode == (2, 3) and plan.started == ()


def test_shedding_never_pauses_the_last_running_turn() -> None:
    plan = plan_step([run_(1, 1.0), run_(2, 2.0)], StepBudget(512, 17, turn_room=-5))
    assert plan.paused == (2,) and plan.decode == (1,)


def test_an_older_tasks_turn_takes_the_row_of_the_newest_running_turn() -> None:
    # Task priorities: 1.0 (oldest) .. 3.0 (newest). No room: the oldest task's turn, back
    # from its tool call, takes the row of the newest task's running turn, which pauses.
    sessions = [run_(1, 2.0), run_(2, 3.0), wait(3, 9.0)._replace(priority=1.0)]
    plan = plan_step(sessions, StepBudget(512, 17, turn_room=0))
    assert plan.started == (3,) and plan.paused == (2,) and set(plan.decode) == {1, 3}


def test_one_swap_a_step_and_never_within_one_task() -> None:
    sessions = [run_(1, 5.0), run_(2, 6.0), wait(3, 1.0)._replace(priority=1.0),
                wait(4, 2.0)._replace(priority=2.0)]
    plan = plan_step(sessions, StepBudget(512, 17, turn_room=0))
    assert plan.started == (3,) and plan.paused == (2,)  # one a step: 4 waits for the next
    same_task = [run_(1, 5.0), wait(2, 0.5)._replace(priority=5.0)]
    plan = plan_step(same_task, StepBudget(512, 17, turn_room=0))
    assert plan.started == () and plan.paused == ()
    newer = [run_(1, 5.0), wait(2, 0.5)._replace(priority=7.0)]
    assert plan_step(newer, StepBudget(512, 17, turn_room=0)).started == ()


def test_room_is_used_before_any_swap_and_no_gate_means_no_swap() -> None:
    sessions = [run_(1, 5.0), wait(2, 1.0)._replace(priority=1.0),
                wait(3, 2.0)._replace(priority=2.0)]
    plan = plan_step(sessions, StepBudget(512, 17, turn_room=1))
    # Room for one (the oldest task's); the next still older than the running one swaps.
    assert set(plan.started) == {2, 3} and plan.paused == (1,)
    free = plan_step(sessions, StepBudget(512, 17))  # no gate: every turn runs
    assert set(free.started) == {2, 3} and free.paused == ()
