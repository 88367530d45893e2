"""From sessions to a plan, and from a plan to a ``llama_batch`` (engine thread only)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from mesh.engine.ledger import CellLedger
from mesh.engine.planner import Candidate, StepPlan, admit_turns, plan_step, step_budget
from mesh.engine.session import SeqState
from mesh.engine.types import PrefillBudget, StepSample, TurnAdmission

__all__ = ["BatchWriter", "candidates", "fill_batch", "plan"]

logger = logging.getLogger(__name__)


class BatchWriter(Protocol):
    """Where a step's tokens go: :class:`mesh.engine.llama.Batch` (the Python step) or
    :class:`mesh.engine.native.NativeBatch` (the native step)."""

    def clear(self) -> None: ...

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int: ...

    def add_rows(self, tokens: list[int], pos: list[int], seqs: list[int]) -> int: ...


def candidates(sessions: Iterable[SeqState], ledger: CellLedger) -> list[Candidate]:
    """The planner's view of every session in a turn."""
    out = []
    for st, ready in ledger.pending_in_turns(sessions):
        turn = st.turn
        assert turn is not None
        out.append(Candidate(st.seq, st.created, st.carry is not None and not ready, ready,
                             turn.admitted_at is not None, turn.started, turn.priority))
    return out


def plan(sessions: Iterable[SeqState], ledger: CellLedger, *, n_batch: int, output_rows: int,
         cells_used: int, prefill_budget: PrefillBudget | None,
         turn_admission: TurnAdmission | None = None,
         recent: Sequence[StepSample] = ()) -> StepPlan:
    """The next step's plan over the live sessions (the planner's budget from the pool's;
    the decode gate is asked while a turn waits or more than one runs — it may start
    waiting turns, or shed running ones — and one turn always runs)."""
    cands = candidates(sessions, ledger)
    room = None
    num_running = sum(c.running for c in cands)
    if turn_admission is not None and (num_running < len(cands) or num_running > 1):
        try:
            room = int(turn_admission.turn_room(num_running, cells_used, recent))
        except Exception:  # a broken gate must not fail the turns: hold the rows as they are
            logger.exception("the decode gate failed; this step keeps the running turns")
            room = 0
        room = max(room, 1 - num_running)  # never shed the last one; with none, start one
    num_decode = sum(c.decoding for c in admit_turns(cands, room))
    budget = step_budget(n_batch=n_batch, output_rows=output_rows, num_decode=num_decode,
                         cells_used=cells_used, prefill_budget=prefill_budget, turn_room=room)
    return plan_step(cands, budget)


def fill_batch(plan: StepPlan, sessions: Mapping[int, SeqState], ledger: CellLedger,
               batch: BatchWriter) -> tuple[list[tuple[SeqState, int]], dict[int, int], int]:
    """Write the plan into ``batch`` (decode rows first, in one call, then prefill chunks,
    taking the queued tokens from the ledger). Returns the sessions to sample with their
    logits row, the tokens each sequence gets in this step, and the decode rows' summed
    context (positions + 1)."""
    batch.clear()
    states = [sessions[seq] for seq in plan.decode]
    carries = [st.carry for st in states]
    if None in carries:
        raise AssertionError("a decoding session has no carry token")
    pos = [st.prefix_len + st.private for st in states]
    first = batch.add_rows(carries, pos, list(plan.decode))  # type: ignore[arg-type]
    rows = [(st, first + i) for i, st in enumerate(states)]
    # Every token written for a sequence is recorded in its suffix (a parked session
    # re-prefills it on resume); a failed decode releases the session, so after a step
    # ``len(suffix) == private`` holds.
    for st, tok in zip(states, carries, strict=True):
        st.suffix.append(tok)  # type: ignore[arg-type]
    counts = dict.fromkeys(plan.decode, 1)
    for chunk in plan.prefill:
        st = sessions[chunk.seq]
        toks = ledger.take(st, chunk.tokens)
        st.suffix.extend(toks)
        for i, tok in enumerate(toks):
            is_out = chunk.logits and i == len(toks) - 1
            idx = batch.add(tok, st.pos + i, st.seq, is_out)
            if is_out:
                rows.append((st, idx))
        counts[chunk.seq] = len(toks)
    return rows, counts, sum(pos) + len(pos)
