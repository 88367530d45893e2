"""Step timing and the pool's load snapshot (pure bookkeeping; no llama.cpp)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any, NamedTuple

from mesh.engine.session import SeqState, duty_cycle
from mesh.engine.types import PoolLoad, SessionLoad, StepSample

__all__ = ["Capture", "Parking", "StepStats"]

_RATE_WINDOW_S = 5.0


class Parking(NamedTuple):
    """The parking side of a snapshot (see the PoolLoad fields of the same names)."""

    max_attached: int = 0
    parked_tokens: int = 0
    parks: int = 0
    resumes: int = 0
    resume_tokens: int = 0
    parked_bytes: int = 0
    swaps: int = 0
    park_memory: int = 0


NO_PARKING = Parking()


class StepStats:
    """What the engine thread measured: step times (EWMA and recent samples), decode rate."""

    def __init__(self) -> None:
        self.step_ms: float | None = None
        self.recent: deque[StepSample] = deque(maxlen=64)
        self._rate_window: deque[tuple[float, int]] = deque()
        self.num_steps = 0
        self.prefill_tokens = 0  # suffix tokens prefilled since start (PoolLoad.prefill_tokens)
        self.host_s = 0.0  # time per step outside llama_decode, summed (for the bench)
        self.decode_s = 0.0

    def record(self, sample: StepSample, *, decode_s: float, now: float) -> None:
        self._rate_window.append((now, sample.num_decode))
        self.num_steps += 1
        self.prefill_tokens += sample.num_prefill_tokens
        self.decode_s += decode_s
        self.host_s += sample.step_s - decode_s
        ms = sample.step_s * 1000
        self.step_ms = ms if self.step_ms is None else self.step_ms + 0.2 * (ms - self.step_ms)
        self.recent.append(sample)

    def agg_tps(self, now: float) -> float:
        while self._rate_window and self._rate_window[0][0] < now - _RATE_WINDOW_S:
            self._rate_window.popleft()
        span = (now - self._rate_window[0][0]) if len(self._rate_window) > 1 else 0.0
        return sum(n for _, n in self._rate_window) / span if span > 0 else 0.0

    def snapshot(self, states: Iterable[SeqState], *, prefix_cells: int, prefix_len: int,
                 n_ctx: int, free_seq_ids: int, max_sessions: int,
                 session_budget: int, sessions_attached: int = 0,
                 sessions_reaped: int = 0, parking: Parking = NO_PARKING) -> Capture:
        """Capture the pool between steps (engine thread): plain tuples, cheap; the
        :class:`PoolLoad` is built from them when someone reads it."""
        now = time.monotonic()
        rows = tuple((st.id, st.state, st.private, st.pos, st.step_ewma_s, st.created,
                      st.busy_s, st._busy_since, st.num_generated, st.parked,
                      st.context_len) for st in states)
        return Capture(now, rows, self.step_ms, self.agg_tps(now), tuple(self.recent),
                       prefix_cells, prefix_len, n_ctx, free_seq_ids, max_sessions,
                       session_budget,
                       (sessions_attached, self.prefill_tokens, sessions_reaped), parking)


class Capture:
    """The pool's state at one moment; :meth:`load` builds (once) the :class:`PoolLoad`."""

    def __init__(self, now: float, rows: tuple[tuple[Any, ...], ...], step_ms: float | None,
                 agg_tps: float, recent: tuple[StepSample, ...], prefix_cells: int,
                 prefix_len: int, n_ctx: int, free_seq_ids: int, max_sessions: int,
                 session_budget: int, totals: tuple[int, int, int] = (0, 0, 0),
                 parking: Parking = NO_PARKING) -> None:
        self._args = (now, rows, step_ms, agg_tps, recent, prefix_cells, prefix_len, n_ctx,
                      free_seq_ids, max_sessions, session_budget, totals, parking)
        self._load: PoolLoad | None = None

    def load(self) -> PoolLoad:
        """The snapshot (any thread; built on first use, then shared)."""
        if self._load is None:
            self._load = _build(*self._args)
        return self._load


def _build(now: float, rows: tuple[tuple[Any, ...], ...], step_ms: float | None,
           agg_tps: float, recent: tuple[StepSample, ...], prefix_cells: int, prefix_len: int,
           n_ctx: int, free_seq_ids: int, max_sessions: int, session_budget: int,
           totals: tuple[int, int, int], parking: Parking) -> PoolLoad:
    sessions = tuple(
        SessionLoad(id=sid, state=state, private_cells=private,
                    context_len=ctx_len if parked else pos,
                    decode_tps=(1.0 / ewma if ewma else None),
                    duty_cycle=duty_cycle(now, created, busy_s, busy_since),
                    age_s=now - created, num_generated=generated, parked=parked)
        for (sid, state, private, pos, ewma, created, busy_s, busy_since, generated, parked,
             ctx_len) in rows
    )
    private_sum = sum(s.private_cells for s in sessions)
    return PoolLoad(
        taken_at=now, sessions=sessions, step_ms=step_ms, agg_tps=agg_tps,
        cells_used=prefix_cells + private_sum, cells_total=n_ctx, prefix_cells=prefix_cells,
        naive_cells=(private_sum + prefix_len * len(sessions) if prefix_cells
                     else private_sum),
        free_seq_ids=free_seq_ids, max_sessions=max_sessions,
        session_budget=session_budget, recent_steps=recent,
        sessions_attached=totals[0], prefill_tokens=totals[1], sessions_reaped=totals[2],
        max_attached=parking.max_attached, parked_tokens=parking.parked_tokens,
        parks=parking.parks, resumes=parking.resumes, resume_tokens=parking.resume_tokens,
        parked_bytes=parking.parked_bytes, swaps=parking.swaps,
        park_memory=parking.park_memory,
    )
