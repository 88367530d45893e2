"""The floor gate over an engine and the ``/capacity`` document it writes. Read top to
bottom:

**The gate.** The floor-tps gate's async face: :class:`FloorGate` implements
:class:`~mesh.gate.queue.Admission` over an :class:`~mesh.engine.interface.Engine`.

Under policy ``floor`` it admits workers by memory and hands the engine a
:class:`~mesh.gate.decode_gate.DecodeGate` that starts each *turn* only while every decoding
worker keeps the floor (:meth:`FloorGate.install` hands it over); under ``none`` it admits
by memory and the engine runs turns as asked. A comparison policy
(:mod:`mesh.sim.policies`) comes as a :class:`~mesh.gate.decide.WorkerRule`.

Invariants:

* The queue is the one FIFO of :mod:`mesh.gate.queue`, its head let go while
  :func:`decide` admits with nobody ahead (``_choose``). It is bounded in places (one per
  waiter) by ``config.max_queue``, and per caller by ``config.queue_share``
  (:mod:`mesh.gate.queue`): a request of N places (a task's N subtasks) is checked for
  all N at once, at the door (``check_queue``/``_door``).
* The head re-checks every ``config.recheck_s`` while it waits (load changes as workers go
  idle on tool calls); every waiter is woken when a ticket is released or the queue moves.
* A ticket granted but never handed over (the waiter was cancelled at that moment) is
  released (the queue's ``abandon``), so cancellation never leaks a slot.
* Every decision learns first: the engine's new step samples go into the model.

Everything runs on one event loop (asyncio or trio through anyio); the methods that do not
await are atomic with respect to other tasks.

**The /capacity document.** The floor gate's ``/capacity`` document: what the gate decides now,
over what load.

Pure builders over one snapshot (:meth:`FloorGate.capacity` takes it and decides on it):
every number is finite or null, so the document is JSON as it stands.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

import anyio
import anyio.lowlevel

from mesh.engine.interface import Engine, PoolLoad, PrefillBudget, SessionState
from mesh.gate.config import POLICIES, GateConfig
from mesh.gate.decide import Decision, GateInput, Verdict, WorkerRule, decide, live_scale
from mesh.gate.decode_gate import KNEE_SHARE, BudgetState, DecodeGate, FloorBudget, TurnRoom
from mesh.gate.model import StepCost, ThroughputModel
from mesh.gate.queue import (
    ANONYMOUS,
    OnPosition,
    QueueCheck,
    QueueFull,
    QueueShares,
    Ticket,
    Waiter,
    WaiterQueue,
    places_needed,
    report_admitted,
)

__all__ = ["FloorGate", "GateTicket", "GateView", "capacity_doc"]


# -------------------- the gate ------------------------------------------------

_HOLD_EWMA = 0.2


class GateTicket:
    """An admission; ``release()`` when the worker's session is detached. Idempotent."""

    def __init__(self, gate: FloorGate, key: str, admitted_at: float) -> None:
        self.key = key
        self.admitted_at = admitted_at
        self._gate = gate
        self.is_released = False

    async def release(self) -> None:
        self._gate._release(self)

    def release_nowait(self) -> None:
        """Synchronous release (for cleanup paths that cannot await)."""
        self._gate._release(self)


class FloorGate:
    """Bounded FIFO admission in front of the pool, deciding with :func:`decide`."""

    def __init__(
        self,
        engine: Engine,
        config: GateConfig,
        model: ThroughputModel | None = None,
        *,
        rule: WorkerRule | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config.validate()
        if rule is None and config.policy not in POLICIES:
            raise ValueError(f"gate policy {config.policy!r} is not one of {', '.join(POLICIES)}"
                             f"; a comparison policy needs its rule (mesh.sim.policies)")
        if rule is not None and rule.name != config.policy:
            raise ValueError(f"the rule {rule.name!r} does not implement policy "
                             f"{config.policy!r}")
        self.engine = engine
        self.config = config
        self.rule = rule
        self.model = model if model is not None else ThroughputModel()
        self._clock = clock
        self._waiters: WaiterQueue[GateTicket] = WaiterQueue(
            self._choose, self._release, QueueShares(config.max_queue, config.queue_share),
            head_recheck_s=config.recheck_s)
        self._tickets: set[GateTicket] = set()
        self._mean_hold_s: float | None = None
        self.num_admitted = 0
        self.num_refused = 0
        self._budget: FloorBudget | None = None
        self._decode_gate: DecodeGate | None = None

    # ------------------------------------------------------------------ prefill budget

    def pool_budget(self) -> PrefillBudget | None:
        """The prefill budget to hand the pool (``pool.set_prefill_budget``): a step beside
        decoding workers carries only the prefill that keeps it within ``1/floor_tps``.
        None under policy ``none`` (a step prefills up to ``n_batch``). The budget follows
        the model: every snapshot the gate takes refreshes it."""
        if self.config.policy == "none":
            return None
        if self.config.policy == "floor":
            return self.decode_gate()
        if self._budget is None:
            self._budget = FloorBudget(self.config.floor_tps, self._budget_state(None))
        return self._budget

    def decode_gate(self) -> DecodeGate | None:
        """The decode gate to hand the pool (``pool.set_turn_admission`` and, as its
        prefill budget, ``pool.set_prefill_budget``) under policy ``floor``; None under
        the others (their turns run as soon as they are asked for)."""
        if self.config.policy != "floor":
            return None
        if self._decode_gate is None:
            state = self._budget_state(None, self.model.shape)
            self._decode_gate = DecodeGate(self.config.floor_tps, state,
                                           auto=self.config.auto_floor)
        return self._decode_gate

    def install(self) -> None:
        """Hand the engine this gate's prefill budget and decode gate (None: none)."""
        self.engine.set_prefill_budget(self.pool_budget())
        self.engine.set_turn_admission(self.decode_gate())

    def _budget_state(self, load: PoolLoad | None, cost: StepCost | None = None) -> BudgetState:
        """The budget's view: ``cost`` (default: the live fit), its live correction over
        the latest steps and a decoding row's mean context."""
        cost = self.model.params if cost is None else cost
        steps = load.recent_steps if load is not None else ()
        rows = sum(s.num_decode for s in steps)
        ctx = sum(s.sum_context for s in steps) / rows if rows else None
        return BudgetState(cost, live_scale(steps, cost), ctx)

    # ------------------------------------------------------------------ reading

    @property
    def queue_len(self) -> int:
        return len(self._waiters)

    @property
    def num_tickets(self) -> int:
        return len(self._tickets)

    def gate_input(self, queue_ahead: int) -> tuple[GateInput, PoolLoad]:
        """Snapshot the engine (teaching the model its new steps) into a :class:`GateInput`."""
        load = self.engine.load()
        self.model.observe(load)
        if self._budget is not None or self._decode_gate is not None:
            state = self._budget_state(load)
            if self._budget is not None:
                self._budget.update(state)
            if self._decode_gate is not None:  # the seed's shape, anchored live per step
                self._decode_gate.update(self._budget_state(load, self.model.shape))
        check = self.engine.check_attach()
        inp = GateInput(
            load=load,
            num_tickets=len(self._tickets),
            queue_ahead=queue_ahead,
            mean_hold_s=self._mean_hold_s,
            attach_block="" if check.ok else (check.reason or "refused"),
        )
        return inp, load

    def decide_now(self, queue_ahead: int | None = None) -> Decision:
        """The decision for a new arrival (``queue_ahead`` defaults to the queue length)."""
        ahead = len(self._waiters) if queue_ahead is None else queue_ahead
        inp, _ = self.gate_input(ahead)
        return decide(inp, self.config, self.model, self._clock(), self.rule)

    def check_queue(self, *, places: int = 1, caller: str = ANONYMOUS) -> QueueCheck:
        """Would ``caller``'s request of ``places`` places (a task's subtasks) be taken?
        Refused when they do not all fit the queue's free places, or ``caller``'s share."""
        why, retry_after_s = self._door(places, caller)
        return QueueCheck(ok=not why, queue_len=len(self._waiters), retry_after_s=retry_after_s,
                          reason=why)

    def _door(self, places: int, caller: str) -> tuple[str, float]:
        """Why a request of ``places`` from ``caller`` is refused ("": it is taken) and
        when to retry. A pure read of the queue (the decision learns from the engine)."""
        need = places_needed(places, self.config.max_queue)
        d = self.decide_now(queue_ahead=len(self._waiters) + need - 1)
        if d.verdict is Verdict.REFUSE:
            return "; ".join(d.reasons), d.retry_after_s
        shares = self._waiters.shares
        over = shares.over_share(caller, places)
        if not over:
            return "", d.retry_after_s
        # Retry once the caller's over-th place from the head has been admitted.
        pos = self._waiters.positions_of(caller)[over - 1]
        ahead = min(pos, max(1, self.config.max_queue)) - 1
        return shares.refusal(caller, places), self.decide_now(ahead).retry_after_s

    def queued_by(self, caller: str) -> int:
        """Places ``caller`` holds in the queue now."""
        return self._waiters.shares.waiting(caller)

    # ------------------------------------------------------------------ admitting

    async def admit(
        self, key: str, on_position: OnPosition | None = None, *, accepted: bool = False,
        caller: str = ANONYMOUS,
    ) -> Ticket:
        """Wait until admitted (see :class:`~mesh.gate.queue.Admission`); ``caller``'s
        place counts against its share of the queue."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        d = self.decide_now()
        if not accepted and d.verdict is not Verdict.ADMIT:
            why, retry_after_s = self._door(1, caller)
            if why:
                self.num_refused += 1
                raise QueueFull(why, retry_after_s)
        if d.verdict is Verdict.ADMIT:
            ticket = self._grant(key)
        else:
            ticket = await self._waiters.wait(Waiter(key, caller), on_position)
        await report_admitted(on_position, lambda: self._release(ticket))
        return ticket

    def _choose(self, head: Waiter[GateTicket]) -> GateTicket | None:
        """The queue's head may go when :func:`decide` admits with nobody ahead."""
        return self._grant(head.key) if self.decide_now(queue_ahead=0).admitted else None

    def _grant(self, key: str) -> GateTicket:
        ticket = GateTicket(self, key, self._clock())
        self._tickets.add(ticket)
        self.num_admitted += 1
        return ticket

    def _release(self, ticket: GateTicket) -> None:
        if ticket.is_released:
            return
        ticket.is_released = True
        self._tickets.discard(ticket)
        hold = max(0.0, self._clock() - ticket.admitted_at)
        old = self._mean_hold_s
        self._mean_hold_s = hold if old is None else old + _HOLD_EWMA * (hold - old)
        self._waiters.poke()

    # ------------------------------------------------------------------ reporting

    def capacity(self) -> dict[str, Any]:
        """The ``/capacity`` document (JSON-able; every number finite or null)."""
        inp, load = self.gate_input(len(self._waiters))
        d = decide(inp, self.config, self.model, self._clock(), self.rule)
        return capacity_doc(self, inp, load, d, self._decode_gate,
                            self._waiters.shares.num_callers)

# -------------------- the /capacity document ----------------------------------

class GateView(Protocol):
    """What the document reads of the gate (:class:`~mesh.gate.admission.FloorGate`)."""

    engine: Engine
    config: GateConfig
    model: ThroughputModel
    num_admitted: int
    num_refused: int

    @property
    def queue_len(self) -> int: ...

    @property
    def num_tickets(self) -> int: ...


def capacity_doc(gate: GateView, inp: GateInput, load: PoolLoad, d: Decision,
                 decode_gate: DecodeGate | None, queue_callers: int) -> dict[str, Any]:
    """The ``/capacity`` document of ``gate`` from one snapshot (``inp``, ``load``) and the
    decision ``d`` on it; ``decode_gate`` is the gate's running one (None: not built)."""
    proj = d.projection
    # Workers decoding now: an idle or waiting session's rate is from its last turn
    # (stale: a worker on a tool call is not slowed by anything).
    running = (SessionState.DECODING, SessionState.PREFILLING)
    measured = sorted(s.decode_tps for s in load.sessions
                      if s.decode_tps is not None and s.state in running)
    return {
        "engine": _engine_doc(gate.engine),
        # the floor held now: --floor-tps, or under auto the per-row rate at the knee the
        # decode gate chose (the configured value until it measured a step)
        "floor_tps": _floor_now(gate.config.floor_tps, decode_gate),
        "floor_mode": "auto" if gate.config.auto_floor else "fixed",
        "policy": gate.config.policy,
        "verdict": d.verdict.value,
        "reasons": list(d.reasons),
        "sessions": {
            "total": len(load.sessions),
            **{state.value: load.count(state) for state in SessionState},
        },
        # attached = resident (holding a sequence id and their cells) + parked (cells
        # off the cache, re-prefilled before their next turn; 0 where none park)
        "parking": {"max_attached": load.max_attached, "resident": load.num_resident,
                    "parked": load.num_parked, "parked_tokens": load.parked_tokens,
                    "parks": load.parks, "resumes": load.resumes,
                    "resume_tokens": load.resume_tokens, "swaps": load.swaps,
                    "parked_bytes": load.parked_bytes, "park_memory": load.park_memory},
        # suffixes replaced by a summary (Session.compact) and the cells that freed; the
        # shared prefix is never compacted
        "compaction": {"compactions": load.compactions,
                       "compacted_cells": load.compacted_cells},
        "in_flight": inp.num_pending,
        "tickets": gate.num_tickets,
        "measured_tps": {
            "count": len(measured),
            "min": measured[0] if measured else None,
            "p50": statistics.median(measured) if measured else None,
        },
        "projected_tps_next": proj.tps_next,
        "projected_tps_now": proj.tps_now,
        "projected_tps_next_by_worker": {w.id: w.tps for w in proj.per_worker_next},
        "headroom": d.headroom,
        "queue_len": gate.queue_len,
        "max_queue": gate.config.max_queue,
        # each authenticated caller's share of the queue, and how many callers wait
        "max_queue_per_caller": gate.config.queue_share,
        "queue_callers": queue_callers,
        "kv_cells": {
            "used": load.cells_used,
            "total": load.cells_total,
            "prefix": load.prefix_cells,
            "naive_equivalent": load.naive_cells,
            "reduction": load.reduction,
        },
        # the KV cache in bytes (cells x bytes a cell): allocated (the whole context),
        # in use (prefix + resident suffixes); 0 where the engine does not know a cell's size
        "kv_bytes": {
            "allocated": int(load.cells_total * load.cell_bytes),
            "used": int(load.cells_used * load.cell_bytes),
            "per_cell": load.cell_bytes,
        },
        "retry_after_s": d.retry_after_s,
        "projected_idle_estimate": proj.idle_estimate,
        "model": {**gate.model.describe(), "live_scale": proj.scale},
        "admitted_total": gate.num_admitted,
        "refused_total": gate.num_refused,
        # the pool's totals since start (0 where the engine does not count them)
        "pool_totals": {"sessions_attached": load.sessions_attached,
                        "prefill_tokens": load.prefill_tokens,
                        "sessions_reaped": load.sessions_reaped},
        "workers": _worker_rows(load),
        "turns": _turns_doc(load, decode_gate, _floor_now(gate.config.floor_tps, decode_gate)),
    }


def _floor_now(floor_tps: float, decode_gate: DecodeGate | None) -> float:
    floor = decode_gate.effective_floor() if decode_gate is not None else None
    return floor_tps if floor is None else floor


def _turns_doc(load: PoolLoad, decode_gate: DecodeGate | None, floor_tps: float
               ) -> dict[str, Any]:
    """The decode gate's side of ``/capacity``: turns running and waiting, and the
    measured step its last answer was anchored to (null where no decode gate runs)."""
    last = decode_gate.last if decode_gate is not None else None
    recent = [s for s in load.recent_steps if s.num_decode > 0]
    return {
        "gated": decode_gate is not None,
        "waiting": load.count(SessionState.WAITING),
        "running": load.count(SessionState.DECODING) + load.count(SessionState.PREFILLING),
        "measured_step_s": statistics.median(s.step_s for s in recent[-8:]) if recent
        else None,
        "floor_step_s": 1.0 / floor_tps,
        "ratio": last.ratio if last is not None else None,
        "projected_step_now_s": last.projected_now_s if last is not None else None,
        "projected_step_next_s": last.projected_next_s if last is not None else None,
        "room": last.room if last is not None else None,
        "row_slope_s": last.slope_s if last is not None else None,
        "shed_total": decode_gate.num_shed if decode_gate is not None else None,
        "why": _why(last, decode_gate),
        # measured / projected - 1 for one more turn, scored over the last minute
        "projection_error": decode_gate.projection_error()
        if decode_gate is not None else None,
    }


def _why(last: TurnRoom | None, gate: DecodeGate | None) -> str | None:
    """The decode gate's last answer in words (the floor it held and what decided)."""
    if gate is None or last is None:
        return None
    step = (f"{last.projected_now_s * 1e3:.0f} ms a step now, "
            f"{last.projected_next_s * 1e3:.0f} ms with one more row")
    if gate.auto:
        rule = (f"auto: rows while the step's shared part stays >= "
                f"{100 * KNEE_SHARE:g} % of it")
    else:
        rule = f"floor {gate.floor_tps:g} tok/s: a step within {1e3 / gate.floor_tps:.0f} ms"
    if last.infeasible and not gate.auto:
        rule = (f"floor {gate.floor_tps:g} tok/s is out of reach (one row alone is over "
                f"it): rows at the knee until one fits again")
    verb = ("start one more turn" if last.room > 0 else
            f"pause {-last.room} running turn(s)" if last.room < 0 else "hold the rows")
    return f"{verb} ({rule}; {step})"


def _engine_doc(engine: Engine) -> dict[str, Any]:
    """Which engine runs (``PoolInfo.engine``) and, for a remote backend, the metrics it
    last exposed (``engine.backend_metrics()``)."""
    try:
        name = engine.info.engine
    except (AttributeError, RuntimeError):  # a stub, or a pool not started yet
        name = None
    return {"name": name, "backend": engine.backend_metrics()}


def _worker_rows(load: PoolLoad) -> list[dict[str, Any]]:
    """One row per pool session for ``capacity()["workers"]`` (the dashboard's chart)."""
    return [
        {
            "id": s.id,
            "state": s.state.value,
            "decodeTps": s.decode_tps,
            "dutyCycle": s.duty_cycle,
            "privateCells": s.private_cells,
            "ageS": round(s.age_s, 3),
            "turnPlace": s.turn_place,
        }
        for s in load.sessions
    ]
