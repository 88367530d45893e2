"""The pool's attached sessions: attach, park, resume and release on the engine thread.

Attach takes a free sequence id from the ledger and shares the prefix with it
(``llama_memory_seq_cp`` of sequence 0: metadata only), or, in the naive baseline, queues a
private copy of the prefix. Release drops the session's private cells (sequence 0 keeps the
prefix), fails its turn in flight and gives its promises and sequence id back to the
ledger. The registry alone adds and removes sessions; the step runner reads them through
:meth:`SessionRegistry.resident`, a read-only view.

Parking (recompute): an IDLE resident session's private cells leave the cache, its
sequence id and cells go back to the ledger, and it moves from ``sessions`` (by sequence
id) to ``parked`` (by session id), keeping its ``suffix`` tokens and its handle. Before its
next turn runs it is resumed: a free id (an LRU idle session is parked for one if needed),
the prefix shared again, and its suffix queued in front of any new text, so the ordinary
chunked prefill re-decodes it at positions ``prefix_len..``. A session is in exactly one
of the two dicts until released.

Swap (``park_memory`` > 0): parking copies the suffix cells' llama.cpp state to host RAM
first (:meth:`SessionRegistry._swap_out`) and a resume writes it back as the new id's
private cells: no re-prefill, and the same K/V bits. Past ``park_memory`` (or if a
write-back fails) a session is recomputed instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType

from mesh.engine.build import PREFIX_SEQ, Built
from mesh.engine.config import EngineConfig
from mesh.engine.interface import AttachCheck, ContextOverflow, PoolFull, SessionFailed
from mesh.engine.session import CellLedger, SeqState
from mesh.engine.turns import Turns

__all__ = ["SessionRegistry"]


class SessionRegistry:
    """Resident sessions by sequence id and parked sessions by session id (``parked``);
    engine thread only, except :meth:`check_attach`."""

    def __init__(self, built: Built, ledger: CellLedger, turns: Turns,
                 config: EngineConfig) -> None:
        self._built = built
        self._ledger = ledger
        self._turns = turns
        self._config = config
        self._sessions: dict[int, SeqState] = {}  # written here only (see resident())
        self._view = MappingProxyType(self._sessions)
        self.parked: dict[str, SeqState] = {}
        self._next_id = 0
        self.parks = 0  # totals since start, for the load snapshot
        self.compactions = 0  # suffixes replaced by a summary (compact), and the cells
        self.compacted_cells = 0  # of suffix they freed
        self.resumes = 0
        self.resume_tokens = 0
        self.swaps = 0
        self.reaped = 0  # released by reap(): no handle held them
        self.parked_bytes = 0  # host RAM held by swapped suffixes (<= park_memory)

    @property
    def attached(self) -> int:
        """Sessions attached since start (the ids handed out)."""
        return self._next_id

    def resident(self) -> Mapping[int, SeqState]:
        """The resident sessions by sequence id: a live, read-only view."""
        return self._view

    def check_attach(self) -> AttachCheck:
        """Would an attach succeed now (any thread: reads a copy of the sessions)."""
        return self._ledger.check_attach(*self._parkable())

    def all_states(self) -> Iterator[SeqState]:
        """Every attached session, resident then parked."""
        yield from self._sessions.values()
        yield from self.parked.values()

    def attach(self) -> SeqState:
        """A new session on a free sequence id (an idle one is parked for it if none is
        free); raises PoolFull with the reason."""
        check = self.check_attach()
        if not check.ok:
            raise PoolFull(check.reason)
        self.make_room(self._ledger.attach_need)
        seq = self._ledger.take_seq()
        self._next_id += 1
        sid, cfg, prefix = f"s{self._next_id}", self._config, self._built.prefix
        if cfg.share_prefix:
            self._built.ctx.seq_copy(PREFIX_SEQ, seq)  # metadata only: shares the cells
            st = SeqState(id=sid, seq=seq, prefix_len=len(prefix), budget=cfg.session_budget)
        else:  # naive baseline: the session prefills a private copy of the prefix
            st = SeqState(id=sid, seq=seq, prefix_len=0,
                          budget=cfg.session_budget + len(prefix))
        self._sessions[seq] = st
        if not cfg.share_prefix:
            try:
                self._ledger.queue(st, list(prefix))
            except ContextOverflow as exc:
                self.release(st, reason=str(exc))
                raise PoolFull(str(exc)) from exc
        return st

    # -- parking -----------------------------------------------------------------------

    def _idle(self, keep: SeqState | None = None) -> list[SeqState]:
        """Resident sessions not in a turn (but ``keep``), least recently busy first (park
        order)."""
        return sorted((st for st in self._sessions.values()
                       if st.turn is None and st is not keep),
                      key=lambda st: st.idle_since)

    def _held(self, newer_than: float) -> list[SeqState]:
        """Resident sessions whose turn the decode gate holds (asked for, not running) and
        belongs to a newer task than ``newer_than`` (a higher ``priority``), newest first:
        what a parked older task's turn may park to come back (completion order)."""
        return sorted((st for st in self._sessions.values()
                       if st.turn is not None and st.turn.admitted_at is None
                       and st.turn.priority > newer_than),
                      key=lambda st: (st.turn.priority, st.turn.started) if st.turn else (0, 0),
                      reverse=True)

    def _parkable(self) -> tuple[int, int]:
        # Any thread: tuple() copies the dict's values under the GIL; the idle sessions in
        # it could be parked to make room (the attach itself checks again).
        idle = [st for st in tuple(self._sessions.values()) if st.turn is None]
        return len(idle), sum(st.reserved - st.owed for st in idle)

    def park(self, st: SeqState) -> bool:
        """Park an idle resident session, or one whose turn the decode gate holds (False:
        it is running a turn, parked or detached). A held turn keeps waiting: its undecoded
        carry (a paused turn's) goes back in front of its queued text, re-prefilled on
        resume with the rest."""
        if st.detached or st.parked or (st.turn is not None and st.turn.admitted_at is not None):
            return False
        self._ledger.requeue_carry(st)  # an idle session holds none; a paused turn may
        if len(st.suffix) != st.private:
            raise AssertionError(f"session {st.id} recorded {len(st.suffix)} suffix tokens "
                                 f"for {st.private} private cells")
        st.swapped = self._swap_out(st)
        if st.swapped is not None:
            self.parked_bytes += len(st.swapped)
            self.swaps += 1
        self._built.ctx.seq_remove(st.seq)  # shared prefix cells stay: sequence 0 holds them
        del self._sessions[st.seq]
        self._ledger.park(st)
        self.parked[st.id] = st
        self.parks += 1
        return True

    def compact(self, st: SeqState, tokens: list[int]) -> bool:
        """Replace an idle session's suffix with ``tokens`` (a summary of it): its suffix
        cells leave the cache and are freed, the shared prefix's stay untouched, and
        ``tokens`` are prefilled before its next turn (the session is left parked; the
        recompute path of :meth:`resume` brings it back). False: it is in a turn or
        detached. Raises ContextOverflow if ``tokens`` and its queued text exceed its
        budget (the session is then parked with its old suffix, as before)."""
        if st.detached or st.turn is not None:
            return False
        if not st.parked and not self.park(st):
            return False
        if st.swapped is not None:  # the old suffix's bytes: no longer wanted
            self.parked_bytes -= len(st.swapped)
            st.swapped = None
        old = len(st.suffix)
        saved, st.suffix = st.suffix, []
        try:
            self._ledger.rewrite_parked(st, tokens)
        except Exception:
            st.suffix = saved
            raise
        self.compactions += 1
        self.compacted_cells += old
        return True

    def _swap_out(self, st: SeqState) -> bytes | None:
        """The session's suffix cells as llama.cpp state, if ``park_memory`` has room.

        llama.cpp's per-sequence state holds every cell of the sequence, the shared
        prefix's included, and a restore writes them all as new private cells; so the
        session first leaves the prefix cells (sequence 0 keeps them) and the state holds
        the suffix alone. None: recompute instead."""
        room = self._config.park_memory - self.parked_bytes
        if room <= 0 or st.private == 0:
            return None
        ctx = self._built.ctx
        if self._config.share_prefix and st.prefix_len:
            ctx.seq_remove(st.seq, 0, st.prefix_len)
        if ctx.seq_state_size(st.seq) > room:
            return None
        return ctx.seq_get_data(st.seq) or None

    def make_room(self, cells: int, *, seq: bool = True,
                  keep: SeqState | None = None, before: float | None = None) -> bool:
        """Park LRU idle sessions (never ``keep``) until ``cells`` cells and (``seq``) a
        sequence id are free — and, for a turn of priority ``before``, then sessions whose
        held turns belong to newer tasks (:meth:`_held`); parks nothing and returns False
        if even all of them would not make the room."""
        ledger = self._ledger

        def room() -> bool:
            return (not seq or ledger.free_seq_ids > 0) and ledger.free_cells() >= cells

        if room():
            return True
        idle = self._idle(keep)  # parking one frees its cells and its queued text's promises
        if before is not None:
            idle += [st for st in self._held(before) if st is not keep]
        if not idle or ledger.free_cells() + sum(st.reserved - st.owed for st in idle) < cells:
            return False
        for st in idle:
            self.park(st)
            if room():
                return True
        return False

    def settle(self, st: SeqState) -> None:
        """Before a resident session's turn opens: take its owed cells (text queued while
        the pool was short) from the pool, parking LRU idle sessions for them; if even
        that leaves too few, park the session itself: its turn waits, as any parked
        session's does, until :meth:`resume` finds the room (turns end, their sessions
        go idle and can be parked)."""
        if st.parked or not st.owed or self._ledger.settle(st):
            return
        if self.make_room(st.owed, seq=False, keep=st) and self._ledger.settle(st):
            return
        self.park(st)

    def resume(self, st: SeqState) -> bool:
        """Bring a parked session back (False: no room yet; its turn keeps waiting)."""
        if not st.parked:
            return True
        saved, data, ctx = st.suffix, st.swapped, self._built.ctx
        if not self.make_room(len(saved) + len(st.pending),
                              before=st.turn.priority if st.turn is not None else None):
            return False
        seq = self._ledger.unpark(st, saved, swapped=data is not None)
        if seq is None:
            return False
        if data is not None:
            st.swapped = None
            self.parked_bytes -= len(data)
            if not ctx.seq_set_data(seq, data):  # its cells are promised: recompute them
                self._ledger.requeue_private(st, saved)
                data = None
        if data is None:
            st.suffix = []  # fill_batch records the tokens again as they are re-prefilled
            self.resume_tokens += len(saved)
        if self._config.share_prefix:  # after set_data, which drops what the id held
            ctx.seq_copy(PREFIX_SEQ, seq)
        del self.parked[st.id]
        self._sessions[seq] = st
        self.resumes += 1
        return True

    def resume_waiting(self) -> bool:
        """Resume parked sessions whose turn was asked for, in completion order (the oldest
        task's first, then the oldest turn), until one finds no room; True if any was
        resumed. A resume may park a newer task's held turn (:meth:`make_room`)."""
        waiting = sorted((st for st in self.parked.values() if st.turn is not None),
                         key=lambda st: (st.turn.priority, st.turn.started) if st.turn
                         else (0.0, 0.0))
        done = False
        for st in waiting:
            if not self.resume(st):
                break
            done = True
        return done

    def has_waiting(self) -> bool:
        return any(st.turn is not None for st in self.parked.values())

    def park_idle(self, now: float, idle_s: float) -> int:
        """Park every resident session idle for ``idle_s`` or more; how many."""
        old = [st for st in self._sessions.values()
               if st.turn is None and now - st.idle_since >= idle_s]
        return sum(self.park(st) for st in old)

    def parked_tokens(self) -> int:
        return sum(len(st.suffix) for st in self.parked.values())

    # -- release -----------------------------------------------------------------------

    def release(self, st: SeqState, reason: str | None) -> None:
        """Drop the session's private cells and its sequence id (idempotent)."""
        if st.detached:
            return
        if st.parked:  # nothing in the cache; its id went back when it was parked
            self.parked.pop(st.id, None)
            if st.swapped is not None:
                self.parked_bytes -= len(st.swapped)
                st.swapped = None
        else:
            self._built.ctx.seq_remove(st.seq)  # shared prefix cells stay: seq 0 holds them
            self._sessions.pop(st.seq, None)
        self._turns.fail(st, reason or f"session {st.id} was detached")
        self._ledger.release(st, reason)

    def reap(self, held: frozenset[str], now: float, grace_s: float) -> list[str]:
        """Release every session attached at least ``grace_s`` ago whose id is not in
        ``held`` (the ids some caller still has a handle on): nobody can detach, prefill
        or read them any more. The ids released, for the log."""
        orphans = [st for st in list(self.all_states())
                   if st.id not in held and now - st.created >= grace_s]
        for st in orphans:
            self.release(st, reason=f"session {st.id} was reaped: no caller holds it")
        self.reaped += len(orphans)
        return [st.id for st in orphans]

    def release_turns(self, reason: str) -> None:
        """Release every session with a turn in flight (the engine thread's last resort)."""
        for st in list(self.all_states()):
            if st.turn is not None:
                self.release(st, reason)

    def fail_all(self, reason: str) -> None:
        """After the engine thread stopped: fail every turn in flight, detach everyone."""
        for st in list(self.all_states()):
            if st.turn is not None:
                st.turn.post(SessionFailed(reason))  # the thread has stopped
                st.turn.sampler.close()
            st.detached, st.failed = True, reason
        self._sessions.clear()
        self.parked.clear()

    def cells_used(self) -> int:
        """Cells in use: the shared prefix's and every session's private suffix."""
        return self._built.shared_cells + sum(st.private for st in self._sessions.values())
