"""The runner: one planned step on the engine thread (:meth:`mesh.engine.thread.Parts.step`
hands it the scheduler's plan). :meth:`StepRunner.decode` fills the batch and runs one
``llama_decode`` (through the native step when the library is loaded);
:meth:`StepRunner.sample` books the decoded cells and samples every row that asked for
logits before the next decode overwrites them (the pieces and results go to the turns'
outbox); :meth:`StepRunner.record` records the step stats. The runner reads the sessions
through the registry's read-only view and never adds or removes one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from mesh.engine.build import Built
from mesh.engine.interface import StepSample
from mesh.engine.native import NativeBatch, NativeStepper
from mesh.engine.scheduler import StepPlan, StepStats, fill_batch
from mesh.engine.session import CellLedger, SeqState
from mesh.engine.turns import Turns

__all__ = ["DecodeFailed", "Decoded", "StepRunner"]


@dataclass
class Decoded:
    """What one decode left to sample: the rows with logits, the tokens each sequence got,
    the native step's draws (None on the Python step), when the step and llama_decode ran,
    and the step's shape for the stats."""

    rows: list[tuple[SeqState, int]]
    counts: dict[int, int]
    sampled: list[int] | None
    step_started: float
    started: float
    ended: float
    sum_context: int
    cells_used: int


@dataclass(frozen=True)
class DecodeFailed:
    """llama_decode refused the batch: the pool releases ``seqs`` with ``reason``."""

    reason: str
    seqs: list[int]


class StepRunner:
    """Decodes and samples one pool's planned steps (engine thread only)."""

    def __init__(self, built: Built, ledger: CellLedger, turns: Turns,
                 sessions: Mapping[int, SeqState], stepper: NativeStepper | None,
                 native_batch: NativeBatch | None) -> None:
        self._built = built
        self._ledger = ledger
        self._turns = turns
        self._sessions = sessions
        self.stepper = stepper
        self._native_batch = native_batch
        self._busy_changes = -1

    def decode(self, plan: StepPlan, *, step_started: float,
               cells_used: int) -> Decoded | DecodeFailed:
        """Write the plan into the batch and run its one decode."""
        ctx, stepper, nbatch = self._built.ctx, self.stepper, self._native_batch
        batch = nbatch if nbatch is not None else self._built.batch
        rows, counts, sum_ctx = fill_batch(plan, self._sessions, self._ledger, batch)
        sampled: list[int] | None = None
        if stepper is not None and nbatch is not None:
            samplers = [st.turn.sampler.handle if st.turn is not None else None
                        for st, _ in rows]
            t1 = time.monotonic()
            rc, sampled, decode_s = stepper.step(ctx, nbatch, [i for _, i in rows], samplers)
            t2 = t1 + decode_s
        else:
            t1 = time.monotonic()
            rc = ctx.decode(self._built.batch)
            t2 = time.monotonic()
        if rc != 0:
            reason = (f"llama_decode returned {rc} (no KV slot for the batch)" if rc == 1
                      else f"llama_decode failed with status {rc}")
            return DecodeFailed(reason, list(counts))
        return Decoded(rows, counts, sampled, step_started, t1, t2, sum_ctx, cells_used)

    def sample(self, plan: StepPlan, done: Decoded) -> None:
        """Book the decoded cells, then sample (or accept the native draws of) every row."""
        ctx = self._built.ctx
        n_decode = len(plan.decode)
        step_s = done.ended - done.step_started
        for i, (st, _) in enumerate(done.rows):  # decode rows come first
            if i >= n_decode:
                break
            st.private += 1
            st.carry = None  # the carried token is now in the cache
            st.observe_decode(step_s)
        for chunk in plan.prefill:
            self._sessions[chunk.seq].private += done.counts[chunk.seq]
        if done.sampled is None:
            for st, idx in done.rows:
                self._turns.sample(st, ctx, idx)
            return
        # The native step drew every row from its turn's chain; a grammar checks its draw.
        toks = done.sampled
        for i, (st, idx) in enumerate(done.rows):
            turn = st.turn
            if turn is not None and turn.params.grammar is not None:
                toks[i] = turn.sampler.constrain(ctx, idx, toks[i])
        self._turns.accept_all(done.rows, toks)

    def record(self, plan: StepPlan, done: Decoded, stats: StepStats) -> float:
        """After sampling: mark busy/idle edges, record the step; returns its end time."""
        now = time.monotonic()
        if self._turns.changes != self._busy_changes:  # busy <-> idle only at turn edges
            self._busy_changes = self._turns.changes
            for st in self._sessions.values():
                st.mark_busy(now)
        stats.record(StepSample(num_decode=len(plan.decode),
                                num_prefill_tokens=plan.num_prefill,
                                sum_context=done.sum_context, step_s=now - done.step_started,
                                cells_used=done.cells_used),
                     decode_s=done.ended - done.started, now=now)
        return now

    def close(self) -> None:
        if self.stepper is not None:
            self.stepper.close()
            self.stepper = None
