"""Step timing and the pool's load snapshot (pure bookkeeping; no llama.cpp)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from mesh.engine.session import SeqState
from mesh.engine.types import PoolLoad, SessionLoad, StepSample

__all__ = ["StepStats"]

_RATE_WINDOW_S = 5.0


class StepStats:
    """What the engine thread measured: step times (EWMA and recent samples), decode rate."""

    def __init__(self) -> None:
        self.step_ms: float | None = None
        self.recent: deque[StepSample] = deque(maxlen=64)
        self._rate_window: deque[tuple[float, int]] = deque()
        self.num_steps = 0
        self.host_s = 0.0  # time per step outside llama_decode, summed (for the bench)
        self.decode_s = 0.0

    def record(self, sample: StepSample, *, decode_s: float, now: float) -> None:
        self._rate_window.append((now, sample.num_decode))
        self.num_steps += 1
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
                 session_budget: int) -> PoolLoad:
        now = time.monotonic()
        sessions = tuple(
            SessionLoad(id=st.id, state=st.state, private_cells=st.private,
                        context_len=st.pos, decode_tps=st.decode_tps,
                        duty_cycle=st.duty_cycle(now), age_s=now - st.created,
                        num_generated=st.num_generated)
            for st in states
        )
        private = sum(s.private_cells for s in sessions)
        return PoolLoad(
            taken_at=now, sessions=sessions, step_ms=self.step_ms, agg_tps=self.agg_tps(now),
            cells_used=prefix_cells + private, cells_total=n_ctx, prefix_cells=prefix_cells,
            naive_cells=(private + prefix_len * len(sessions) if prefix_cells else private),
            free_seq_ids=free_seq_ids, max_sessions=max_sessions,
            session_budget=session_budget, recent_steps=tuple(self.recent),
        )
