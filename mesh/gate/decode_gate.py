"""The decode gate: per turn, on measured steps, whether one more turn may run.

The floor policy's promise is per decoding worker: at or above ``floor_tps`` tokens/s, so
every step that carries a decode row must take at most ``1/floor_tps``. A worker is not
admitted for its life: each *turn* (a ``generate`` call: the tool result or message it
brings, then its tokens) waits, first come first served, until the engine's step can take
one more row within the floor. A worker between turns (on a tool, a peer, a client) holds
its cells but no row, so tool-call idle is free capacity by construction, not by estimate.

The engine thread asks :meth:`DecodeGate.turn_room` once per step while a turn waits
(:class:`~mesh.engine.types.TurnAdmission`). The answer reads the steps just measured:

* the *measured ratio* ``r``: the median of (measured step time / modelled step time) over
  the last few decoding steps. It carries everything the model cannot see (a neighbour on
  the same CPU or GPU, contexts that grew, the machine's speed now);
* the projected step with ``k`` running turns is ``r · cost(k rows, their context, a small
  prefill reserve, cells in use)``; a turn may start only while the projection for one
  more stays within ``headroom / floor_tps``. Past the floor (a neighbour took the
  machine), the projection for the turns running now is already over it: no turn starts
  until measured steps are back under the floor, and as running turns end the newest
  askers wait behind the older ones;
* a ratio measured at up to ``M`` rows is trusted as measured up to ``M`` rows; past ``M``
  only a slower-than-modelled one counts (a lone worker's cheap steps say nothing of
  three), and at most one turn starts per step beyond what is running, so the next step
  measures the one just let in before another follows.

Everything here is pure: numbers in, a count out. :class:`DecodeGate` holds the step
model's latest fit (replaced whole by the gate's event loop, read by the engine thread; a
single reference swap needs no lock) and implements the engine's prefill budget too, so
one object prices both what a step decodes and what it prefills.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mesh.engine.types import StepSample
from mesh.gate.budget import BudgetState, prefill_budget
from mesh.gate.model import StepCost

__all__ = ["DecodeGate", "TurnRoom", "measured_ratio", "turn_room"]

RATIO_STEPS = 6  # decoding steps the measured ratio is the median of
PREFILL_RESERVE = 4  # prefill tokens a new turn is assumed to bring to its first steps
MIN_PREFILL_CHUNK = 4  # prefill tokens a step may carry when little room is left
# ... and when the decode rows alone are past the floor (a neighbour took the machine):
# starving prefill then restores nothing (the rows are over it anyway) and keeps the
# prefilling turns from ever decoding, so they progress by this much a step. A client's
# window of 8 tokens absorbs one such step; the decode gate starts no turn meanwhile.
OVER_FLOOR_CHUNK = 16
HEADROOM = 0.92  # a turn starts only while one more row projects within this share


@dataclass(frozen=True)
class TurnRoom:
    """One answer of :func:`turn_room`, with what it was anchored to (for ``/capacity``)."""

    room: int
    ratio: float  # measured / modelled over the last decoding steps (1.0: none yet)
    measured_rows: int  # most decoding rows in those steps
    projected_now_s: float  # the step as it runs now (r · cost at num_running rows)
    projected_next_s: float  # ... with one more running turn


def measured_ratio(cost: StepCost, recent: Sequence[StepSample],
                   steps: int = RATIO_STEPS) -> tuple[float, int]:
    """(median measured/modelled step time, most decoding rows) over the last ``steps``
    decoding steps of ``recent``; (1.0, 0) before any."""
    rows = [s for s in list(recent)[-4 * steps:] if s.num_decode > 0 and s.step_s > 0][-steps:]
    if not rows:
        return 1.0, 0
    ratios = [s.step_s / cost.step_s(s.num_decode, s.sum_context, s.num_prefill_tokens,
                                     s.cells_used) for s in rows]
    return min(max(statistics.median(ratios), 0.05), 50.0), max(s.num_decode for s in rows)


def turn_room(cost: StepCost, floor_tps: float, num_running: int, cells_used: int,
              recent: Sequence[StepSample], *, context_per_row: float | None = None,
              headroom: float = HEADROOM, max_room: int = 1 << 16) -> TurnRoom:
    """How many more turns may start running now; see the module docstring.

    ``context_per_row`` is a decoding row's mean context (None: every used cell). With no
    turn running the answer is at least 1 (progress: nobody can be slowed down). Raises
    ``ValueError`` on a floor that is not a finite positive number or negative counts.
    """
    if not (math.isfinite(floor_tps) and floor_tps > 0):
        raise ValueError(f"floor_tps must be a finite number > 0, got {floor_tps}")
    if num_running < 0 or cells_used < 0:
        raise ValueError(f"num_running ({num_running}) and cells_used ({cells_used}) "
                         "must be >= 0")
    ratio, measured_rows = measured_ratio(cost, recent)
    ctx = float(cells_used) if context_per_row is None else min(max(context_per_row, 0.0),
                                                                 float(cells_used))

    def projected(k: int) -> float:
        r = ratio if k <= measured_rows else max(ratio, 1.0)
        prefill = PREFILL_RESERVE if k > num_running else 0
        return r * cost.step_s(k, k * ctx, prefill, cells_used)

    target = headroom / floor_tps
    now_s = projected(num_running) if num_running else 0.0
    next_s = projected(num_running + 1)
    room = 0
    # Trusted as measured up to measured_rows; one step at a time past what runs now.
    limit = max(measured_rows, num_running + 1) if num_running else max(measured_rows, 1)
    while room < max_room and num_running + room < limit and projected(
            num_running + room + 1) <= target:
        room += 1
    if num_running == 0:
        room = max(room, 1)
    return TurnRoom(room, ratio, measured_rows, now_s, next_s)


class DecodeGate:
    """The engine's :class:`~mesh.engine.types.TurnAdmission` and
    :class:`~mesh.engine.types.PrefillBudget` for the floor policy, over the gate's latest
    :class:`~mesh.gate.budget.BudgetState` (see the module docstring)."""

    def __init__(self, floor_tps: float, state: BudgetState, headroom: float = HEADROOM,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        turn_room(state.cost, floor_tps, 0, 0, ())  # validates
        if not 0.0 < headroom <= 1.0:
            raise ValueError(f"headroom must be in (0, 1], got {headroom}")
        self.floor_tps = floor_tps
        self.headroom = headroom
        self.state = state
        self.last: TurnRoom | None = None  # the latest answer (read by /capacity)
        self._clock = clock
        # A projection for one more turn, waiting to be checked against a step measured
        # at that many rows: (rows, projected step s).
        self._pending: tuple[int, float] | None = None
        self._errors: deque[tuple[float, float]] = deque(maxlen=512)  # (t, measured/proj - 1)

    def update(self, state: BudgetState) -> None:
        self.state = state

    def turn_room(self, num_running: int, cells_used: int,
                  recent: Sequence[StepSample]) -> int:
        st = self.state
        self._check(recent)
        answer = turn_room(st.cost, self.floor_tps, num_running, cells_used, recent,
                           context_per_row=st.context_per_row, headroom=self.headroom)
        self.last = answer
        if answer.room > 0 and num_running > 0 and self._pending is None:
            self._pending = (num_running + 1, answer.projected_next_s)
        return answer.room

    def _check(self, recent: Sequence[StepSample]) -> None:
        """Score the pending projection on the latest step, once it decodes that many
        rows without prefill (dropped if the pool moved past that many first)."""
        if self._pending is None or not recent:
            return
        rows, projected = self._pending
        last = recent[-1]
        if last.num_decode == rows and last.num_prefill_tokens == 0:
            self._errors.append((self._clock(), last.step_s / projected - 1.0))
            self._pending = None
        elif last.num_decode > rows:
            self._pending = None

    def projection_error(self, window_s: float = 60.0) -> dict[str, float | int | None]:
        """How far measured steps fell from the projections for one more turn over the
        last ``window_s`` seconds: the median and 90th percentile of measured/projected-1
        (positive: slower than projected), and how many were scored."""
        since = self._clock() - window_s
        errs = sorted(e for t, e in self._errors if t >= since)
        if not errs:
            return {"count": 0, "p50": None, "p90": None}
        return {"count": len(errs), "p50": errs[len(errs) // 2],
                "p90": errs[min(len(errs) - 1, int(0.9 * len(errs)))]}

    def __call__(self, num_decode: int, cells_used: int) -> int:
        """The prefill budget: what fits beside the decode rows within the floor, down to
        one token a step (progress) when they fill it."""
        st = self.state
        return prefill_budget(st.cost, self.floor_tps, num_decode, cells_used, scale=st.scale,
                              context_per_row=st.context_per_row,
                              min_chunk=MIN_PREFILL_CHUNK, at_floor=OVER_FLOOR_CHUNK)
