"""Turns on the engine thread: open one (its sampler and output), sample a row, end it.

Everything here runs on the engine thread. :class:`Turns` owns the outbox: the items for
consumers (pieces, results, failures) wait there until the engine thread takes them
(:meth:`Turns.take_items`) and posts them, after the snapshot is published; cell promises
go through the ledger.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterable, Sequence

from mesh.engine.config import SamplingParams
from mesh.engine.interface import Piece, SessionFailed, TurnResult
from mesh.engine.llama import LlamaContext, LlamaModel
from mesh.engine.sampling import make_sampler
from mesh.engine.session import CellLedger, SeqState, Turn, TurnOutput

__all__ = ["Outbox", "Turns"]

Outbox = list[tuple[Turn, Piece | TurnResult | BaseException]]


class Turns:
    """Opens, samples and finishes the turns of one pool."""

    def __init__(self, model: LlamaModel, ledger: CellLedger, pool_seed: int) -> None:
        self._model = model
        self._ledger = ledger
        self._outbox: Outbox = []  # this step's items; only Turns appends to it
        self._seed = pool_seed
        # Per-token lookups through ctypes, cached (the vocabulary never changes).
        self._bytes: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        self.changes = 0  # turns opened or ended: the pool publishes a fresh snapshot

    def open(self, st: SeqState, params: SamplingParams,
             loop: asyncio.AbstractEventLoop) -> Turn:
        st.check_live()
        if st.turn is not None:
            raise RuntimeError(f"session {st.id} is already generating")
        num_prompt = self._ledger.pending(st)
        if not num_prompt and st.carry is None:
            raise ValueError(f"session {st.id} has no input; append text first")
        seed = params.seed
        if seed is None:
            key = f"{self._seed}:{st.id}:{st.turns_started}".encode()
            seed = int.from_bytes(hashlib.sha256(key).digest()[:4], "little")
        # An invalid grammar raises ValueError here, on the caller's await.
        sampler = make_sampler(temperature=params.temperature, top_k=params.top_k,
                               top_p=params.top_p, seed=seed, grammar=params.grammar,
                               model=self._model, rep=params)
        turn = Turn(params=params, sampler=sampler, loop=loop, queue=asyncio.Queue(),
                    num_prompt=num_prompt, output=TurnOutput(params.stop),
                    priority=st.created if params.priority is None else params.priority)
        st.turn = turn
        st.turns_started += 1
        self.changes += 1
        return turn

    def take_items(self) -> Outbox:
        """The items queued since the last take, oldest first (the outbox starts over)."""
        items, self._outbox = self._outbox, []
        return items

    def fail(self, st: SeqState, reason: str) -> None:
        """End the session's turn in flight with SessionFailed (its session is released)."""
        turn = st.turn
        if turn is None:
            return
        self._outbox.append((turn, SessionFailed(reason)))
        turn.sampler.close()
        st.turn = None

    def sample(self, st: SeqState, ctx: LlamaContext, idx: int) -> None:
        """Sample the session's next token from batch row ``idx`` and queue the piece."""
        if st.turn is not None:
            self.accept(st, st.turn.sampler.sample(ctx, idx))

    def accept(self, st: SeqState, tok: int) -> None:
        """Take the token sampled for the session (here or by the native step)."""
        self.accept_all(((st, 0),), (tok,))

    def accept_all(self, rows: Iterable[tuple[SeqState, int]], toks: Sequence[int]) -> None:
        """Take ``toks[i]`` for the session of ``rows[i]``: one step's draws in one loop
        (this runs once per sampled row per step: locals are bound once)."""
        eog_cache, bytes_cache, model = self._eog, self._bytes, self._model
        carry, outbox, now = self._ledger.carry, self._outbox, None
        for (st, _), tok in zip(rows, toks, strict=True):
            turn = st.turn
            if turn is None:
                continue
            params = turn.params
            if turn.first_token_at is None:
                turn.first_token_at = now = now or time.monotonic()
            eog = eog_cache.get(tok)
            if eog is None:
                eog = eog_cache[tok] = model.is_eog(tok)
            if eog and (params.grammar is not None or params.stop_at_eos):
                # Under a grammar, EOG is sampled only once the grammar is complete.
                self.finish(st, "stop" if params.grammar is not None else "eos")
                continue
            if not carry(st, tok):
                self.finish(st, "context_full")
                continue
            turn.num_generated += 1
            st.num_generated += 1
            out = turn.output
            data = bytes_cache.get(tok)
            if data is None:
                data = bytes_cache[tok] = model.token_bytes(tok)
            text = out.feed(data)
            if out.matched is not None:
                if text:
                    outbox.append((turn, Piece(token=tok, text=text)))
                self.finish(st, "stop")
                continue
            if turn.num_generated >= params.max_tokens:
                text += out.finish()  # held text goes out with the last token
                outbox.append((turn, Piece(token=tok, text=text)))
                self.finish(st, "length")
            else:
                outbox.append((turn, Piece(token=tok, text=text)))

    def admit(self, states: Iterable[SeqState]) -> None:
        """The decode gate let these sessions' waiting turns run from this step."""
        now = time.monotonic()
        for st in states:
            turn = st.turn
            if turn is not None and turn.admitted_at is None:
                turn.waited_s = _wait_s(turn, now)
                turn.admitted_at = now
                self.changes += 1
                if turn.paused_at is not None:  # back from a pause: say how long it was
                    self._outbox.append((turn, Piece(token=-1, text="",
                                                     paused_s=now - turn.paused_at)))
                    turn.paused_at = None

    def pause(self, states: Iterable[SeqState]) -> None:
        """The decode gate paused these running turns (shed, to keep the floor): they
        wait again, keeping their cells, carry token and queued text, and their waiting
        time counts from now."""
        now = time.monotonic()
        for st in states:
            turn = st.turn
            if turn is not None and turn.admitted_at is not None:
                turn.admitted_at = None
                turn.paused_at = now
                turn.num_pauses += 1
                self.changes += 1

    def finish_cancelled(self, states: Iterable[SeqState]) -> None:
        """End every turn its consumer cancelled (before planning: they take no room)."""
        for st in list(states):
            if st.turn is not None and st.turn.cancelled:
                self.finish(st, "cancelled")

    def finish(self, st: SeqState, reason: str) -> None:
        turn = st.turn
        if turn is None:
            return
        out = turn.output
        tail = out.finish()
        if tail:  # held text released by an end with no token of its own (eos, cut)
            self._outbox.append((turn, Piece(token=-1, text=tail)))
        now = time.monotonic()
        self._outbox.append((turn, TurnResult(
            text=out.text, num_prompt_tokens=turn.num_prompt, num_generated=turn.num_generated,
            finish_reason=reason, decode_s=now - (turn.first_token_at or turn.started),
            stop=out.matched, wait_s=_wait_s(turn, now))))
        turn.sampler.close()
        st.turn = None
        self.changes += 1
        # An undecoded carry token goes back to the queue: the next turn decodes it first,
        # so the conversation keeps every token the session generated.
        self._ledger.requeue_carry(st)


def _wait_s(turn: Turn, now: float) -> float:
    """How long the turn waited for the decode gate: before it first ran and while it
    was paused (all of its life if it never ran)."""
    if turn.admitted_at is not None:
        return turn.waited_s
    since = turn.paused_at if turn.paused_at is not None else turn.started
    return turn.waited_s + max(0.0, now - since)
