"""What runs in the next step and what the pool reports: the pure step planner, the batch
it becomes, step timing and the published load snapshot, and the scheduler that owns the
sessions, ledger, turns and snapshots. Read top to bottom:

**The planner.** Which sessions decode and which queued text is prefilled in one step.
Pure: it reads plain numbers and returns a plan, so it is tested without llama.cpp. Rules:

* a turn runs once the decode gate has let it in: turns that wait are let in in
  completion order (lowest ``priority`` first — the agent's task start time, so turns of
  tasks already running go before a new task's first turn — then oldest ``asked``), at
  most ``turn_room`` of them this step (None: all); a waiting turn is neither decoded nor
  prefilled;
* a negative ``turn_room`` sheds: that many running turns are paused between steps (the
  last in completion order first; one always keeps running), keeping their cells and
  carry token, and wait again at their place in the order;
* completion order holds for running rows too: a waiting turn of an older task (lower
  ``priority``) that finds no room takes the row of the last running turn in that order,
  which is paused the same way (one swap a step; turns of one task never swap);
* every decoding session of a running turn gets its one row (``n_batch`` exceeds
  ``max_sessions``);
* queued text of sessions in a turn is prefilled oldest session first, under the token
  budget left; while sessions decode, a :class:`~mesh.engine.interface.PrefillBudget` caps the
  prefill tokens of the step (chunked prefill: the rest waits for later steps); with nothing
  decoding a step takes the full ``n_batch``;
* the chunk that empties a session's queue asks for logits (its first sample), if an output
  row is left; otherwise its last token waits for the next step.

**Batching.** From sessions to a plan, and from a plan to a ``llama_batch`` (engine thread).

**Step statistics and snapshots.** Step timing and the pool's published load snapshot. Every
command that changes the pool publishes; a step publishes when a turn started or ended or
a session was parked or resumed (:meth:`Scheduler.changes` moved) or when the last
snapshot is older than :data:`SNAPSHOT_INTERVAL_S`. Readers on any thread get the last
published :class:`Capture`, so ``load()`` never waits on the engine thread.

**The scheduler.** The one owner of a pool's sessions, cell ledger, turns and snapshots.
:meth:`Scheduler.schedule` ends cancelled turns, resumes parked sessions whose turn was
asked for and plans the step; after the runner decoded and sampled,
:meth:`Scheduler.stepped` (or :meth:`Scheduler.decode_failed`) republishes the snapshot when
it is due. The pool's commands (attach, open a turn, park, release) go through it too, each
publishing. The :class:`~mesh.engine.registry.SessionRegistry` holds the sessions dict (the
runner reads a read-only view), :class:`~mesh.engine.turns.Turns` the outbox
(:meth:`Scheduler.take_items`), the ledger the cell promises. Engine thread only, except
:meth:`check_attach`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from mesh.engine.build import Built
from mesh.engine.config import EngineConfig, SamplingParams
from mesh.engine.interface import (
    AttachCheck,
    PoolLoad,
    PrefillBudget,
    SessionLoad,
    StepSample,
    TurnAdmission,
)
from mesh.engine.registry import SessionRegistry
from mesh.engine.session import CellLedger, SeqState, Turn, duty_cycle
from mesh.engine.turns import Outbox, Turns

__all__ = [
    "SNAPSHOT_INTERVAL_S", "BatchWriter", "Candidate", "Capture", "Chunk", "Scheduler",
    "Snapshots", "StepBudget", "StepLimits", "StepPlan", "StepStats", "admit_turns", "candidates",
    "fill_batch", "order", "plan_sessions", "plan_step", "step_budget"
]


# -------------------- the planner ---------------------------------------------

class Candidate(NamedTuple):
    """One session as the planner sees it (a tuple: one is built per session per step)."""

    seq: int
    created: float  # attach time: older sessions' text is prefilled first
    decoding: bool  # in a turn, with a carry token and nothing queued
    ready: int  # queued tokens it may prefill now (0 unless in a turn)
    running: bool = True  # False: its turn waits for the decode gate
    asked: float = 0.0  # when its turn was asked for: waiting turns run oldest first
    priority: float = 0.0  # completion order: lower runs first and is paused last


@dataclass(frozen=True)
class StepBudget:
    """What one step may carry: ``tokens`` in the batch, ``output_rows`` logits rows and
    ``prefill_tokens`` of queued text (None: no cap beyond ``tokens``); at most
    ``turn_room`` waiting turns start running (None: every one)."""

    tokens: int
    output_rows: int
    prefill_tokens: int | None = None
    turn_room: int | None = None


@dataclass(frozen=True)
class Chunk:
    seq: int
    tokens: int
    logits: bool  # the chunk ends the session's queue: sample after it


@dataclass(frozen=True)
class StepPlan:
    decode: tuple[int, ...]  # sequence ids with one decode row each
    prefill: tuple[Chunk, ...]
    started: tuple[int, ...] = ()  # sequence ids whose waiting turn runs from this step
    paused: tuple[int, ...] = ()  # sequence ids whose running turn the gate paused (shed)

    @property
    def num_prefill(self) -> int:
        return sum(c.tokens for c in self.prefill)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


def step_budget(
    *, n_batch: int, output_rows: int, num_decode: int, cells_used: int,
    prefill_budget: PrefillBudget | None, turn_room: int | None = None,
) -> StepBudget:
    """The budget of the next step; ``prefill_budget`` is asked only while sessions decode."""
    cap = None
    if prefill_budget is not None and num_decode > 0:
        cap = max(0, int(prefill_budget(num_decode, cells_used)))
    return StepBudget(tokens=n_batch, output_rows=output_rows, prefill_tokens=cap,
                      turn_room=turn_room)


def order(c: Candidate) -> tuple[float, float]:
    """Completion order: the candidate's priority, then when its turn was asked for."""
    return c.priority, c.asked


def admit_turns(sessions: Sequence[Candidate], room: int | None) -> list[Candidate]:
    """The candidates that run this step: the running ones, plus up to ``room`` waiting
    turns in completion order (:func:`order`), marked running; with a negative ``room``,
    the running ones less ``-room`` of them, the last in that order (one always runs).
    When turns still wait after the room is used, the first of them takes the row of the
    last running turn if it belongs to an older task (strictly lower ``priority``): one
    such swap a step (see the module docstring), so a task's next turn, back from a tool
    call, does not queue behind a newer task's first turn that took its row."""
    if room is not None and room < 0:
        running = sorted((c for c in sessions if c.running), key=order)
        keep = {c.seq for c in running[:max(1, len(running) + room)]}
        return [c for c in sessions if c.seq in keep]
    waiting = [c for c in sessions if not c.running]
    if not waiting:
        return list(sessions)
    displaced = None
    if room is not None and room < len(waiting):
        waiting.sort(key=order)
        first_left = waiting[max(0, room)]
        waiting = waiting[:max(0, room)]
        running = [c for c in sessions if c.running]
        if running:
            last = max(running, key=order)
            if first_left.priority < last.priority:
                waiting.append(first_left)
                displaced = last.seq
    let_in = {c.seq for c in waiting}
    return [c._replace(running=True) if c.seq in let_in else c
            for c in sessions if (c.running and c.seq != displaced) or c.seq in let_in]


def plan_step(sessions: Sequence[Candidate], budget: StepBudget) -> StepPlan:
    """Plan one step over ``sessions`` within ``budget``; see the module docstring."""
    started = tuple(c.seq for c in sessions if not c.running)
    was_running = tuple(c.seq for c in sessions if c.running)
    sessions = admit_turns(sessions, budget.turn_room)
    running = {c.seq for c in sessions}
    started = tuple(seq for seq in started if seq in running)
    paused = tuple(seq for seq in was_running if seq not in running)
    decode = tuple(c.seq for c in sessions if c.decoding)
    tokens = budget.tokens - len(decode)
    rows = budget.output_rows - len(decode)
    if tokens < 0 or rows < 0:
        raise ValueError(f"{len(decode)} decoding sessions do not fit {budget}")
    prefill_left = tokens if budget.prefill_tokens is None else min(tokens,
                                                                    budget.prefill_tokens)
    chunks: list[Chunk] = []
    waiting = [c for c in sessions if not c.decoding and c.ready > 0]
    for c in sorted(waiting, key=lambda s: s.created) if len(waiting) > 1 else waiting:
        if prefill_left <= 0:
            break
        take = min(c.ready, prefill_left)
        ends = take == c.ready
        if ends and rows <= 0:
            take -= 1  # no logits row left: the last token waits for a later step
            ends = False
        if take <= 0:
            continue
        if ends:
            rows -= 1
        chunks.append(Chunk(seq=c.seq, tokens=take, logits=ends))
        prefill_left -= take
    return StepPlan(decode=decode, prefill=tuple(chunks), started=started, paused=paused)

# -------------------- batching ------------------------------------------------

logger = logging.getLogger(__name__)


class BatchWriter(Protocol):
    """Where a step's tokens go: :class:`mesh.engine.llama.Batch` (the Python step) or
    :class:`mesh.engine.native.NativeBatch` (the native step)."""

    def clear(self) -> None: ...

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int: ...

    def add_rows(self, tokens: list[int], pos: list[int], seqs: list[int]) -> int: ...


def candidates(sessions: Iterable[SeqState], ledger: CellLedger) -> list[Candidate]:
    """The planner's view of every session in a turn."""
    out = []
    for st, ready in ledger.pending_in_turns(sessions):
        turn = st.turn
        assert turn is not None
        out.append(Candidate(st.seq, st.created, st.carry is not None and not ready, ready,
                             turn.admitted_at is not None, turn.started, turn.priority))
    return out


def plan_sessions(sessions: Iterable[SeqState], ledger: CellLedger, *, n_batch: int,
                  output_rows: int, cells_used: int, prefill_budget: PrefillBudget | None,
                  turn_admission: TurnAdmission | None = None,
                  recent: Sequence[StepSample] = ()) -> StepPlan:
    """The next step's plan over the live sessions; the decode gate is asked while a turn
    waits or more than one runs (it may start waiting turns, or shed running ones), and one
    turn always runs."""
    cands = candidates(sessions, ledger)
    room = None
    num_running = sum(c.running for c in cands)
    if turn_admission is not None and (num_running < len(cands) or num_running > 1):
        try:
            room = int(turn_admission.turn_room(num_running, cells_used, recent))
        except Exception:  # a broken gate must not fail the turns: hold the rows as they are
            logger.exception("the decode gate failed; this step keeps the running turns")
            room = 0
        room = max(room, 1 - num_running)  # never shed the last one; with none, start one
    num_decode = sum(c.decoding for c in admit_turns(cands, room))
    budget = step_budget(n_batch=n_batch, output_rows=output_rows, num_decode=num_decode,
                         cells_used=cells_used, prefill_budget=prefill_budget, turn_room=room)
    return plan_step(cands, budget)


def fill_batch(plan: StepPlan, sessions: Mapping[int, SeqState], ledger: CellLedger,
               batch: BatchWriter) -> tuple[list[tuple[SeqState, int]], dict[int, int], int]:
    """Write the plan into ``batch`` (decode rows first, in one call, then prefill chunks,
    taking the queued tokens from the ledger). Returns the sessions to sample with their
    logits row, the tokens each sequence gets in this step, and the decode rows' summed
    context (positions + 1)."""
    batch.clear()
    states = [sessions[seq] for seq in plan.decode]
    carries = [st.carry for st in states]
    if None in carries:
        raise AssertionError("a decoding session has no carry token")
    pos = [st.prefix_len + st.private for st in states]
    first = batch.add_rows(carries, pos, list(plan.decode))  # type: ignore[arg-type]
    rows = [(st, first + i) for i, st in enumerate(states)]
    # Every token written for a sequence is recorded in its suffix (a parked session
    # re-prefills it on resume); a failed decode releases the session, so after a step
    # ``len(suffix) == private`` holds.
    for st, tok in zip(states, carries, strict=True):
        st.suffix.append(tok)  # type: ignore[arg-type]
    counts = dict.fromkeys(plan.decode, 1)
    for chunk in plan.prefill:
        st = sessions[chunk.seq]
        toks = ledger.take(st, chunk.tokens)
        st.suffix.extend(toks)
        for i, tok in enumerate(toks):
            is_out = chunk.logits and i == len(toks) - 1
            idx = batch.add(tok, st.pos + i, st.seq, is_out)
            if is_out:
                rows.append((st, idx))
        counts[chunk.seq] = len(toks)
    return rows, counts, sum(pos) + len(pos)

# -------------------- step statistics -----------------------------------------

_RATE_WINDOW_S = 5.0


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

    def snapshot(self, states: Iterable[SeqState], *, prefix_len: int,
                 **facts: Any) -> Capture:
        """Capture the pool between steps (engine thread): plain tuples, cheap; the
        :class:`PoolLoad` is built from them when someone reads it. ``facts``: the
        :class:`PoolLoad` fields the pool knows (cells, sequence ids, totals, parking)."""
        now = time.monotonic()
        states = tuple(states)
        # Each held turn's place in the line: completion order, as the planner lets them in.
        held = sorted((st for st in states if st.turn is not None and st.turn.admitted_at is None),
                      key=lambda st: (st.turn.priority, st.turn.started))  # type: ignore[union-attr]
        place = {st.seq: i + 1 for i, st in enumerate(held)}
        rows = tuple((st.id, st.state, st.private, st.pos, st.step_ewma_s, st.created,
                      st.busy_s, st._busy_since, st.num_generated, st.parked,
                      st.context_len, place.get(st.seq)) for st in states)
        facts.update(taken_at=now, step_ms=self.step_ms, agg_tps=self.agg_tps(now),
                     recent_steps=tuple(self.recent), prefill_tokens=self.prefill_tokens)
        return Capture(functools.partial(_build, rows, prefix_len, facts),
                       places={st.id: i + 1 for i, st in enumerate(held)})


class Capture:
    """The pool's state at one moment; :meth:`load` builds (once) the :class:`PoolLoad`."""

    def __init__(self, build: Callable[[], PoolLoad], places: dict[str, int]) -> None:
        self._build = build
        self._load: PoolLoad | None = None
        # Each held turn's place by session id (never changed once captured): what
        # turn_place reads without building the snapshot.
        self.places = places

    def load(self) -> PoolLoad:
        """The snapshot (any thread; built on first use, then shared)."""
        if self._load is None:
            self._load = self._build()
        return self._load


def _build(rows: tuple[tuple[Any, ...], ...], prefix_len: int,
           facts: dict[str, Any]) -> PoolLoad:
    now = facts["taken_at"]
    sessions = tuple(
        SessionLoad(id=sid, state=state, private_cells=private,
                    context_len=ctx_len if parked else pos,
                    decode_tps=(1.0 / ewma if ewma else None),
                    duty_cycle=duty_cycle(now, created, busy_s, busy_since),
                    age_s=now - created, num_generated=generated, parked=parked,
                    turn_place=turn_place)
        for (sid, state, private, pos, ewma, created, busy_s, busy_since, generated, parked,
             ctx_len, turn_place) in rows
    )
    private_sum = sum(s.private_cells for s in sessions)
    prefix_cells = facts["prefix_cells"]
    return PoolLoad(
        sessions=sessions, cells_used=prefix_cells + private_sum,
        naive_cells=(private_sum + prefix_len * len(sessions) if prefix_cells
                     else private_sum),
        **facts,
    )

# -------------------- snapshots -----------------------------------------------

# Between turn starts and ends, the load snapshot is rebuilt at most this often (building
# it touches every session; a step at N = 255 can take a few milliseconds).
SNAPSHOT_INTERVAL_S = 0.05


class Snapshots:
    """Builds (engine thread) and serves (any thread) the pool's load snapshot."""

    def __init__(self, stats: StepStats) -> None:
        self._stats = stats
        self._capture: Capture | None = None
        self._at = 0.0
        self._changes = -1

    def publish(self, registry: SessionRegistry, built: Built, ledger: CellLedger,
                config: EngineConfig, changes: int | None) -> None:
        """Rebuild the snapshot of every attached session (resident and parked);
        ``changes`` is the scheduler's counter it reflects."""
        self._at = time.monotonic()
        if changes is not None:
            self._changes = changes
        self._capture = self._stats.snapshot(
            registry.all_states(), prefix_len=len(built.prefix),
            prefix_cells=built.shared_cells, cells_total=built.info.n_ctx,
            free_seq_ids=ledger.free_seq_ids, max_sessions=config.max_sessions,
            session_budget=config.session_budget, sessions_attached=registry.attached,
            sessions_reaped=registry.reaped, max_attached=ledger.max_attached,
            parked_tokens=registry.parked_tokens(), parks=registry.parks,
            resumes=registry.resumes, resume_tokens=registry.resume_tokens,
            parked_bytes=registry.parked_bytes, swaps=registry.swaps,
            park_memory=config.park_memory, compactions=registry.compactions,
            compacted_cells=registry.compacted_cells, cell_bytes=built.info.cell_bytes)

    def due(self, changes: int, now: float) -> bool:
        """Whether a step that ends at ``now`` publishes (see the module docstring)."""
        return changes != self._changes or now - self._at >= SNAPSHOT_INTERVAL_S

    def load(self) -> PoolLoad:
        if self._capture is None:
            raise RuntimeError("the pool is not started")
        return self._capture.load()

    def turn_place(self, session_id: str) -> int | None:
        """The held turn's place of ``session_id`` in the last published snapshot (any
        thread; a dict read, no snapshot built)."""
        capture = self._capture
        return None if capture is None else capture.places.get(session_id)

# -------------------- the scheduler -------------------------------------------

@dataclass
class StepLimits:
    """What the gate hands the pool (see :class:`~mesh.engine.interface.Engine`), set from
    any thread (one attribute write each), read by the engine thread once per step."""

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
        self._warned = False  # the pool-full warning is logged once

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
        self.registry.settle(st)  # text queued while the pool was short: take its cells
        turn = self.turns.open(st, params, loop)
        if self._limits.turn_admission is None:  # no decode gate: the turn runs at once
            turn.admitted_at = turn.started
        if st.parked:  # resumed before the turn's text; else it waits for room
            self.registry.resume_waiting()
            self.publish()
        return turn

    def park(self, st: SeqState, rewrite: list[int] | None = None) -> bool:
        done = (self.registry.park(st) if rewrite is None
                else self.registry.compact(st, rewrite))
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
        sessions = reg.resident()
        self._room_to_grow(sessions.values())
        cells = reg.cells_used()
        plan = plan_sessions(sessions.values(), self.ledger, n_batch=self._config.n_batch,
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

    def _room_to_grow(self, states: Iterable[SeqState]) -> None:
        """Every session in a turn may take one cell this step (its sampled token): when
        the pool has fewer free, park LRU idle sessions for them. A turn that still finds
        none ends with ``context_full`` (its session lives; the caller may compact it)."""
        in_turns = [st for st in states if st.turn is not None]
        for st in in_turns:
            if st.owed:  # text appended while its turn was being opened
                self.registry.settle(st)
        short = self.ledger.free_cells() < len(in_turns)
        if short and not self.registry.make_room(len(in_turns), seq=False) and not self._warned:
            self._warned = True
            logger.warning("the KV pool (%d cells) is full: turns end with context_full "
                           "until sessions go idle; raise --kv-cells", self.ledger.n_ctx)

    def decode_failed(self, seqs: list[int], reason: str) -> None:
        """llama_decode refused the step: release its sessions with ``reason``."""
        sessions = self.registry.resident()
        for st in [sessions[seq] for seq in seqs]:
            self.registry.release(st, reason=reason)
        self.publish()

    def stepped(self, now: float) -> None:
        """A step ended at ``now``: publish if it is due (:meth:`Snapshots.due`)."""
        if self._snapshots.due(self.changes(), now):
            self.publish()

    def release_turns(self, reason: str) -> None:
        """The engine thread's last resort: release every session in a turn."""
        self.registry.release_turns(reason)
        self.publish()

    def take_items(self) -> Outbox:
        """The items for consumers since the last take (see :meth:`Turns.take_items`)."""
        return self.turns.take_items()

    def publish(self) -> None:
        """Rebuild the load snapshot (see the module docstring for when)."""
        self._snapshots.publish(self.registry, self._built, self.ledger, self._config,
                                self.changes())

    def changes(self) -> int:
        """Moves whenever a turn opens or ends or a session parks or resumes (each
        counter only grows): a step that moved it publishes a fresh snapshot."""
        return self.turns.changes + self.registry.parks + self.registry.resumes
