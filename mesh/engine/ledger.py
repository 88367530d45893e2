"""The cell ledger: every KV cell promise and every free sequence id, behind one lock.

Callers (``append`` on any thread) and the engine thread both go through it, so a budget is
checked and committed in one critical section, and a step can never need a cell that was
not promised: llama.cpp never sees a batch it has no room for. It touches no llama.cpp.

``SeqState.reserved`` counts the cells a session holds or is promised (decoded suffix cells,
queued tokens, the sampled-but-undecoded carry); ``SeqState.pending`` is its queue. The
ledger is the only writer of both.
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

    def __init__(self, *, n_ctx: int, shared: int, max_sessions: int, attach_need: int) -> None:
        self._lock = threading.Lock()
        self.n_ctx = n_ctx
        self.shared = shared
        self.max_sessions = max_sessions
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

    def check_attach(self) -> AttachCheck:
        with self._lock:
            return self._check_locked()

    def _check_locked(self) -> AttachCheck:
        if not self._free_seqs:
            return AttachCheck(False, f"all {self.max_sessions} session slots are in use; "
                               "detach a session or raise --max-sessions")
        if self._free_locked() < self._attach_need:
            return AttachCheck(False, f"the KV buffer ({self.n_ctx} cells) is full")
        return AttachCheck(True)

    # -- commits -----------------------------------------------------------------------

    def take_seq(self) -> int:
        """Check, then hand out a free sequence id; raises PoolFull with the reason."""
        with self._lock:
            check = self._check_locked()
            if not check.ok:
                raise PoolFull(check.reason)
            return self._free_seqs.pop()

    def queue(self, st: SeqState, tokens: list[int]) -> None:
        """Promise cells for ``tokens`` and queue them; raises ContextOverflow if they do
        not fit the session's budget or the buffer."""
        n = len(tokens)
        with self._lock:
            if st.detached:  # checked under the lock: a release cannot slip in between
                raise SessionFailed(st.failed or f"session {st.id} is detached")
            if st.reserved + n > st.budget:
                raise ContextOverflow(
                    f"session {st.id} holds {st.reserved} of its {st.budget} suffix tokens; "
                    f"appending {n} more would overflow it (raise --session-budget or start "
                    "a new session)"
                )
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
            self._reserved -= st.reserved
            st.reserved = 0
            st.pending.clear()
            st.carry = None
            st.private = 0
            self._free_seqs.append(st.seq)
