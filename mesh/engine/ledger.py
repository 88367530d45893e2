"""The cell ledger: every KV cell promise and every free sequence id, behind one lock.

Callers (``append`` on any thread) and the engine thread both go through it, so a budget is
checked and committed in one critical section, and a step can never need a cell that was
not promised: llama.cpp never sees a batch it has no room for. It touches no llama.cpp.

``SeqState.reserved`` counts the cells a session holds or is promised (decoded suffix cells,
queued tokens, the sampled-but-undecoded carry); ``SeqState.pending`` is its queue. The
ledger is the only writer of both.

Parking (:mod:`mesh.engine.parking`) goes through it too: :meth:`CellLedger.park` gives a
session's decoded cells and its sequence id back (its queued text stays promised), and
:meth:`CellLedger.unpark` takes an id and promises the cells its saved suffix re-prefills.
Attached sessions (resident or parked) are bounded by ``max_attached``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from mesh.engine.session import SeqState
from mesh.engine.types import AttachCheck, ContextOverflow, PoolFull, SessionFailed

__all__ = ["CellLedger"]


class CellLedger:
    """Reservations and free sequence ids of one pool (``n_ctx`` cells, ``shared`` held by
    the prefix sequence, sequence ids ``1..max_sessions`` for sessions)."""

    def __init__(self, *, n_ctx: int, shared: int, max_sessions: int, attach_need: int,
                 max_attached: int | None = None) -> None:
        self._lock = threading.Lock()
        self.n_ctx = n_ctx
        self.shared = shared
        self.max_sessions = max_sessions
        # Sessions attached at once, resident or parked (None: max_sessions, no parking).
        self.max_attached = max_sessions if max_attached is None else max_attached
        self.num_attached = 0
        self._attach_need = attach_need  # cells a new session needs at once
        self._free_seqs = list(range(max_sessions, 0, -1))  # pop() hands out 1 first
        self._reserved = 0

    # -- reads -------------------------------------------------------------------------

    def free_cells(self) -> int:
        with self._lock:
            return self._free_locked()

    def _free_locked(self) -> int:
        return self.n_ctx - self.shared - self._reserved

    @property
    def free_seq_ids(self) -> int:
        with self._lock:
            return len(self._free_seqs)

    @property
    def attach_need(self) -> int:
        return self._attach_need

    def check_attach(self, parkable: int = 0, parkable_cells: int = 0) -> AttachCheck:
        """Would an attach succeed now? ``parkable`` idle resident sessions holding
        ``parkable_cells`` private cells could be parked to make room."""
        with self._lock:
            return self._check_locked(parkable, parkable_cells)

    def _check_locked(self, parkable: int = 0, parkable_cells: int = 0) -> AttachCheck:
        if self.num_attached >= self.max_attached:
            if self.max_attached == self.max_sessions:
                return AttachCheck(False, f"all {self.max_sessions} session slots are in "
                                   "use; detach a session or raise --max-sessions")
            return AttachCheck(False, f"{self.num_attached} sessions are attached, "
                               f"max_attached is {self.max_attached}; detach a session or "
                               "raise --max-attached")
        if not self._free_seqs and parkable <= 0:
            return AttachCheck(False, f"all {self.max_sessions} session slots are in a turn "
                               "(none idle to park); wait for a turn to end or raise "
                               "--max-sessions")
        if self._free_locked() + parkable_cells < self._attach_need:
            return AttachCheck(False, f"the KV buffer ({self.n_ctx} cells) is full")
        return AttachCheck(True)

    # -- commits -----------------------------------------------------------------------

    def take_seq(self) -> int:
        """Check, then hand out a free sequence id to a new session (counted attached);
        raises PoolFull with the reason."""
        with self._lock:
            check = self._check_locked()
            if not check.ok:
                raise PoolFull(check.reason)
            if not self._free_seqs:
                raise PoolFull(f"all {self.max_sessions} session slots are in use; "
                               "detach a session or raise --max-sessions")
            self.num_attached += 1
            return self._free_seqs.pop()

    def requeue_private(self, st: SeqState, saved: list[int]) -> None:
        """A swap-in failed after ``unpark(swapped=True)``: its cells are queued to
        re-prefill instead (still promised)."""
        with self._lock:
            st.private = 0
            st.pending.extendleft(reversed(saved))

    def park(self, st: SeqState) -> None:
        """The session's decoded cells left the cache: give them, the promises of its
        queued text (promised again on resume) and its sequence id back. Engine thread;
        the session holds no carry. A parked session's ``reserved`` counts its queued
        text alone (its budget adds the suffix), none of it in the pool's promises."""
        with self._lock:
            if st.carry is not None:
                raise AssertionError(f"session {st.id} is parked with a carry token")
            self._reserved -= st.reserved
            st.reserved -= st.private
            st.private = 0
            self._free_seqs.append(st.seq)
            st.seq = -1
            st.parked = True

    def unpark(self, st: SeqState, saved: list[int], *, swapped: bool = False) -> int | None:
        """Take a free sequence id and promise cells for ``saved`` and the queued text:
        ``saved`` queued in front of it to re-prefill, or (``swapped``) held at once as its
        private cells, written back from host RAM. None: no id or no cells free."""
        with self._lock:
            if st.detached:
                raise SessionFailed(st.failed or f"session {st.id} is detached")
            need = len(saved) + len(st.pending)
            if not self._free_seqs or self._free_locked() < need:
                return None
            if swapped:
                st.private = len(saved)
            else:
                st.pending.extendleft(reversed(saved))
            st.reserved += len(saved)
            self._reserved += need
            st.seq = self._free_seqs.pop()
            st.parked = False
            return st.seq

    def queue(self, st: SeqState, tokens: list[int]) -> None:
        """Promise cells for ``tokens`` and queue them; raises ContextOverflow if they do
        not fit the session's budget or the buffer."""
        n = len(tokens)
        with self._lock:
            if st.detached:  # checked under the lock: a release cannot slip in between
                raise SessionFailed(st.failed or f"session {st.id} is detached")
            held = st.reserved + (len(st.suffix) if st.parked else 0)  # parked: re-prefilled
            if held + n > st.budget:
                raise ContextOverflow(
                    f"session {st.id} holds {held} of its {st.budget} suffix tokens; "
                    f"appending {n} more would overflow it (raise --session-budget or start "
                    "a new session)"
                )
            if st.parked:  # promised when it resumes, with its suffix (see unpark)
                st.pending.extend(tokens)
                st.reserved += n
                return
            free = self._free_locked()
            if n > free:
                raise ContextOverflow(
                    f"the KV buffer has {free} free cells; appending {n} tokens does not fit"
                )
            st.pending.extend(tokens)
            st.reserved += n
            self._reserved += n

    def pending(self, st: SeqState) -> int:
        with self._lock:
            return len(st.pending)

    def pending_in_turns(self, states: Iterable[SeqState]) -> list[tuple[SeqState, int]]:
        """(session, queued tokens) of every session in a turn, under one lock."""
        with self._lock:
            return [(st, len(st.pending)) for st in states if st.turn is not None]

    def take(self, st: SeqState, n: int) -> list[int]:
        """Pop up to ``n`` queued tokens (oldest first) for the step being built."""
        with self._lock:
            return [st.pending.popleft() for _ in range(min(n, len(st.pending)))]

    def carry(self, st: SeqState, token: int) -> bool:
        """Promise one cell for a sampled token (the next decode row); False: no room."""
        with self._lock:
            if st.reserved + 1 > st.budget or self._free_locked() < 1:
                return False
            st.carry = token
            st.reserved += 1
            self._reserved += 1
            return True

    def requeue_carry(self, st: SeqState) -> None:
        """An undecoded carry goes back to the front of the queue (still promised)."""
        with self._lock:
            if st.carry is not None:
                st.pending.appendleft(st.carry)
                st.carry = None

    def release(self, st: SeqState, reason: str | None = None) -> None:
        """Drop every promise of the session, free its sequence id and mark it detached
        (under the lock, where ``queue`` checks it)."""
        with self._lock:
            st.failed = reason
            st.detached = True
            if not st.parked:  # a parked session's promises went back when it was parked
                self._reserved -= st.reserved
            st.reserved = 0
            st.pending.clear()
            st.carry = None
            st.private = 0
            self.num_attached -= 1
            if not st.parked:  # a parked session's id went back when it was parked
                self._free_seqs.append(st.seq)
