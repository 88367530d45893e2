"""The decode gate: the prefill budget a step may carry, then the per-turn gate that keeps
every decoding worker at or above the floor on measured steps. Read top to bottom:

**The prefill budget.** The prefill budget: how many prefill tokens a step may carry while
sessions decode.

A tool result or a new turn is prefilled in the same step as every decoding worker's token;
prefilled whole (up to ``n_batch``), it stalls them all for that step. The budget instead
gives a step only as many prefill tokens as keep its projected time within ``1/floor_tps``
(chunked prefill, as in Sarathi-Serve's stall-free batching); the rest waits for later
steps. Pure: the engine thread asks :func:`prefill_budget` through the
:class:`~mesh.engine.interface.PrefillBudget` closure that :meth:`FloorGate.pool_budget` hands
the pool, over a frozen :class:`BudgetState` the gate refreshes on its own event loop.

**The decode gate.** The decode gate: per step, on measured steps, how many turns run.

The floor policy's promise is per decoding worker: at or above ``floor_tps`` tokens/s, so
every step that carries a decode row must take at most ``1/floor_tps``. A worker is not
admitted for its life: each *turn* (a ``generate`` call: the tool result or message it
brings, then its tokens) waits until the engine's step can take one more row within the
floor. A worker between turns (on a tool, a peer, a client) holds its cells but no row, so
tool-call idle is free capacity by construction, not by estimate.

The engine thread asks :meth:`DecodeGate.turn_room` once per step while a turn waits or
more than one runs (:class:`~mesh.engine.interface.TurnAdmission`). The answer is a signed
count read off the steps just measured — a controller on the step the user's tokens come
from, not a projection of a fitted model:

* **measured by rows**: the median step time at each decoding row count over the last
  :data:`FRESH_STEPS` decode steps (steps whose prefill is at most a reserve of a few
  tokens); this carries everything a model cannot see (a neighbour on the same CPU or GPU,
  contexts that grew, the machine's speed now) and forgets it within a second or two;
* **shed** (negative room): when the last :data:`SHED_STEPS` steps at the running row
  count all took longer than ``1/floor_tps`` (median), the rows that would bring the step
  back under the floor are paused *between steps*, last in completion order first (they
  keep their cells and wait again; one row always runs);
* **grow** (positive room): a waiting turn starts while the step with one more row is
  predicted within ``headroom / floor_tps``: the measured step at that many rows if there
  is one, else the nearest measured row count plus the per-row slope (least squares over
  the fresh decode steps; with one row count measured, a row costs what the average row
  does now — linear, the cautious guess on a compute-bound CPU). One turn starts per
  step, and only once the rows running now were measured, so every new row is measured
  before the next;
* with nothing measured yet, the fitted step model (× its measured ratio) stands in.

The gap between the grow threshold (``headroom``) and the shed threshold (the floor
itself) keeps the controller from flapping. A floor that even one row cannot hold (a
neighbour took the machine) is not held by running one row and leaving the rest idle:
while one row is measured over the floor the rows follow the knee rule of ``auto``.
The same object is the step's prefill budget, priced as measured: a prefill token costs
what steps that carried prefill beside rows show (a row's cost until one did), and a step
beside decoding rows carries only what keeps it within the floor.

Everything here is pure: numbers in, a count out. :class:`DecodeGate` holds the step
model's latest fit (replaced whole by the gate's event loop, read by the engine thread; a
single reference swap needs no lock).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from mesh.engine.interface import StepSample
from mesh.gate.model import StepCost

__all__ = [
    "MIN_CHUNK", "BudgetState", "DecodeGate", "FloorBudget", "TurnRoom", "by_rows",
    "measured_ratio", "prefill_budget", "prefill_price", "row_slope", "turn_room"
]


# -------------------- the prefill budget --------------------------------------

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

# -------------------- the decode gate -----------------------------------------

RATIO_STEPS = 6  # decoding steps the model's measured ratio is the median of
FRESH_STEPS = 24  # the recent steps read for the step time at each row count
SHED_STEPS = 3  # (auto) the steps at the running row count whose median sheds a row
CLIENT_STEPS = 8  # the steps a reader's window of 8 tokens spans: their mean is the floor's
BUCKET_STEPS = 5  # the latest steps at one row count whose median is "measured"
PREFILL_RESERVE = 4  # prefill tokens a decode step may carry and still count as one
MIN_PREFILL_CHUNK = 4  # prefill tokens a step may carry when little room is left
# ... and when the decode rows alone are past the floor (until the shed lands, or with one
# row left): starving prefill then restores nothing and keeps the prefilling turns from
# ever decoding, so they progress by this much a step.
OVER_FLOOR_CHUNK = 16
HEADROOM = 0.92  # a turn starts only while one more row is predicted within this share
# --floor-tps auto: the knee. A step costs a shared part (the weights read once, the
# shared prefix, the host's work) plus a part per decoding row; batching pays while the
# shared part is a real share of the step. One more row is worth its place while, with it,
# the shared part is still at least KNEE_SHARE of the step (the row then adds at least
# KNEE_SHARE of an average row's tokens/s); a running row is paused once the shared part
# falls under SHED_SHARE (the gap keeps the count from flapping). The per-row part is the
# least-squares slope over the fresh decode steps (every row count they span, not two
# neighbours: at a dozen rows one row moves the aggregate by a few percent, under this
# machine's step noise). A CPU neighbour slows both parts alike, so the knee's row count
# holds while the per-row rate falls. KNEE_GAIN is the sweep's rule between floors
# (:mod:`mesh.sim.compare`): a lower floor must add 10 % aggregate tokens/s.
# A step that carries prefill may take as long as the step at the knee (its shared part
# over KNEE_SHARE: every row then still gets the knee's per-row rate, the floor auto holds),
# and at least AUTO_PREFILL_STRETCH times the decode step. (Round 8: capped at the stretch
# alone, a step carried ~4 prefill tokens beside 5 rows; 12 turns sat prefilling their
# tool results, 5 decoded, and the wall was 1.28x legacy's in two seeds of three.)
KNEE_SHARE = 0.25
SHED_SHARE = 0.15
KNEE_GAIN = 0.10
AUTO_PREFILL_STRETCH = 1.25


@dataclass(frozen=True)
class TurnRoom:
    """One answer of :func:`turn_room`, with what it was anchored to (for ``/capacity``)."""

    room: int  # > 0: turns that may start; < 0: running turns to pause (shed)
    ratio: float  # measured / modelled over the last decoding steps (1.0: none yet)
    measured_rows: int  # most decoding rows in the recent steps
    projected_now_s: float  # the step as it runs now (measured where it was)
    projected_next_s: float  # ... with one more running turn
    slope_s: float = 0.0  # the per-row cost the prediction used (s)
    prefill_token_s: float | None = None  # measured cost of a prefill token beside rows
    client_step_s: float | None = None  # mean of the last steps a decoding row waited on
    infeasible: bool = False  # one row alone is over the floor: the knee rule decided
    # the median decode step by row count it read (the prefill budget reuses it)
    measured: tuple[tuple[int, float], ...] = ()


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


def by_rows(recent: Sequence[StepSample], fresh: int = FRESH_STEPS) -> dict[int, list[float]]:
    """The step times of the last ``fresh`` decode steps by decoding row count, oldest
    first (a decode step carries at most :data:`PREFILL_RESERVE` prefill tokens)."""
    out: dict[int, list[float]] = {}
    for s in list(recent)[-fresh:]:
        if s.num_decode > 0 and s.step_s > 0 and s.num_prefill_tokens <= PREFILL_RESERVE:
            out.setdefault(s.num_decode, []).append(s.step_s)
    return out


def row_slope(recent: Sequence[StepSample], fresh: int = FRESH_STEPS) -> float | None:
    """Seconds one more decoding row adds, fitted (least squares) over the last ``fresh``
    decode steps; None unless they span at least two row counts."""
    pts = [(s.num_decode, s.step_s) for s in list(recent)[-fresh:]
           if s.num_decode > 0 and s.step_s > 0 and s.num_prefill_tokens <= PREFILL_RESERVE]
    if len({k for k, _ in pts}) < 2:
        return None
    mk = sum(k for k, _ in pts) / len(pts)
    mt = sum(t for _, t in pts) / len(pts)
    var = sum((k - mk) ** 2 for k, _ in pts)
    return max(0.0, sum((k - mk) * (t - mt) for k, t in pts) / var)


def prefill_price(recent: Sequence[StepSample], measured: dict[int, float],
                  fresh: int = FRESH_STEPS) -> float | None:
    """Seconds a prefill token adds to a step beside decode rows: the median, over the
    fresh steps that carried more than :data:`PREFILL_RESERVE` prefill tokens beside a
    measured row count, of (step - that row count's decode step) / tokens; None before
    any such step."""
    prices = [max(0.0, (s.step_s - measured[s.num_decode]) / s.num_prefill_tokens)
              for s in list(recent)[-fresh:]
              if s.num_prefill_tokens > PREFILL_RESERVE and s.num_decode in measured]
    return statistics.median(prices) if prices else None


def turn_room(cost: StepCost, floor_tps: float, num_running: int, cells_used: int,
              recent: Sequence[StepSample], *, context_per_row: float | None = None,
              headroom: float = HEADROOM, max_room: int = 1 << 16,
              auto: bool = False) -> TurnRoom:
    """How many more turns may start running now (negative: how many running turns to
    pause); see the module docstring.

    ``context_per_row`` is a decoding row's mean context for the fitted model (None:
    every used cell). With no turn running the answer is at least 1 (progress: nobody can
    be slowed down); it never pauses the last running turn; it starts at most one turn a
    step, and none until the rows running now were measured. With ``auto`` the floor is
    the knee instead of ``floor_tps``: a row starts while the step's shared part is
    predicted to stay at least :data:`KNEE_SHARE` of it, and is paused once the shared
    part falls under :data:`SHED_SHARE`. Raises ``ValueError`` on a floor that is not a
    finite positive number or negative counts.
    """
    if not (math.isfinite(floor_tps) and floor_tps > 0):
        raise ValueError(f"floor_tps must be a finite number > 0, got {floor_tps}")
    if num_running < 0 or cells_used < 0:
        raise ValueError(f"num_running ({num_running}) and cells_used ({cells_used}) "
                         "must be >= 0")
    limit = 1.0 / floor_tps
    target = headroom * limit
    ratio, measured_rows = measured_ratio(cost, recent)
    measured = {k: statistics.median(v[-BUCKET_STEPS:]) for k, v in by_rows(recent).items()}
    ctx = float(cells_used) if context_per_row is None else min(max(context_per_row, 0.0),
                                                                 float(cells_used))

    def modelled(k: int) -> float:
        return ratio * cost.step_s(k, k * ctx, 0, cells_used)

    fitted = row_slope(recent)
    if fitted is not None:
        slope = fitted
    elif measured:  # one row count measured: a row costs what the average row does now
        k0 = max(measured)
        slope = measured[k0] / k0
    else:
        slope = max(0.0, modelled(max(1, num_running) + 1) - modelled(max(1, num_running)))

    def predicted(k: int) -> float:
        """The step at ``k`` rows: measured, else from the nearest measured row count
        (below it first) plus the slope, else the fitted model."""
        if k in measured:
            return measured[k]
        if not measured:
            return modelled(k)
        k0 = min(measured, key=lambda r: (abs(r - k), r > k))
        return max(0.0, measured[k0] + (k - k0) * slope)

    now_s = predicted(num_running) if num_running else 0.0
    next_s = predicted(num_running + 1)

    # Shed: the steps the running rows take now are over the floor (a step's prefill
    # priced at the slope and taken off, so a prefill chunk does not pause a row).
    # (At least half the step stays: a chunk never explains a step away entirely.)
    last = [max(0.5 * s.step_s, s.step_s - slope * s.num_prefill_tokens)
            for s in list(recent)[-SHED_STEPS:] if s.num_decode == num_running and s.step_s > 0]
    # A floor no row count can hold (one row alone is over it: a neighbour took the
    # machine) is not held by running one row and idling the rest: until one row fits
    # again the rows follow the knee, as under auto.
    # (Measured at one row only: extrapolated from many rows at a fitted slope, one row
    # looked out of reach on a quiet machine and the knee rule then ran 10 rows.)
    infeasible = 1 in measured and measured[1] > limit
    if auto or infeasible:
        return _knee_room(num_running, measured, last, predicted, fitted,
                          TurnRoom(0, ratio, measured_rows, now_s, next_s, slope,
                                   prefill_price(recent, measured), None, infeasible,
                                   tuple(sorted(measured.items()))))
    # What a decoding row's reader sees: the mean of the last CLIENT_STEPS steps that
    # carried decode rows, prefill included — read for a shed only once all of them ran at
    # most the rows running now (after a shed the next steps are measured first).
    window = [s for s in list(recent)[-2 * CLIENT_STEPS:] if s.num_decode > 0][-CLIENT_STEPS:]
    seen = [s.step_s for s in window]
    settled = len(seen) == CLIENT_STEPS and all(s.num_decode <= num_running for s in window)
    client_s = statistics.fmean(seen) if seen else None
    price = prefill_price(recent, measured)
    if num_running > 1 and settled and client_s is not None and client_s > limit:
        # The rows that bring the step back under the target, at most half of them at once.
        per_row = max(slope, 0.25 * client_s / num_running)
        shed = min(math.ceil((client_s - target) / per_row), max(1, num_running // 2))
        return TurnRoom(-max(1, shed), ratio, measured_rows, now_s, next_s, slope, price,
                        client_s, measured=tuple(sorted(measured.items())))

    room = 0
    if num_running == 0:
        room = 1  # progress: nobody to slow down
    elif (num_running in measured and next_s <= target
          and (client_s is None or client_s + slope <= target)):
        room = 1  # one a step: the next steps measure it before another starts
    return TurnRoom(min(room, max_room), ratio, measured_rows, now_s, next_s, slope, price,
                    client_s, measured=tuple(sorted(measured.items())))


def shared_share(rows: int, step_s: float, slope_s: float) -> float:
    """The share of a ``step_s`` step at ``rows`` decoding rows that is not per row (1 with
    no per-row cost; below 0 when the slope says more than the whole step)."""
    return 1.0 - rows * slope_s / step_s if step_s > 0 else 0.0


def _knee_room(k: int, measured: dict[int, float], last: list[float],
               predicted: Callable[[int], float], fitted: float | None,
               base: TurnRoom) -> TurnRoom:
    """:func:`turn_room` under ``--floor-tps auto``: rows up to the knee, where the step's
    shared part falls to :data:`KNEE_SHARE` of it (``fitted``: the per-row slope fitted
    over the fresh steps; None while they span one row count). Before a slope is known one
    more row is tried (measured by the next steps, paused again if the shared part falls
    under :data:`SHED_SHARE`): the knee is re-found whenever the machine changes."""
    if k == 0:
        return replace(base, room=1)
    if (k > 1 and len(last) == SHED_STEPS and fitted is not None
            and shared_share(k, statistics.median(last), fitted) < SHED_SHARE):
        return replace(base, room=-1)
    if fitted is None:
        # One row count measured (or none): try one more once the rows running now were
        # measured, so every new row count is measured before the next.
        return replace(base, room=1) if k in measured else base
    # A slope is known: the step at k + 1 rows is predicted from the nearest measured row
    # count. (The rows running now need not be measured themselves: a turn that is still
    # prefilling counts as running but decodes no row yet, and in an agent workload some
    # turn nearly always is, so "k measured first" held the rows wherever they stood.)
    if shared_share(k + 1, predicted(k + 1), fitted) >= KNEE_SHARE:
        return replace(base, room=1)
    return base


class DecodeGate:
    """The engine's :class:`~mesh.engine.interface.TurnAdmission` and
    :class:`~mesh.engine.interface.PrefillBudget` for the floor policy, over the gate's latest
    :class:`~mesh.gate.decode_gate.BudgetState` (see the module docstring)."""

    def __init__(self, floor_tps: float, state: BudgetState, headroom: float = HEADROOM,
                 *, clock: Callable[[], float] = time.monotonic, auto: bool = False) -> None:
        turn_room(state.cost, floor_tps, 0, 0, ())  # validates
        if not 0.0 < headroom <= 1.0:
            raise ValueError(f"headroom must be in (0, 1], got {headroom}")
        self.floor_tps = floor_tps  # with ``auto``: unused by the decisions (the knee is)
        self.auto = auto
        self.headroom = headroom
        self.state = state
        self.last: TurnRoom | None = None  # the latest answer (read by /capacity)
        self._clock = clock
        # A projection for one more turn, waiting to be checked against a step measured
        # at that many rows: (rows, projected step s).
        self._pending: tuple[int, float] | None = None
        self._errors: deque[tuple[float, float]] = deque(maxlen=512)  # (t, measured/proj - 1)
        # What the engine thread measured when it last asked (for the prefill budget):
        # the step time at each row count, a prefill token's price and the per-row slope;
        # None before any.
        self._measured: tuple[dict[int, float], float, float] | None = None
        self.num_shed = 0  # turns paused to keep the floor, since start

    def update(self, state: BudgetState) -> None:
        self.state = state

    def effective_floor(self) -> float | None:
        """The floor the gate holds now, tokens/s per decoding row: ``floor_tps``, or with
        ``auto`` the rate at the row count it chose (None before a measured step)."""
        if not self.auto:
            return self.floor_tps
        last = self.last
        if last is None or last.projected_now_s <= 0:
            return None
        return 1.0 / last.projected_now_s

    def turn_room(self, num_running: int, cells_used: int,
                  recent: Sequence[StepSample]) -> int:
        st = self.state
        self._check(recent)
        answer = turn_room(st.cost, self.floor_tps, num_running, cells_used, recent,
                           context_per_row=st.context_per_row, headroom=self.headroom,
                           auto=self.auto)
        self.last = answer
        if answer.measured:  # a prefill token priced as measured, else as one more row
            self._measured = (dict(answer.measured), answer.prefill_token_s or answer.slope_s,
                              answer.slope_s)
        if answer.room < 0:
            self.num_shed -= answer.room
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
        """The prefill budget: what fits beside the decode rows within the floor (with
        ``auto``, within the knee's step), down to :data:`MIN_PREFILL_CHUNK` tokens a step
        (progress) when they fill it; a token priced as steps with prefill measured (the
        per-row slope until one did), where steps at ``num_decode`` rows were measured."""
        measured = self._measured
        if measured is not None and num_decode in measured[0] and measured[1] > 0:
            by_count, price, slope = measured
            step_s = by_count[num_decode]
            if self.auto:
                shared = max(0.0, shared_share(num_decode, step_s, slope)) * step_s
                limit = max(AUTO_PREFILL_STRETCH * step_s, shared / KNEE_SHARE) / self.headroom
            else:
                limit = 1.0 / self.floor_tps
            if step_s > limit:
                return OVER_FLOOR_CHUNK
            return max(MIN_PREFILL_CHUNK, int((self.headroom * limit - step_s) / price))
        st = self.state
        return prefill_budget(st.cost, self.floor_tps, num_decode, cells_used, scale=st.scale,
                              context_per_row=st.context_per_row,
                              min_chunk=MIN_PREFILL_CHUNK, at_floor=OVER_FLOOR_CHUNK)
