"""The pure admission decision: the projection of what each worker would get, then the
decision built on it. Read top to bottom:

**The projection.** The throughput projection behind the gate: what each worker would get with
more workers.

* A step takes ``a + b·n + c·Σctx + e·n·cells + f·cells`` for ``n`` sessions decoding
  together over ``cells`` used cells (:mod:`mesh.gate.model`; idle workers' cells count too); every
  session in the step makes one token, so a decoding worker
  makes ``1 / step`` tokens/s.
* Idle-gap estimate: worker ``w`` decodes in a given step with probability ``d_w``, its
  observed duty cycle (1.0 until measured, or when ``use_idle_estimate`` is off). How many
  *others* decode alongside a worker is then a Poisson-binomial count; the projection takes
  its ``idle_quantile`` (default 0.9), so the floor holds in about that share of steps,
  not merely on average. A worker waiting on a tool call is thus free capacity, counted
  honestly: four workers at duty 0.5 still collide too often to count as fewer, sixteen at
  0.2 do not.
* Start-up guard: admissions granted but not yet visible as sessions count as workers with
  duty 1.0, so a burst cannot over-subscribe before anything is measured. A new worker is
  likewise counted at duty 1.0 with a fresh session's context (prefix +
  ``new_worker_cells``): its idle time becomes capacity once it is measured.
* Contexts: the decoding set is taken to be the workers with the longest contexts
  (conservative; exact when every worker is busy).

So more load of any kind (a worker, a longer context, a higher duty) never increases the
headroom, and admitting ``headroom`` workers one by one gives exactly the projected load.

**The decision.** The pure admission decision: ``decide(GateInput, GateConfig, ThroughputModel,
now)``.

``decide`` asks how many more workers fit now — under the product's policies (``floor``,
``none``) the hard limits alone (the slots and sequence ids of
:func:`~mesh.gate.decide.project`), since the floor is held turn by turn by the decode
gate; under a comparison policy its :class:`WorkerRule` — then keeps the queue
first-come first-served: admit only with room *and* nobody queued ahead; otherwise wait
while the queue has room, else refuse. It never mutates its inputs. The clock (``now``) is
an input so that callers and tests control time; the decision only echoes it back.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple, Protocol

from mesh.engine.interface import PoolLoad, StepSample
from mesh.gate.config import GateConfig
from mesh.gate.model import StepCost, ThroughputModel

__all__ = [
    "Decision", "GateInput", "Projection", "Verdict", "WorkerRule", "WorkerTps", "count_quantile",
    "decide", "live_scale", "lone_worker_tps", "prefill_ratio", "project"
]


# -------------------- the projection ------------------------------------------

@dataclass(frozen=True)
class GateInput:
    """What the gate sees: a pool snapshot plus the admission layer's own state.

    ``num_tickets``: admissions granted and not yet released (each one is, or is about to
    become, a session). ``queue_ahead``: waiters ahead of the request being decided (0 for
    the queue's head; the queue length for a new arrival). ``mean_hold_s``: how long a
    ticket is held on average, None until one has been released. ``attach_block``: why the
    engine would refuse an attach right now (``Engine.check_attach``), empty if it would not.
    """

    load: PoolLoad
    num_tickets: int = 0
    queue_ahead: int = 0
    mean_hold_s: float | None = None
    attach_block: str = ""

    @property
    def num_pending(self) -> int:
        """Admissions not yet visible as sessions (the start-up guard's load)."""
        return max(0, self.num_tickets - len(self.load.sessions))

    @property
    def num_workers(self) -> int:
        """Workers holding or about to hold a pool slot."""
        return max(self.num_tickets, len(self.load.sessions))


class WorkerTps(NamedTuple):
    id: str
    tps: float


@dataclass(frozen=True)
class Projection:
    tps_next: float  # the slowest worker's tokens/s if one more is admitted
    per_worker_next: tuple[WorkerTps, ...]  # every worker (and "next") with one more
    tps_now: float | None  # the slowest worker's projected tokens/s now (None: no workers)
    headroom: int  # new workers that keep every worker >= floor, within hard limits
    hard_room: int  # new workers the slots / sequence ids allow at all
    num_effective: float  # expected number of workers decoding in a step (Σ duty)
    num_alongside: int  # others counted as decoding alongside a worker (the quantile)
    num_pending: int
    idle_estimate: bool  # some worker counted by a measured duty cycle < 1
    new_worker_context: float
    cost: StepCost
    scale: float = 1.0  # live correction: measured / modelled time of the latest steps


_SCALE_STEPS = 32  # latest decoding steps the live correction looks at


def lone_worker_tps(model: ThroughputModel, prefix_cells: int, private_cells: int) -> float:
    """Tokens/s one worker alone in the pool is projected to get: a step of one row over the
    prefix plus its own ``private_cells``. Below the floor, no admission can help: the
    gate runs one worker at a time and every sample is under the floor."""
    cells = prefix_cells + private_cells
    return 1.0 / model.step_s(1, cells, 0, cells)


def live_scale(steps: Sequence[StepSample], cost: StepCost) -> float:
    """Measured / modelled decode time over the latest decoding steps, clamped.

    The least-squares fit learns the *shape* of decode step time (fixed, per session, per
    context token) from a long window; the machine's speed *now* can differ (other
    processes, a thermal limit), a collinear window can mis-split the terms, and the
    workers' own prefill (instructions, tool results) rides in the same steps and slows
    every decoding worker. The ratio of the time the latest steps really took to what the
    decode-only model gives for them (a time-weighted mean, so prefill-heavy steps count
    as the time they cost) anchors the projection to the regime the workers are in; the
    fitted shape still says how it changes with one more worker.
    """
    recent = [s for s in list(steps)[-_SCALE_STEPS:] if s.num_decode > 0 and s.step_s > 0]
    if len(recent) < 4:
        return 1.0
    measured = sum(s.step_s for s in recent)
    modelled = sum(cost.step_s(s.num_decode, s.sum_context, s.num_prefill_tokens, s.cells_used)
                   for s in recent)
    return min(max(measured / modelled, 0.25), 4.0)


def prefill_ratio(steps: Sequence[StepSample]) -> float:
    """Prefill tokens the workers bring per token they decode (tool results, new turns),
    over the pool's recent steps: each decoding worker adds ``ratio`` prefill tokens to the
    steps it decodes in, on average."""
    decoded = sum(s.num_decode for s in steps)
    if decoded < 16:
        return 0.0
    return min(sum(s.num_prefill_tokens for s in steps) / decoded, 8.0)


def count_quantile(duties: Sequence[float], q: float) -> int:
    """Smallest k with P(at most k of these workers decode) >= q (Poisson-binomial)."""
    dist = [1.0]
    for d in duties:
        nxt = [0.0] * (len(dist) + 1)
        for k, p in enumerate(dist):
            nxt[k] += p * (1.0 - d)
            nxt[k + 1] += p * d
        dist = nxt
    acc = 0.0
    for k, p in enumerate(dist):
        acc += p
        if acc >= q - 1e-12:
            return k
    return len(duties)


class _Contexts:
    """Sums of the largest contexts among the workers plus ``extra`` fresh ones."""

    def __init__(self, contexts: Sequence[float], fresh: float) -> None:
        self.sorted = sorted(contexts, reverse=True)
        self.prefix = [0.0, *accumulate(self.sorted)]
        self.fresh = fresh

    def top(self, m: int, extra: int = 0, skip: int | None = None) -> float:
        """Sum of the ``m`` largest of (workers except sorted index ``skip``) + ``extra``×fresh."""
        n = len(self.sorted) - (skip is not None)
        best = 0.0
        for j in range(max(0, m - n), min(extra, m) + 1):  # j fresh ones, m - j workers
            k = m - j
            s = (
                self.prefix[k]
                if skip is None or skip >= k
                else self.prefix[k + 1] - self.sorted[skip]
            )
            best = max(best, s + j * self.fresh)
        return best


def project(inp: GateInput, config: GateConfig, model: ThroughputModel) -> Projection:
    """Project every worker's tokens/s with more workers (pure; see the module docstring)."""
    cost = model.params
    load = inp.load
    ids, duties, contexts = [], [], []
    for s in load.sessions:
        d = s.duty_cycle
        use = (config.use_idle_estimate and d is not None and math.isfinite(d)
               and s.age_s >= config.min_duty_age_s)
        ids.append(s.id)
        duties.append(min(max(d, 0.0), 1.0) if use and d is not None else 1.0)
        contexts.append(float(s.context_len))
    fresh = float(load.prefix_cells + config.new_worker_cells)
    for k in range(inp.num_pending):
        ids.append(f"pending-{k + 1}")
        duties.append(1.0)
        contexts.append(fresh)
    q = config.idle_quantile
    ctx = _Contexts(contexts, fresh)
    # Others alongside an existing worker: at worst the one with the lowest duty is the
    # subject, which leaves the stochastically largest set of others.
    if duties:
        lowest = min(range(len(duties)), key=duties.__getitem__)
        along = count_quantile(duties[:lowest] + duties[lowest + 1 :], q)
    else:
        along = 0
    along_new = count_quantile(duties, q)  # others alongside a new worker

    scale = live_scale(load.recent_steps, cost)
    ratio = prefill_ratio(load.recent_steps)
    # The correction was measured at up to ``seen`` decoding rows; a faster-than-modelled
    # regime there says nothing about more rows (a lone worker's steps are cheap, and
    # extrapolating that over-admitted on SmolLM2), so beyond it only a slower one counts.
    seen = max((s.num_decode for s in list(load.recent_steps)[-_SCALE_STEPS:]), default=0)

    # Cells in use with ``k`` more workers: every row attends over all of them.
    base_cells = float(load.cells_used + inp.num_pending * config.new_worker_cells)

    def cells(k: int) -> float:
        return base_cells + k * config.new_worker_cells

    def step(n: float, sum_ctx: float, k: int = 0) -> float:
        # Each decoding worker also brings its share of prefill (``ratio`` per token).
        rows = n * (1.0 + ratio)
        t = (cost.a + (cost.b + cost.d * ratio) * n + cost.c * sum_ctx
             + cost.e * rows * cells(k) + cost.f * cells(k))
        return max(t * (scale if n <= seen else max(scale, 1.0)), 1e-9)

    def slowest_step(k: int) -> float:
        """Step time of the slowest worker with ``k >= 1`` more workers."""
        new = step(1 + along_new + k - 1, fresh + ctx.top(along_new + k - 1, k - 1), k)
        if not duties:
            return new
        return max(new, step(1 + along + k, ctx.top(along + 1 + k, k), k))

    # Attached sessions are bounded by sequence ids, or with parking by max_attached.
    cap = max(load.max_sessions, load.max_attached)
    limit = min(config.max_workers or cap, cap)
    hard_room = max(0, min(limit - inp.num_workers, load.attach_room - inp.num_pending))
    budget_s = 1.0 / (config.floor_tps * (1.0 + config.margin))
    headroom = 0
    while headroom < hard_room and slowest_step(headroom + 1) <= budget_s:
        headroom += 1
    rank = {i: r for r, i in enumerate(sorted(range(len(contexts)), key=lambda i: -contexts[i]))}
    per_worker = tuple(
        WorkerTps(wid, 1.0 / step(2 + along, c + ctx.top(along + 1, 1, skip=rank[i]), 1))
        for i, (wid, c) in enumerate(zip(ids, contexts, strict=True))
    )
    next_tps = 1.0 / step(1 + along_new, fresh + ctx.top(along_new), 1)
    return Projection(
        tps_next=1.0 / slowest_step(1),
        per_worker_next=(*per_worker, WorkerTps("next", next_tps)),
        tps_now=1.0 / step(1 + along, ctx.top(along + 1)) if duties else None,
        headroom=headroom,
        hard_room=hard_room,
        num_effective=sum(duties),
        num_alongside=along,
        num_pending=inp.num_pending,
        idle_estimate=any(d < 1.0 for d in duties),
        new_worker_context=fresh,
        cost=cost,
        scale=scale,
    )

# -------------------- the decision --------------------------------------------

class Verdict(enum.StrEnum):
    ADMIT = "admit"
    WAIT = "wait"  # queue it; retry_after_s estimates when
    REFUSE = "refuse"  # the queue is full


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    retry_after_s: float  # 0.0 when admitted
    headroom: int  # more workers that fit now under the active policy
    projection: Projection
    reasons: tuple[str, ...]
    decided_at: float

    @property
    def admitted(self) -> bool:
        return self.verdict is Verdict.ADMIT


class WorkerRule(Protocol):
    """A comparison policy (:mod:`mesh.sim.policies`): it admits each worker for its life
    on a rule of its own, and its workers' turns run as soon as they are asked for (no
    decode gate). Pure, like :func:`decide`."""

    @property
    def name(self) -> str:
        """The policy's name (``GateConfig.policy`` names it too)."""

    @property
    def needs_seed(self) -> bool:
        """Whether the rule reads the throughput model (the CLI then seeds it)."""

    def room(self, inp: GateInput, proj: Projection, config: GateConfig,
             now: float) -> tuple[int, str]:
        """More workers allowed now, within ``proj.hard_room``; why when zero."""

    def admit_reason(self, proj: Projection, room: int, config: GateConfig) -> str:
        """Why an admission happened, in the rule's own figures."""


def _room(inp: GateInput, config: GateConfig, proj: Projection, rule: WorkerRule | None,
          now: float) -> tuple[int, str]:
    """How many more workers the active policy allows now, and why (when zero)."""
    if proj.hard_room <= 0:
        return 0, f"no free worker slot ({inp.num_workers} workers hold or await one)"
    if inp.attach_block:
        return 0, f"the pool cannot attach now: {inp.attach_block}"
    if rule is not None:
        return rule.room(inp, proj, config, now)
    return proj.hard_room, ""


def _admit_reason(config: GateConfig, proj: Projection, room: int,
                  rule: WorkerRule | None) -> str:
    """Why an admission happened: what decided it, never a projection under the floor
    unexplained."""
    if rule is not None:
        return rule.admit_reason(proj, room, config)
    if config.policy == "floor":
        return (f"admit: room for {room} more worker(s) in memory; each turn then waits for "
                f"the decode gate, which starts it only while every decoding worker keeps "
                f"{config.floor_tps:g} tok/s")
    return f"admit: room for {room} more worker(s) under policy {config.policy}"


def _retry_after(inp: GateInput, config: GateConfig, slots_needed: int) -> float:
    if inp.mean_hold_s is not None and inp.mean_hold_s > 0:
        interval = inp.mean_hold_s / max(1, inp.num_workers)
    else:
        interval = config.default_retry_s
    return min(max(slots_needed * interval, config.recheck_s), config.max_retry_s)


def decide(inp: GateInput, config: GateConfig, model: ThroughputModel, now: float,
           rule: WorkerRule | None = None) -> Decision:
    """Admit, wait or refuse one more worker. Pure: reads its inputs, mutates nothing."""
    proj = project(inp, config, model)
    room, why = _room(inp, config, proj, rule, now)
    reasons: list[str] = [why] if why else []
    if room > 0 and inp.queue_ahead == 0:
        reasons.append(_admit_reason(config, proj, room, rule))
        return Decision(Verdict.ADMIT, 0.0, room, proj, tuple(reasons), now)
    if room > 0:
        reasons.append(f"{inp.queue_ahead} requests are queued ahead")
    if inp.queue_ahead < config.max_queue:
        retry = _retry_after(inp, config, inp.queue_ahead + 1)
        return Decision(Verdict.WAIT, retry, room, proj, tuple(reasons), now)
    reasons.append(f"the wait queue is full ({inp.queue_ahead} of {config.max_queue})")
    retry = _retry_after(inp, config, inp.queue_ahead - config.max_queue + 1)
    return Decision(Verdict.REFUSE, retry, room, proj, tuple(reasons), now)
