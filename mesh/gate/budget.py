"""The prefill budget: how many prefill tokens a step may carry while sessions decode.

A tool result or a new turn is prefilled in the same step as every decoding worker's token;
prefilled whole (up to ``n_batch``), it stalls them all for that step. The budget instead
gives a step only as many prefill tokens as keep its projected time within ``1/floor_tps``
(chunked prefill, as in Sarathi-Serve's stall-free batching); the rest waits for later
steps. Pure: the engine thread asks :func:`prefill_budget` through the
:class:`~mesh.engine.interface.PrefillBudget` closure that :meth:`FloorGate.pool_budget` hands
the pool, over a frozen :class:`BudgetState` the gate refreshes on its own event loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mesh.gate.model import StepCost

__all__ = ["MIN_CHUNK", "BudgetState", "FloorBudget", "prefill_budget"]

MIN_CHUNK = 16  # prefill always progresses by at least this many tokens a step
_MAX_TOKENS = 1 << 20  # "no limit": the pool caps a step at n_batch anyway


@dataclass(frozen=True)
class BudgetState:
    """What the budget reads: the step model's fit, the live correction and the mean
    context of a decoding row, as last seen by the gate."""

    cost: StepCost
    scale: float = 1.0
    context_per_row: float | None = None  # None: take every row to read all used cells


def prefill_budget(
    cost: StepCost,
    floor_tps: float,
    num_decode: int,
    cells_used: int,
    *,
    scale: float = 1.0,
    context_per_row: float | None = None,
    min_chunk: int = MIN_CHUNK,
    at_floor: int | None = None,
) -> int:
    """Prefill tokens a step may carry beside ``num_decode`` decoding rows over
    ``cells_used`` cells so that the projected step time ``scale·cost.step_s(...)`` stays
    within ``1/floor_tps``; never fewer than ``min_chunk`` (prefill must progress).

    When the decode rows alone are already projected past ``1/floor_tps``, no chunk size
    can keep the floor this step, and tiny chunks only stretch the prefill over many slow
    steps (each paying every row's cost again). The step may then at most double: the
    budget is as many tokens as the decode rows cost (``fixed / per_token``) — or, with
    ``at_floor`` set (the decode gate's budget), ``at_floor`` tokens: the decode gate keeps
    such steps rare, and prefill then only has to progress.

    With ``num_decode == 0`` nobody can be stalled: the budget is unbounded (the pool
    takes its full ``n_batch``). Raises ``ValueError`` on negative counts, a floor that is
    not a finite positive number, a non-positive scale or ``min_chunk < 1``.
    """
    if not (math.isfinite(floor_tps) and floor_tps > 0):
        raise ValueError(f"floor_tps must be a finite number > 0, got {floor_tps}")
    if num_decode < 0 or cells_used < 0:
        raise ValueError(
            f"num_decode ({num_decode}) and cells_used ({cells_used}) must be >= 0"
        )
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale}")
    if min_chunk < 1:
        raise ValueError(f"min_chunk must be >= 1, got {min_chunk}")
    if num_decode == 0:
        return _MAX_TOKENS
    ctx = cells_used if context_per_row is None else min(max(context_per_row, 0.0), cells_used)
    target = 1.0 / (floor_tps * scale)
    fixed = cost.a + cost.b * num_decode + cost.c * ctx * num_decode
    fixed += cost.e * num_decode * cells_used + cost.f * cells_used
    per_token = cost.d + cost.e * cells_used
    room = target - fixed
    if per_token <= 0:
        return _MAX_TOKENS
    if room <= 0 and at_floor is not None:
        return max(1, at_floor)
    if room <= 0:  # over the floor already: let the step at most double (see above)
        return max(min_chunk, min(_MAX_TOKENS, int(fixed / per_token)))
    return max(min_chunk, min(_MAX_TOKENS, int(room / per_token)))


class FloorBudget:
    """A :class:`~mesh.engine.interface.PrefillBudget` over the gate's latest
    :class:`BudgetState`. Called on the engine thread; it only reads one reference
    (replaced whole by :meth:`update` on the gate's loop), so it needs no lock."""

    def __init__(self, floor_tps: float, state: BudgetState, min_chunk: int = MIN_CHUNK) -> None:
        prefill_budget(state.cost, floor_tps, 0, 0, scale=state.scale, min_chunk=min_chunk)
        self.floor_tps = floor_tps
        self.min_chunk = min_chunk
        self.state = state

    def update(self, state: BudgetState) -> None:
        self.state = state

    def __call__(self, num_decode: int, cells_used: int) -> int:
        st = self.state
        return prefill_budget(st.cost, self.floor_tps, num_decode, cells_used, scale=st.scale,
                              context_per_row=st.context_per_row, min_chunk=self.min_chunk)
