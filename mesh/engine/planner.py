"""The step planner: which sessions decode and which queued text is prefilled in one step.

Pure: it reads plain numbers and returns a plan, so it is tested without llama.cpp. The
pool's engine thread builds the batch from the plan, decodes, samples and publishes.

Rules:

* a turn runs once the decode gate has let it in: turns that wait are let in in
  completion order (lowest ``priority`` first — the agent's task start time, so turns of
  tasks already running go before a new task's first turn — then oldest ``asked``), at
  most ``turn_room`` of them this step (None: all); a waiting turn is neither decoded nor
  prefilled;
* a negative ``turn_room`` sheds: that many running turns are paused between steps (the
  last in completion order first; one always keeps running), keeping their cells and
  carry token, and wait again at their place in the order;
* every decoding session of a running turn gets its one row (``n_batch`` exceeds
  ``max_sessions``);
* queued text of sessions in a turn is prefilled oldest session first, under the token
  budget left; while sessions decode, a :class:`~mesh.engine.types.PrefillBudget` caps the
  prefill tokens of the step (chunked prefill: the rest waits for later steps); with nothing
  decoding a step takes the full ``n_batch``;
* the chunk that empties a session's queue asks for logits (its first sample), if an output
  row is left; otherwise its last token waits for the next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from mesh.engine.types import PrefillBudget

__all__ = ["Candidate", "Chunk", "StepBudget", "StepPlan", "admit_turns", "order",
           "plan_step", "step_budget"]


class Candidate(NamedTuple):
    """One session as the planner sees it (a tuple: one is built per session per step)."""

    seq: int
    created: float  # attach time: older sessions' text is prefilled first
    decoding: bool  # in a turn, with a carry token and nothing queued
    ready: int  # queued tokens it may prefill now (0 unless in a turn)
    running: bool = True  # False: its turn waits for the decode gate
    asked: float = 0.0  # when its turn was asked for: waiting turns run oldest first
    priority: float = 0.0  # completion order: lower runs first and is paused last


@dataclass(frozen=True)
class StepBudget:
    """What one step may carry: ``tokens`` in the batch, ``output_rows`` logits rows and
    ``prefill_tokens`` of queued text (None: no cap beyond ``tokens``); at most
    ``turn_room`` waiting turns start running (None: every one)."""

    tokens: int
    output_rows: int
    prefill_tokens: int | None = None
    turn_room: int | None = None


@dataclass(frozen=True)
class Chunk:
    seq: int
    tokens: int
    logits: bool  # the chunk ends the session's queue: sample after it


@dataclass(frozen=True)
class StepPlan:
    decode: tuple[int, ...]  # sequence ids with one decode row each
    prefill: tuple[Chunk, ...]
    started: tuple[int, ...] = ()  # sequence ids whose waiting turn runs from this step
    paused: tuple[int, ...] = ()  # sequence ids whose running turn the gate paused (shed)

    @property
    def num_prefill(self) -> int:
        return sum(c.tokens for c in self.prefill)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


def step_budget(
    *, n_batch: int, output_rows: int, num_decode: int, cells_used: int,
    prefill_budget: PrefillBudget | None, turn_room: int | None = None,
) -> StepBudget:
    """The budget of the next step; ``prefill_budget`` is asked only while sessions decode."""
    cap = None
    if prefill_budget is not None and num_decode > 0:
        cap = max(0, int(prefill_budget(num_decode, cells_used)))
    return StepBudget(tokens=n_batch, output_rows=output_rows, prefill_tokens=cap,
                      turn_room=turn_room)


def order(c: Candidate) -> tuple[float, float]:
    """Completion order: the candidate's priority, then when its turn was asked for."""
    return c.priority, c.asked


def admit_turns(sessions: Sequence[Candidate], room: int | None) -> list[Candidate]:
    """The candidates that run this step: the running ones, plus up to ``room`` waiting
    turns in completion order (:func:`order`), marked running; with a negative ``room``,
    the running ones less ``-room`` of them, the last in that order (one always runs)."""
    if room is not None and room < 0:
        running = sorted((c for c in sessions if c.running), key=order)
        keep = {c.seq for c in running[:max(1, len(running) + room)]}
        return [c for c in sessions if c.seq in keep]
    waiting = [c for c in sessions if not c.running]
    if not waiting:
        return list(sessions)
    if room is not None and room < len(waiting):
        waiting.sort(key=order)
        waiting = waiting[:max(0, room)]
    let_in = {c.seq for c in waiting}
    return [c._replace(running=True) if c.seq in let_in else c
            for c in sessions if c.running or c.seq in let_in]


def plan_step(sessions: Sequence[Candidate], budget: StepBudget) -> StepPlan:
    """Plan one step over ``sessions`` within ``budget``; see the module docstring."""
    started = tuple(c.seq for c in sessions if not c.running)
    was_running = tuple(c.seq for c in sessions if c.running)
    sessions = admit_turns(sessions, budget.turn_room)
    running = {c.seq for c in sessions}
    started = tuple(seq for seq in started if seq in running)
    paused = tuple(seq for seq in was_running if seq not in running)
    decode = tuple(c.seq for c in sessions if c.decoding)
    tokens = budget.tokens - len(decode)
    rows = budget.output_rows - len(decode)
    if tokens < 0 or rows < 0:
        raise ValueError(f"{len(decode)} decoding sessions do not fit {budget}")
    prefill_left = tokens if budget.prefill_tokens is None else min(tokens,
                                                                    budget.prefill_tokens)
    chunks: list[Chunk] = []
    waiting = [c for c in sessions if not c.decoding and c.ready > 0]
    for c in sorted(waiting, key=lambda s: s.created) if len(waiting) > 1 else waiting:
        if prefill_left <= 0:
            break
        take = min(c.ready, prefill_left)
        ends = take == c.ready
        if ends and rows <= 0:
            take -= 1  # no logits row left: the last token waits for a later step
            ends = False
        if take <= 0:
            continue
        if ends:
            rows -= 1
        chunks.append(Chunk(seq=c.seq, tokens=take, logits=ends))
        prefill_left -= take
    return StepPlan(decode=decode, prefill=tuple(chunks), started=started, paused=paused)
