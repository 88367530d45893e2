"""An honest fake of :class:`~mesh.engine.interface.Engine` for tests of the layers above it.

It keeps the real pool's accounting (cells, sequence ids, budgets, states) and "generates"
a deterministic echo of the session's last input, one word per token, with an optional
delay per step: for unit tests and for measuring the A2A layer's own overhead
(``bench/a2a_bench.py``); ``mesh serve`` never uses it.

Turns wait in a :class:`~mesh.engine.interface.TurnLine` as on the pool (state ``waiting``,
completion order, ``SessionLoad.turn_place``; a running turn is never paused). Prefill is
instant, so a prefill budget has nothing to cap. ``SamplingParams.grammar`` is ignored (an
echo is not sampled from logits); grammar is tested on the real pool only. Turn endings are
the pool's: stop strings through the same :class:`~mesh.engine.session.TurnOutput`, and a
session out of budget mid-turn ends with ``context_full`` (appending text that does not fit
raises :class:`~mesh.engine.interface.ContextOverflow`).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from collections.abc import AsyncIterator

from mesh.engine.config import SamplingParams
from mesh.engine.interface import (
    AttachCheck,
    ContextOverflow,
    Piece,
    PoolFull,
    PoolInfo,
    PoolLoad,
    PrefillBudget,
    SessionFailed,
    SessionLoad,
    SessionState,
    TurnAdmission,
    TurnLine,
    TurnResult,
)
from mesh.engine.session import TurnOutput

__all__ = ["FakeEngine", "FakeSession"]


def _count(text: str) -> int:
    return len(text.split())


class _FakeGeneration:
    def __init__(self, session: FakeSession, params: SamplingParams) -> None:
        self._session = session
        self._params = params
        self._closed = False
        self.result: TurnResult | None = None

    def __aiter__(self) -> AsyncIterator[Piece]:
        return self._run()

    async def aclose(self) -> None:
        self._closed = True

    async def _run(self) -> AsyncIterator[Piece]:
        s = self._session
        engine = s.engine
        s.check_attached()
        if engine.fail_next is not None:
            reason, engine.fail_next = engine.fail_next, None
            await s.detach()
            raise SessionFailed(reason)
        s.state = SessionState.WAITING
        priority = s.created if self._params.priority is None else self._params.priority
        try:
            await engine.turn_line.enter(priority, s.id)  # completion order, as the pool
        except BaseException:
            s.state = SessionState.IDLE  # as the pool: no turn, its text stays queued
            raise
        try:
            async for piece in self._turn():
                yield piece
        finally:
            engine.turn_line.leave()

    async def _turn(self) -> AsyncIterator[Piece]:
        s = self._session
        engine = s.engine
        prompt, s.pending = s.pending, []
        prompt_tokens = _count(" ".join(prompt))
        s.state = SessionState.PREFILLING
        s.private_cells += prompt_tokens
        engine.prefill_tokens += prompt_tokens
        words = (" ".join(prompt).split() or ["ok"]) * self._params.max_tokens
        s.state = SessionState.DECODING
        start = time.monotonic()
        out = TurnOutput(self._params.stop)  # the pool's own stop-string rules
        generated = 0
        finish = "length"
        for word in words[: self._params.max_tokens]:
            if self._closed:
                finish = "cancelled"
                break
            if s.private_cells + 1 > engine.info.session_budget:
                finish = "context_full"  # as the pool: the turn ends, the session lives
                break
            await asyncio.sleep(engine.step_delay_s)  # 0: a bare yield, as sleep(0)
            s.private_cells += 1
            s.num_generated += 1
            generated += 1
            text = out.feed_text((" " if generated > 1 else "") + word)
            if out.matched is not None:
                if text:
                    yield Piece(token=generated, text=text)
                finish = "stop"
                break
            if generated == self._params.max_tokens:
                text += out.finish()
            yield Piece(token=generated, text=text)
        tail = out.finish()
        if tail:
            yield Piece(token=-1, text=tail)
        s.state = SessionState.IDLE
        self.result = TurnResult(text=out.text, num_prompt_tokens=prompt_tokens,
                                 num_generated=generated, finish_reason=finish,
                                 decode_s=time.monotonic() - start, stop=out.matched)


class FakeSession:
    def __init__(self, engine: FakeEngine, sid: str) -> None:
        self.engine = engine
        self.id = sid
        self.pending: list[str] = []
        self.private_cells = 0
        self.num_generated = 0
        self.state = SessionState.IDLE
        self.detached = False
        self.created = time.monotonic()

    @property
    def context_len(self) -> int:
        return self.engine.info.prefix_tokens + self.private_cells

    def check_attached(self) -> None:
        if self.detached:
            raise SessionFailed(f"session {self.id} is detached")

    def append(self, text: str) -> None:
        self.check_attached()
        queued = sum(_count(t) for t in self.pending)
        if self.private_cells + queued + _count(text) > self.engine.info.session_budget:
            raise ContextOverflow(f"appending {_count(text)} tokens would exceed session "
                                  f"{self.id}'s budget of {self.engine.info.session_budget} tokens")
        self.pending.append(text)
        self.state = SessionState.PREFILLING

    def generate(self, params: SamplingParams) -> _FakeGeneration:
        params.validate()
        return _FakeGeneration(self, params)

    async def compact(self, text: str) -> bool:
        """As the pool: the suffix becomes ``text``, queued for the next turn (False while a
        turn runs); the engine counts it in ``load()``."""
        self.check_attached()
        if self.state in (SessionState.WAITING, SessionState.DECODING):
            return False
        queued = sum(_count(t) for t in self.pending)
        if _count(text) + queued > self.engine.info.session_budget:
            raise ContextOverflow(f"session {self.id}: a compacted suffix of {_count(text)} "
                                  f"tokens does not fit its budget")
        self.engine.compactions += 1
        self.engine.compacted_cells += self.private_cells
        self.private_cells = 0
        self.pending.insert(0, text)
        self.state = SessionState.PREFILLING
        return True

    async def detach(self) -> None:
        if not self.detached:
            self.detached = True
            self.engine.sessions.pop(self.id, None)


class FakeEngine:
    """Fake pool: ``max_sessions`` slots, a word-count "tokenizer", instant or slow steps."""

    def __init__(self, *, max_sessions: int = 8, session_budget: int = 4096,
                 prefix_tokens: int = 100, step_delay_s: float = 0.0) -> None:
        self.info = PoolInfo(
            model_path="fake", model_name="fake",
            n_ctx=prefix_tokens + max_sessions * session_budget, n_seq_max=max_sessions + 1,
            max_sessions=max_sessions, session_budget=session_budget, n_vocab=0,
            prefix_tokens=prefix_tokens, prefix_hash=hashlib.sha256(b"fake").hexdigest(),
            warm_started=False, build_s=0.0)
        self.step_delay_s = step_delay_s
        self.sessions: dict[str, FakeSession] = {}
        self.fail_next: str | None = None  # next generate() fails with this reason
        self._ids = itertools.count(1)
        self.sessions_attached = 0  # totals, as the pool reports them in load()
        self.prefill_tokens = 0
        self.compactions = 0
        self.compacted_cells = 0
        self.turn_line = TurnLine(lambda: self.load().cells_used, tuple)

    def set_prefill_budget(self, budget: PrefillBudget | None) -> None:
        del budget  # prefill is instant: nothing to cap

    def set_turn_admission(self, gate: TurnAdmission | None) -> None:
        self.turn_line.gate = gate

    def check_attach(self) -> AttachCheck:
        if len(self.sessions) >= self.info.max_sessions:
            return AttachCheck(False, f"all {self.info.max_sessions} session slots are in use")
        return AttachCheck(True)

    async def attach(self) -> FakeSession:
        # The pool attaches on its engine thread, so its callers always yield here: other
        # tasks run between a caller's own checks and the attach, as they do on the pool.
        await asyncio.sleep(0)
        check = self.check_attach()
        if not check.ok:
            raise PoolFull(check.reason)
        session = FakeSession(self, f"s{next(self._ids)}")
        self.sessions_attached += 1
        self.sessions[session.id] = session
        return session

    def turn_place(self, session_id: str) -> int | None:
        return self.turn_line.place(session_id)

    def backend_metrics(self) -> None:
        return None

    def load(self) -> PoolLoad:
        now = time.monotonic()
        places = self.turn_line.places()
        sessions = tuple(
            SessionLoad(id=s.id, state=s.state, private_cells=s.private_cells,
                        context_len=s.context_len,
                        # Measured once it has generated, as a real pool would report it.
                        decode_tps=(1.0 / (self.step_delay_s or 0.001)) if s.num_generated
                        else None,
                        duty_cycle=None, age_s=now - s.created, num_generated=s.num_generated,
                        turn_place=places.get(s.id))
            for s in self.sessions.values())
        private = sum(s.private_cells for s in sessions)
        prefix = self.info.prefix_tokens
        return PoolLoad(
            taken_at=now, sessions=sessions, step_ms=None, agg_tps=0.0,
            cells_used=prefix + private, cells_total=self.info.n_ctx, prefix_cells=prefix,
            naive_cells=private + prefix * len(sessions),
            free_seq_ids=self.info.max_sessions - len(sessions),
            max_sessions=self.info.max_sessions, session_budget=self.info.session_budget,
            sessions_attached=self.sessions_attached, prefill_tokens=self.prefill_tokens,
            compactions=self.compactions, compacted_cells=self.compacted_cells)

    def count_tokens(self, text: str) -> int:
        return _count(text)

    async def aclose(self) -> None:
        for s in list(self.sessions.values()):
            await s.detach()
