"""The pool's live sessions: attach and release on the engine thread.

Attach takes a free sequence id from the ledger and shares the prefix with it
(``llama_memory_seq_cp`` of sequence 0: metadata only, the cells are shared), or, in the
naive baseline, queues a private copy of the prefix. Release drops the session's private
cells (the prefix stays: sequence 0 holds it), fails its turn in flight through the outbox
and gives its promises and sequence id back to the ledger.
"""

from __future__ import annotations

from mesh.engine.build import PREFIX_SEQ, Built
from mesh.engine.ledger import CellLedger
from mesh.engine.session import SeqState
from mesh.engine.turns import Outbox
from mesh.engine.types import ContextOverflow, EngineConfig, PoolFull, SessionFailed

__all__ = ["SessionRegistry"]


class SessionRegistry:
    """Sessions by sequence id (``sessions``, shared with the pool); engine thread only."""

    def __init__(self, built: Built, ledger: CellLedger, outbox: Outbox,
                 config: EngineConfig, sessions: dict[int, SeqState]) -> None:
        self._built = built
        self._ledger = ledger
        self._outbox = outbox
        self._config = config
        self.sessions = sessions
        self._next_id = 0

    @property
    def attached(self) -> int:
        """Sessions attached since start (the ids handed out)."""
        return self._next_id

    def attach(self) -> SeqState:
        """A new session on a free sequence id; raises PoolFull with the reason."""
        seq = self._ledger.take_seq()
        self._next_id += 1
        sid, cfg, prefix = f"s{self._next_id}", self._config, self._built.prefix
        if cfg.share_prefix:
            self._built.ctx.seq_copy(PREFIX_SEQ, seq)  # metadata only: shares the cells
            st = SeqState(id=sid, seq=seq, prefix_len=len(prefix), budget=cfg.session_budget)
        else:  # naive baseline: the session prefills a private copy of the prefix
            st = SeqState(id=sid, seq=seq, prefix_len=0,
                          budget=cfg.session_budget + len(prefix))
        self.sessions[seq] = st
        if not cfg.share_prefix:
            try:
                self._ledger.queue(st, list(prefix))
            except ContextOverflow as exc:
                self.release(st, reason=str(exc))
                raise PoolFull(str(exc)) from exc
        return st

    def release(self, st: SeqState, reason: str | None) -> None:
        """Drop the session's private cells and its sequence id (idempotent)."""
        if st.detached:
            return
        self._built.ctx.seq_remove(st.seq)  # shared prefix cells stay: sequence 0 holds them
        if st.turn is not None:
            self._outbox.append((st.turn, SessionFailed(reason or f"session {st.id} was "
                                                        "detached")))
            st.turn.sampler.close()
            st.turn = None
        self._ledger.release(st, reason)
        self.sessions.pop(st.seq, None)

    def release_turns(self, reason: str) -> None:
        """Release every session with a turn in flight (the engine thread's last resort)."""
        for st in list(self.sessions.values()):
            if st.turn is not None:
                self.release(st, reason)

    def fail_all(self, reason: str) -> None:
        """After the engine thread stopped: fail every turn in flight, detach everyone."""
        for st in list(self.sessions.values()):
            if st.turn is not None:
                st.turn.post(SessionFailed(reason))  # the thread has stopped
                st.turn.sampler.close()
            st.detached, st.failed = True, reason
        self.sessions.clear()

    def cells_used(self) -> int:
        """Cells in use: the shared prefix's and every session's private suffix."""
        return self._built.shared_cells + sum(st.private for st in self.sessions.values())
