"""The scheduler: the one owner of a pool's sessions, cell ledger, turns and snapshots.

It answers the engine thread's two questions, *what runs next* and *what changed*:
:meth:`Scheduler.schedule` ends cancelled turns, resumes parked sessions whose turn was
asked for and plans the step (:mod:`mesh.engine.batching` over the pure
:mod:`mesh.engine.planner`); after the runner decoded and sampled,
:meth:`Scheduler.stepped` (or :meth:`Scheduler.decode_failed`) republishes the load
snapshot when it is due. The pool's commands (attach, open a turn, park, release) go
through it too, each publishing a fresh snapshot.

Who owns what: the :class:`~mesh.engine.registry.SessionRegistry` holds the sessions dict
(the runner reads it through a read-only view), :class:`~mesh.engine.turns.Turns` holds
the outbox (the engine thread takes its items with :meth:`Scheduler.take_items`), the
ledger holds the cell promises. Engine thread only, except :meth:`check_attach`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from mesh.engine import batching
from mesh.engine.build import Built
from mesh.engine.ledger import CellLedger
from mesh.engine.planner import StepPlan
from mesh.engine.registry import SessionRegistry
from mesh.engine.session import SeqState, Turn
from mesh.engine.snapshots import Snapshots
from mesh.engine.stats import StepStats
from mesh.engine.turns import Outbox, Turns
from mesh.engine.types import (
    AttachCheck,
    EngineConfig,
    PrefillBudget,
    SamplingParams,
    TurnAdmission,
)

__all__ = ["Scheduler", "StepLimits"]


@dataclass
class StepLimits:
    """What the gate hands the pool, read by the engine thread once per step: the prefill
    cap beside decoding rows (None: the whole ``n_batch``) and the decode gate (None:
    every turn runs as soon as it is asked for). Set from any thread (one attribute
    write each)."""

    prefill_budget: PrefillBudget | None = None
    turn_admission: TurnAdmission | None = None


class Scheduler:
    """Sessions, ledger, turns, step planning and snapshots of one started pool."""

    def __init__(self, built: Built, config: EngineConfig, limits: StepLimits,
                 snapshots: Snapshots, stats: StepStats) -> None:
        self.ledger = CellLedger(
            n_ctx=built.info.n_ctx, shared=built.shared_cells,
            max_sessions=config.max_sessions,
            attach_need=1 if config.share_prefix else len(built.prefix) + 1,
            max_attached=config.attached_limit,
        )
        self.turns = Turns(built.model, self.ledger, config.seed)
        self.registry = SessionRegistry(built, self.ledger, self.turns, config)
        self._built = built
        self._config = config
        self._limits = limits
        self._snapshots = snapshots
        self._stats = stats
        self._park_checked = 0.0

    # -- commands (engine thread) ------------------------------------------------------

    def check_attach(self) -> AttachCheck:
        """Would an attach succeed now (any thread)."""
        return self.registry.check_attach()

    def attach(self) -> SeqState:
        st = self.registry.attach()
        self.publish()
        return st

    def open_turn(self, st: SeqState, params: SamplingParams,
                  loop: asyncio.AbstractEventLoop) -> Turn:
        turn = self.turns.open(st, params, loop)
        if self._limits.turn_admission is None:  # no decode gate: the turn runs at once
            turn.admitted_at = turn.started
        if st.parked:  # resumed before the turn's text; else it waits for room
            self.registry.resume_waiting()
            self.publish()
        return turn

    def park(self, st: SeqState) -> bool:
        done = self.registry.park(st)
        self.publish()
        return done

    def release(self, st: SeqState) -> None:
        self.registry.release(st, reason=None)
        self.publish()

    def reap(self, held: frozenset[str], now: float, grace_s: float) -> list[str]:
        """Release the sessions no caller holds (:meth:`SessionRegistry.reap`)."""
        reaped = self.registry.reap(held, now, grace_s)
        if reaped:
            self.publish()
        return reaped

    # -- the step ----------------------------------------------------------------------

    def has_work(self) -> bool:
        return (any(st.turn is not None for st in self.registry.resident().values())
                or self.registry.has_waiting())

    def park_idle(self) -> None:
        """With ``park_idle_s`` set: park sessions idle that long (checked at most once a
        second; the engine thread wakes at least every 0.25 s)."""
        idle_s = self._config.park_idle_s
        now = time.monotonic()
        if idle_s is None or now - self._park_checked < 1.0:
            return
        self._park_checked = now
        if self.registry.park_idle(now, idle_s):
            self.publish()

    def schedule(self) -> tuple[StepPlan, int] | None:
        """The next step's plan and the cells in use before it; None: nothing to decode
        (the snapshot is republished, cancellations may have changed states)."""
        reg, turns = self.registry, self.turns
        turns.finish_cancelled(reg.all_states())  # cancelled turns take no room
        if reg.has_waiting():  # parked sessions whose turn was asked for
            reg.resume_waiting()
        cells = reg.cells_used()
        sessions = reg.resident()
        plan = batching.plan(sessions.values(), self.ledger, n_batch=self._config.n_batch,
                             output_rows=self._built.ctx.n_outputs_max, cells_used=cells,
                             prefill_budget=self._limits.prefill_budget,
                             turn_admission=self._limits.turn_admission,
                             recent=self._stats.recent)
        if plan.started:
            turns.admit(sessions[seq] for seq in plan.started)
        if plan.paused:
            turns.pause(sessions[seq] for seq in plan.paused)
        if plan.empty:
            self.publish()
            if reg.has_waiting():  # a parked turn waits for room: do not spin
                time.sleep(0.005)
            return None
        return plan, cells

    def decode_failed(self, seqs: list[int], reason: str) -> None:
        """llama_decode refused the step: release its sessions with ``reason``."""
        sessions = self.registry.resident()
        for st in [sessions[seq] for seq in seqs]:
            self.registry.release(st, reason=reason)
        self.publish()

    def stepped(self, now: float) -> None:
        """A step ended at ``now``: publish if a turn started or ended, or the last
        snapshot is old (see :mod:`mesh.engine.snapshots`)."""
        if self._snapshots.due(self.turns.changes, now):
            self.publish()

    def release_turns(self, reason: str) -> None:
        """The engine thread's last resort: release every session in a turn."""
        self.registry.release_turns(reason)
        self.publish()

    def take_items(self) -> Outbox:
        """The items for consumers since the last take (see :meth:`Turns.take_items`)."""
        return self.turns.take_items()

    def publish(self) -> None:
        """Rebuild the load snapshot (every command that changes the pool does; a step
        does when a turn started or ended, else at most every SNAPSHOT_INTERVAL_S)."""
        self._snapshots.publish(self.registry, self._built, self.ledger, self._config,
                                self.turns.changes)
