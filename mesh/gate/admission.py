"""The floor-tps gate's async face: :class:`FloorGate` implements
:class:`~mesh.gate.types.Admission` over an :class:`~mesh.engine.types.Engine`.

Invariants:

* The queue is FIFO and bounded in places (one per waiter) by ``config.max_queue``, and
  per caller by ``config.queue_share`` (:mod:`mesh.gate.shares`): a request of N places
  (a task's N subtasks) is checked for all N at once. Only the head is ever admitted;
  an entry leaves the queue only by admission or by its own waiter's cancellation, and
  ``_shares`` counts exactly the entries of ``_queue`` (``_enqueue``/``_dequeue``).
* The head re-checks every ``config.recheck_s`` while it waits (load changes as workers go
  idle on tool calls); every waiter is woken when a ticket is released or the queue moves.
* A ticket granted but never handed over (the waiter was cancelled at that moment) is
  released, so cancellation never leaks a slot.
* Every decision learns first: the engine's new step samples go into the model.

Everything runs on one event loop (asyncio or trio through anyio); the methods that do not
await are atomic with respect to other tasks.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel

from mesh.engine.types import Engine, PoolLoad, PrefillBudget, SessionState
from mesh.gate.budget import BudgetState, FloorBudget
from mesh.gate.config import GateConfig, Policy, PolicyKind
from mesh.gate.decide import Decision, GateInput, Verdict, decide
from mesh.gate.decode_gate import DecodeGate
from mesh.gate.model import StepCost, ThroughputModel
from mesh.gate.projection import live_scale
from mesh.gate.shares import ANONYMOUS, QueueShares, places_needed
from mesh.gate.types import OnPosition, QueueCheck, QueueFull, Ticket

__all__ = ["FloorGate", "GateTicket"]

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


class _Waiter:
    __slots__ = ("caller", "key", "ticket", "wake")

    def __init__(self, key: str, caller: str = ANONYMOUS) -> None:
        self.key = key
        self.caller = caller
        self.ticket: GateTicket | None = None
        self.wake = anyio.Event()


class FloorGate:
    """Bounded FIFO admission in front of the pool, deciding with :func:`decide`."""

    def __init__(
        self,
        engine: Engine,
        config: GateConfig,
        model: ThroughputModel | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config.validate()
        self.requested_policy = config.policy  # what the operator asked for (/capacity)
        if config.policy.kind is PolicyKind.FLOOR and not hasattr(engine, "set_turn_admission"):
            # An engine that cannot hold a turn per step (a remote OpenAI-compatible
            # server schedules its own steps; the fake engine has none) keeps the floor
            # the previous way: workers admitted for life on a projection.
            config = dataclasses.replace(config, policy=Policy(PolicyKind.PROJECTION))
        self.engine = engine
        self.config = config
        self.model = model if model is not None else ThroughputModel()
        self._clock = clock
        self._queue: deque[_Waiter] = deque()
        self._shares = QueueShares(config.max_queue, config.queue_share)
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
        None under policy ``none`` (today's behaviour: a step prefills up to ``n_batch``).
        The budget follows the model: every snapshot the gate takes refreshes it."""
        if self.config.policy.kind is PolicyKind.NONE:
            return None
        if self.config.policy.kind is PolicyKind.FLOOR:
            return self.decode_gate()
        if self._budget is None:
            self._budget = FloorBudget(self.config.floor_tps, self._budget_state(None))
        return self._budget

    def decode_gate(self) -> DecodeGate | None:
        """The decode gate to hand the pool (``pool.set_turn_admission`` and, as its
        prefill budget, ``pool.set_prefill_budget``) under policy ``floor``; None under
        the others (their turns run as soon as they are asked for)."""
        if self.config.policy.kind is not PolicyKind.FLOOR:
            return None
        if self._decode_gate is None:
            state = self._budget_state(None, self.model.shape)
            self._decode_gate = DecodeGate(self.config.floor_tps, state)
        return self._decode_gate

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
        return len(self._queue)

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
        ahead = len(self._queue) if queue_ahead is None else queue_ahead
        inp, _ = self.gate_input(ahead)
        return decide(inp, self.config, self.model, self._clock())

    def check_queue(self, *, places: int = 1, caller: str = ANONYMOUS) -> QueueCheck:
        """Would ``caller``'s request of ``places`` places (a task's subtasks) be taken?
        Refused when they do not all fit the queue's free places, or ``caller``'s share."""
        why, retry_after_s = self._door(places, caller)
        return QueueCheck(ok=not why, queue_len=len(self._queue), retry_after_s=retry_after_s,
                          reason=why)

    def _door(self, places: int, caller: str) -> tuple[str, float]:
        """Why a request of ``places`` from ``caller`` is refused ("": it is taken) and
        when to retry. A pure read of the queue (the decision learns from the engine)."""
        need = places_needed(places, self.config.max_queue)
        d = self.decide_now(queue_ahead=len(self._queue) + need - 1)
        if d.verdict is Verdict.REFUSE:
            return "; ".join(d.reasons), d.retry_after_s
        over = self._shares.over_share(caller, places)
        if not over:
            return "", d.retry_after_s
        # Retry once the caller's over-th place from the head has been admitted.
        pos = [i for i, w in enumerate(self._queue) if w.caller == caller][over - 1] + 1
        ahead = min(pos, max(1, self.config.max_queue)) - 1
        return self._shares.refusal(caller, places), self.decide_now(ahead).retry_after_s

    def _enqueue(self, waiter: _Waiter) -> None:
        self._queue.append(waiter)
        self._shares.add(waiter.caller)

    def _dequeue(self, waiter: _Waiter) -> None:
        self._queue.remove(waiter)
        self._shares.remove(waiter.caller)

    def queued_by(self, caller: str) -> int:
        """Places ``caller`` holds in the queue now."""
        return self._shares.waiting(caller)

    # ------------------------------------------------------------------ admitting

    async def admit(
        self, key: str, on_position: OnPosition | None = None, *, accepted: bool = False,
        caller: str = ANONYMOUS,
    ) -> Ticket:
        """Wait until admitted (see :class:`~mesh.gate.types.Admission`); ``caller``'s
        place counts against its share of the queue."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        d = self.decide_now()
        if not accepted and d.verdict is not Verdict.ADMIT:
            why, retry_after_s = self._door(1, caller)
            if why:
                self.num_refused += 1
                raise QueueFull(why, retry_after_s)
        waiter = _Waiter(key, caller)
        if d.verdict is Verdict.ADMIT:
            waiter.ticket = self._grant(key)
        else:
            self._enqueue(waiter)
            await self._wait(waiter, on_position)
        ticket = waiter.ticket
        assert ticket is not None
        if on_position is not None:
            try:
                await on_position(0)
            except BaseException:
                self._release(ticket)
                raise
        return ticket

    async def _wait(self, waiter: _Waiter, on_position: OnPosition | None) -> None:
        last = -1
        try:
            while True:
                self._pump()
                if waiter.ticket is not None:
                    return
                pos = self._queue.index(waiter) + 1
                if on_position is not None and pos != last:
                    last = pos
                    await on_position(pos)
                    continue  # time passed: re-check before sleeping
                # No await between the state check above and this wait: no lost wake-up.
                waiter.wake = wake = anyio.Event()
                timeout = self.config.recheck_s if pos == 1 else math.inf
                with anyio.move_on_after(timeout):
                    await wake.wait()
        except BaseException:
            if waiter.ticket is not None:
                self._release(waiter.ticket)
            elif waiter in self._queue:
                self._dequeue(waiter)
                self._pump()
                self._wake_all()
            raise

    def _pump(self) -> None:
        """Admit from the head while the gate says yes."""
        moved = False
        while self._queue:
            d = self.decide_now(queue_ahead=0)
            if not d.admitted:
                break
            head = self._queue[0]
            self._dequeue(head)
            head.ticket = self._grant(head.key)
            head.wake.set()
            moved = True
        if moved:
            self._wake_all()

    def _wake_all(self) -> None:
        for w in self._queue:
            w.wake.set()

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
        self._pump()
        self._wake_all()

    # ------------------------------------------------------------------ reporting

    def capacity(self) -> dict[str, Any]:
        """The ``/capacity`` document (JSON-able; every number finite or null)."""
        inp, load = self.gate_input(len(self._queue))
        d = decide(inp, self.config, self.model, self._clock())
        proj = d.projection
        # Workers decoding now: an idle or waiting session's rate is from its last turn
        # (stale: a worker on a tool call is not slowed by anything).
        running = (SessionState.DECODING, SessionState.PREFILLING)
        measured = sorted(s.decode_tps for s in load.sessions
                          if s.decode_tps is not None and s.state in running)
        return {
            "engine": _engine_doc(self.engine),
            "floor_tps": self.config.floor_tps,
            "policy": str(self.requested_policy),
            "admits_by": str(self.config.policy),
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
                        "parked_bytes": load.parked_bytes},
            "in_flight": inp.num_pending,
            "tickets": len(self._tickets),
            "measured_tps": {
                "count": len(measured),
                "min": measured[0] if measured else None,
                "p50": statistics.median(measured) if measured else None,
            },
            "projected_tps_next": proj.tps_next,
            "projected_tps_now": proj.tps_now,
            "projected_tps_next_by_worker": {w.id: w.tps for w in proj.per_worker_next},
            "headroom": d.headroom,
            "queue_len": len(self._queue),
            "max_queue": self.config.max_queue,
            # each authenticated caller's share of the queue, and how many callers wait
            "max_queue_per_caller": self.config.queue_share,
            "queue_callers": self._shares.num_callers,
            "kv_cells": {
                "used": load.cells_used,
                "total": load.cells_total,
                "prefix": load.prefix_cells,
                "naive_equivalent": load.naive_cells,
                "reduction": load.reduction,
            },
            "retry_after_s": d.retry_after_s,
            "projected_idle_estimate": proj.idle_estimate,
            "model": {**self.model.describe(), "live_scale": proj.scale},
            "admitted_total": self.num_admitted,
            "refused_total": self.num_refused,
            # the pool's totals since start (0 where the engine does not count them)
            "pool_totals": {"sessions_attached": load.sessions_attached,
                            "prefill_tokens": load.prefill_tokens},
            "workers": _worker_rows(load),
            "turns": self._turns_doc(load),
        }

    def _turns_doc(self, load: PoolLoad) -> dict[str, Any]:
        """The decode gate's side of ``/capacity``: turns running and waiting, and the
        measured step its last answer was anchored to (null where no decode gate runs)."""
        last = self._decode_gate.last if self._decode_gate is not None else None
        recent = [s for s in load.recent_steps if s.num_decode > 0]
        return {
            "gated": self._decode_gate is not None,
            "waiting": load.count(SessionState.WAITING),
            "running": load.count(SessionState.DECODING) + load.count(SessionState.PREFILLING),
            "measured_step_s": statistics.median(s.step_s for s in recent[-8:]) if recent
            else None,
            "floor_step_s": 1.0 / self.config.floor_tps,
            "ratio": last.ratio if last is not None else None,
            "projected_step_now_s": last.projected_now_s if last is not None else None,
            "projected_step_next_s": last.projected_next_s if last is not None else None,
            "room": last.room if last is not None else None,
            # measured / projected - 1 for one more turn, scored over the last minute
            "projection_error": self._decode_gate.projection_error()
            if self._decode_gate is not None else None,
        }


def _engine_doc(engine: Engine) -> dict[str, Any]:
    """Which engine runs (``PoolInfo.engine``) and, for a remote backend, the metrics it
    last exposed (``engine.backend_metrics()``, when the engine has one)."""
    try:
        name = engine.info.engine
    except (AttributeError, RuntimeError):  # a stub, or a pool not started yet
        name = None
    metrics = getattr(engine, "backend_metrics", None)
    return {"name": name, "backend": metrics() if callable(metrics) else None}


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
        }
        for s in load.sessions
    ]
