"""The shared KV pool: one model, one context, one immutable prefix, many sessions.

Sequence 0 holds the prefix. ``attach`` copies it to a free sequence id with
``llama_memory_seq_cp``, which with a unified KV cache only adds the new id to the prefix
cells' metadata: every session reads the same prefix cells and owns only its suffix.

One engine thread owns the llama.cpp context. Each step it packs one token for every
decoding session plus chunks of queued suffix prefill (under ``n_batch``), calls
``llama_decode`` once, samples every session that asked for logits right away (the next
decode overwrites them) and posts the pieces to each consumer's asyncio loop. Callers talk
to the thread through a command queue; every llama.cpp call happens on that thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import os
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from mesh.engine import warm
from mesh.engine.census import CellCensus, header_bytes, parse_cell_census
from mesh.engine.llama import Batch, LlamaContext, LlamaModel, make_sampler
from mesh.engine.session import PooledSession, SeqState, Turn
from mesh.engine.types import (
    AttachCheck,
    ContextOverflow,
    EngineConfig,
    Piece,
    PoolFull,
    PoolInfo,
    PoolLoad,
    SamplingParams,
    SessionFailed,
    SessionLoad,
    StepSample,
    TurnResult,
)

__all__ = ["MAX_SEQUENCES", "SharedKVPool", "Tokenizer", "open_tokenizer"]

T = TypeVar("T")
Progress = Callable[[int, int], None]

MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: the prefix sequence counts toward it
PREFIX_SEQ = 0
_RATE_WINDOW_S = 5.0


class Tokenizer:
    """A model's vocabulary alone (no weights): counts tokens before a pool exists."""

    def __init__(self, model_path: str) -> None:
        self._model = LlamaModel(model_path, vocab_only=True)

    def count(self, text: str) -> int:
        return len(self._model.tokenize(text, add_bos=False))

    def close(self) -> None:
        self._model.close()


def open_tokenizer(model_path: str) -> Tokenizer:
    return Tokenizer(model_path)


def _step_ewma(old: float | None, new: float) -> float:
    return new if old is None else old + 0.2 * (new - old)


class SharedKVPool:
    """The real engine. Build with ``SharedKVPool(config, prefix)``, then ``await start()``.

    ``prefix`` is text (tokenized with BOS) or a list of token ids. It is decoded once, or
    restored from the warm-start cache, and never changes: a different prefix is a
    different pool.
    """

    def __init__(self, config: EngineConfig, prefix: str | list[int]) -> None:
        config.validate()
        if config.max_sessions + 1 > MAX_SEQUENCES:
            raise ValueError(
                f"max_sessions {config.max_sessions} is above llama.cpp's limit of "
                f"{MAX_SEQUENCES - 1} sessions (one sequence holds the prefix)"
            )
        self.config = config
        self._prefix_input = prefix
        self._model: LlamaModel | None = None
        self._ctx: LlamaContext | None = None
        self._batch: Batch | None = None
        self._prefix: list[int] = []
        self._info: PoolInfo | None = None
        self._lock = threading.Lock()  # guards reservations, pending deques, free ids
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._held = False
        self._shared_cells = 0  # cells held by the prefix sequence (0 in naive mode)
        self._outbox: list[tuple[Turn, Piece | TurnResult | BaseException]] = []
        self._sessions: dict[int, SeqState] = {}
        self._free_seqs: list[int] = []
        self._reserved_total = 0
        self._next_id = 0
        self._step_ms: float | None = None
        self._recent_steps: deque[StepSample] = deque(maxlen=64)
        self._rate_window: deque[tuple[float, int]] = deque()
        self._snapshot: PoolLoad | None = None
        self.num_steps = 0
        self.host_s = 0.0  # time per step outside llama_decode, summed (for the bench)
        self.decode_s = 0.0

    # ------------------------------------------------------------------ lifecycle

    async def start(self, progress: Progress | None = None) -> PoolInfo:
        """Load the model, build or restore the prefix, start the engine thread."""
        info = await asyncio.to_thread(self._build, progress)
        self._thread = threading.Thread(target=self._run, name="mesh-engine", daemon=True)
        self._thread.start()
        return info

    def _build(self, progress: Progress | None) -> PoolInfo:
        cfg = self.config
        t0 = time.monotonic()
        model = LlamaModel(cfg.model_path, n_gpu_layers=cfg.n_gpu_layers,
                           extra_buffers=cfg.extra_buffers)
        self._model = model
        if isinstance(self._prefix_input, str):
            tokens = model.tokenize(self._prefix_input, add_bos=model.add_bos)
        else:
            tokens = list(self._prefix_input)
        if not tokens:
            raise ValueError("the prefix is empty; a pool needs at least one prefix token")
        if cfg.share_prefix:
            n_ctx = cfg.n_ctx or len(tokens) + cfg.max_sessions * cfg.session_budget
        else:
            n_ctx = cfg.n_ctx or cfg.max_sessions * (len(tokens) + cfg.session_budget)
        n_ctx = -(-n_ctx // 256) * 256  # llama.cpp pads the cache to 256 cells anyway
        if len(tokens) >= n_ctx:
            raise ValueError(
                f"the prefix is {len(tokens)} tokens but the KV buffer has {n_ctx} cells; "
                "raise n_ctx or shrink the prefix"
            )
        n_seq_max = cfg.max_sessions + 1
        threads = cfg.n_threads or os.cpu_count() or 1
        # n_outputs_max: at most one logits row per session per step. llama.cpp requires
        # it to be >= n_seq_max at construction; the default (n_batch rows of a 262K
        # vocabulary) would allocate a 514 MiB logits buffer.
        ctx = LlamaContext(model, n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=cfg.n_batch,
                           n_outputs_max=n_seq_max, n_threads=threads, swa_full=cfg.swa_full)
        self._ctx = ctx
        self._batch = Batch(cfg.n_batch)
        self._prefix = tokens
        prefix_hash = hashlib.sha256(
            b"".join(t.to_bytes(4, "little") for t in tokens)
        ).hexdigest()
        warm_started = False
        snap = None
        self._shared_cells = len(tokens)
        if cfg.cache_dir and cfg.share_prefix:
            snap = warm.snapshot_path(Path(cfg.cache_dir), cfg.model_path, prefix_hash,
                                      ctx_key=f"{n_ctx}:{n_seq_max}:{cfg.swa_full}:unified")
            warm_started = warm.restore(ctx, snap, PREFIX_SEQ, tokens)
        if not cfg.share_prefix:
            self._shared_cells = 0  # naive baseline: no shared prefix sequence at all
        elif not warm_started:
            self._prefill_prefix(tokens, progress)
            if snap is not None:
                warm.save(ctx, snap, PREFIX_SEQ, tokens)
        elif progress is not None:
            progress(len(tokens), len(tokens))
        self._free_seqs = list(range(n_seq_max - 1, 0, -1))  # pop() hands out 1 first
        self._info = PoolInfo(
            model_path=str(cfg.model_path), model_name=model.description, n_ctx=ctx.n_ctx,
            n_seq_max=n_seq_max, max_sessions=cfg.max_sessions,
            session_budget=cfg.session_budget, n_vocab=model.n_vocab,
            prefix_tokens=len(tokens), prefix_hash=prefix_hash, warm_started=warm_started,
            build_s=time.monotonic() - t0,
        )
        self._publish()
        return self._info

    def _prefill_prefix(self, tokens: list[int], progress: Progress | None) -> None:
        assert self._ctx is not None and self._batch is not None
        chunk = self.config.prefill_chunk
        for start in range(0, len(tokens), chunk):
            self._batch.clear()
            for i, tok in enumerate(tokens[start : start + chunk]):
                self._batch.add(tok, start + i, PREFIX_SEQ, False)
            rc = self._ctx.decode(self._batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed ({rc}) while building the prefix")
            if progress is not None:
                progress(min(start + chunk, len(tokens)), len(tokens))

    async def aclose(self) -> None:
        """Stop the engine thread, fail turns in flight, free native handles."""
        self._stopping = True
        self.wake()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        for st in list(self._sessions.values()):
            if st.turn is not None:
                st.turn.post(SessionFailed("the pool was closed"))  # thread has stopped
                st.turn.sampler.close()
            st.detached = True
            st.failed = "the pool was closed"
        self._sessions.clear()
        for handle in (self._batch, self._ctx, self._model):  # context before model
            if handle is not None:
                handle.close()
        self._batch = self._ctx = self._model = None

    @property
    def info(self) -> PoolInfo:
        if self._info is None:
            raise RuntimeError("the pool is not started; await pool.start() first")
        return self._info

    @property
    def is_started(self) -> bool:
        return self._info is not None

    # ------------------------------------------------------------------ commands

    def wake(self) -> None:
        self._commands.put(lambda: None)

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread and await its result."""
        if self._thread is None or self._stopping:
            raise SessionFailed("the pool is not running")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

        self._commands.put(run)
        return await asyncio.wrap_future(fut)

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Run no step inside this block (commands still run): turns started inside it
        begin in the same step, which makes a multi-session schedule reproducible."""

        def hold(value: bool) -> None:
            self._held = value

        await self._call(lambda: hold(True))
        try:
            yield
        finally:
            await self._call(lambda: hold(False))

    def tokenize(self, text: str) -> list[int]:
        assert self._model is not None, "pool not started"
        return self._model.tokenize(text, add_bos=False)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text))

    def _free_cells(self) -> int:
        """Cells neither the prefix holds nor any session has reserved (lock held)."""
        return self.info.n_ctx - self._shared_cells - self._reserved_total

    def check_attach(self) -> AttachCheck:
        with self._lock:
            return self._check_attach_locked()

    def _check_attach_locked(self) -> AttachCheck:
        if self._info is None:
            return AttachCheck(False, "the pool is not started")
        if not self._free_seqs:
            return AttachCheck(False, f"all {self.config.max_sessions} session slots are "
                               "in use; detach a session or raise --max-sessions")
        free_cells = self._free_cells()
        need = 1 if self.config.share_prefix else len(self._prefix) + 1
        if free_cells < need:
            return AttachCheck(False, f"the KV buffer ({self.info.n_ctx} cells) is full")
        return AttachCheck(True)

    async def attach(self) -> PooledSession:
        def do() -> PooledSession:
            assert self._ctx is not None
            with self._lock:
                check = self._check_attach_locked()
                if not check.ok:
                    raise PoolFull(check.reason)
                seq = self._free_seqs.pop()
                self._next_id += 1
                sid = f"s{self._next_id}"
            if self.config.share_prefix:
                self._ctx.seq_copy(PREFIX_SEQ, seq)  # metadata only: shares prefix cells
                st = SeqState(id=sid, seq=seq, prefix_len=len(self._prefix),
                              budget=self.config.session_budget)
            else:  # naive baseline: the session prefills a private copy of the prefix
                st = SeqState(id=sid, seq=seq, prefix_len=0,
                              budget=self.config.session_budget + len(self._prefix))
            self._sessions[seq] = st
            if not self.config.share_prefix:
                try:
                    self.append_tokens(st, list(self._prefix))
                except ContextOverflow as exc:
                    self._release(st, reason=str(exc))
                    raise PoolFull(str(exc)) from exc
            self._publish()
            return PooledSession(self, st)

        return await self._call(do)

    def append_tokens(self, st: SeqState, tokens: list[int]) -> None:
        """Queue tokens for prefill; check the budgets first (check, then commit)."""
        n = len(tokens)
        with self._lock:
            if st.reserved + n > st.budget:
                raise ContextOverflow(
                    f"session {st.id} holds {st.reserved} of its {st.budget} suffix tokens; "
                    f"appending {n} more would overflow it (raise --session-budget or start "
                    "a new session)"
                )
            free = self._free_cells()
            if n > free:
                raise ContextOverflow(
                    f"the KV buffer has {free} free cells; appending {n} tokens does not fit"
                )
            st.pending.extend(tokens)
            st.reserved += n
            self._reserved_total += n
        self.wake()

    async def start_turn(self, st: SeqState, params: SamplingParams) -> Turn:
        loop = asyncio.get_running_loop()

        def do() -> Turn:
            if st.detached:
                raise SessionFailed(st.failed or f"session {st.id} is detached")
            if st.turn is not None:
                raise RuntimeError(f"session {st.id} is already generating")
            with self._lock:
                if not st.pending and st.carry is None:
                    raise ValueError(f"session {st.id} has no input; append text first")
                num_prompt = len(st.pending)
            seed = params.seed
            if seed is None:
                key = f"{self.config.seed}:{st.id}:{st.turns_started}".encode()
                seed = int.from_bytes(hashlib.sha256(key).digest()[:4], "little")
            # An invalid grammar raises ValueError here, on the caller's await.
            sampler = make_sampler(temperature=params.temperature, top_k=params.top_k,
                                   top_p=params.top_p, seed=seed, grammar=params.grammar,
                                   model=self._model)
            turn = Turn(params=params, sampler=sampler, loop=loop, queue=asyncio.Queue(),
                        num_prompt=num_prompt)
            st.turn = turn
            st.turns_started += 1
            return turn

        return await self._call(do)

    async def detach(self, st: SeqState) -> None:
        if st.detached:
            return

        def do() -> None:
            self._release(st, reason=None)
            self._publish()

        with contextlib.suppress(SessionFailed):
            await self._call(do)

    def _release(self, st: SeqState, reason: str | None) -> None:
        """Engine thread: drop the session's private cells and its sequence id."""
        if st.detached:
            return
        assert self._ctx is not None
        self._ctx.seq_remove(st.seq)  # shared prefix cells stay: sequence 0 holds them
        if st.turn is not None:
            self._post(st.turn, SessionFailed(reason or f"session {st.id} was detached"))
            st.turn.sampler.close()
            st.turn = None
        with self._lock:
            self._reserved_total -= st.reserved
            st.reserved = 0
            st.pending.clear()
            st.carry = None
            st.private = 0
            self._free_seqs.append(st.seq)
        st.detached = True
        st.failed = reason
        self._sessions.pop(st.seq, None)

    # ------------------------------------------------------------------ engine thread

    def _post(self, turn: Turn, item: Piece | TurnResult | BaseException) -> None:
        """Queue an item for its consumer; sent by :meth:`_flush` after the snapshot is
        published, so a consumer that sees a turn end also sees the pool after it."""
        self._outbox.append((turn, item))

    def _flush(self) -> None:
        out, self._outbox = self._outbox, []
        for turn, item in out:
            turn.post(item)

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._drain_commands(block=not self._has_work())
                if self._stopping:
                    break
                if self._has_work():
                    self._step()
            except Exception as exc:  # the engine thread must survive anything
                for st in list(self._sessions.values()):
                    if st.turn is not None:
                        self._release(st, reason=f"engine error: {exc!r}")
                self._publish()
            self._flush()
        self._flush()

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.25) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        cmd()
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return

    def _has_work(self) -> bool:
        if self._held:
            return False
        return any(st.turn is not None for st in self._sessions.values())

    def _step(self) -> None:
        assert self._ctx is not None and self._batch is not None
        t0 = time.monotonic()
        batch = self._batch
        batch.clear()
        rows: list[tuple[SeqState, int]] = []  # sessions to sample, and their batch row
        counts: dict[int, int] = {}
        # Finish cancelled turns first, so they take no room in the batch.
        for st in list(self._sessions.values()):
            if st.turn is not None and st.turn.cancelled:
                self._finish(st, "cancelled")
        budget = self.config.n_batch
        # 1. One decode token for every generating session.
        for st in self._sessions.values():
            if st.turn is not None and st.carry is not None and not st.pending:
                rows.append((st, batch.add(st.carry, st.pos, st.seq, True)))
                counts[st.seq] = 1
                budget -= 1
        num_decode = len(rows)
        sum_ctx = sum(st.pos + 1 for st, _ in rows)
        # 2. Prefill chunks of sessions in a turn, oldest first, under the remaining token
        # budget; the chunk that ends a session's queue asks for logits (its first sample).
        num_prefill = 0
        for st in sorted(self._sessions.values(), key=lambda s: s.created):
            if budget <= 0:
                break
            with self._lock:
                # Queued text is prefilled when its turn starts: prefilling it earlier
                # splits the suffix over two steps (the last token must wait for the turn
                # to be sampled), which cost a whole extra step per turn.
                ready = len(st.pending) if st.turn is not None else 0
                take = min(ready, budget)
                toks = [st.pending.popleft() for _ in range(max(take, 0))]
            if not toks:
                continue
            last = st.turn is not None and not st.pending
            for i, tok in enumerate(toks):
                is_out = last and i == len(toks) - 1
                idx = batch.add(tok, st.pos + i, st.seq, is_out)
                if is_out:
                    rows.append((st, idx))
            counts[st.seq] = counts.get(st.seq, 0) + len(toks)
            budget -= len(toks)
            num_prefill += len(toks)
        if batch.n_tokens == 0:
            self._publish()  # cancellations above changed states
            return
        t1 = time.monotonic()
        rc = self._ctx.decode(batch)
        t2 = time.monotonic()
        if rc != 0:
            reason = (f"llama_decode returned {rc} (no KV slot for the batch)" if rc == 1
                      else f"llama_decode failed with status {rc}")
            for seq in counts:
                st = self._sessions[seq]
                self._release(st, reason=reason)
            self._publish()
            return
        decoded = {st.seq for st, _ in rows[:num_decode]}
        for seq, n in counts.items():
            st = self._sessions[seq]
            st.private += n
            if seq in decoded:
                st.carry = None  # the carried token is now in the cache
        step_s = t2 - t0
        for i, (st, idx) in enumerate(rows):
            if i < num_decode:
                st.observe_decode(step_s)
            self._sample(st, idx)
        now = time.monotonic()
        gen = num_decode
        self._rate_window.append((now, gen))
        for st in self._sessions.values():
            st.mark_busy(now)
        self.num_steps += 1
        self.decode_s += t2 - t1
        self.host_s += (t1 - t0) + (now - t2)
        self._step_ms = _step_ewma(self._step_ms, (now - t0) * 1000)
        self._recent_steps.append(StepSample(num_decode=num_decode,
                                             num_prefill_tokens=num_prefill,
                                             sum_context=sum_ctx, step_s=now - t0))
        self._publish()

    def _sample(self, st: SeqState, idx: int) -> None:
        """Sample the session's next token from batch row ``idx`` and post the piece."""
        assert self._ctx is not None and self._model is not None
        turn = st.turn
        if turn is None:
            return
        tok = turn.sampler.sample(self._ctx, idx)
        params = turn.params
        if turn.first_token_at is None:
            turn.first_token_at = time.monotonic()
        if self._model.is_eog(tok):
            if params.grammar is not None:  # the grammar is complete: only EOG was allowed
                self._finish(st, "stop")
                return
            if params.stop_at_eos:
                self._finish(st, "eos")
                return
        with self._lock:
            room = st.reserved + 1 <= st.budget and self._free_cells() >= 1
            if room:
                st.carry = tok
                st.reserved += 1
                self._reserved_total += 1
        if not room:
            self._finish(st, "context_full")
            return
        turn.num_generated += 1
        st.num_generated += 1
        text = turn.decoder.decode(self._model.token_bytes(tok))
        piece_text = text
        stopped = False
        if params.stop and text:
            full = turn.text + text
            window = max(len(s) for s in params.stop) + len(text)
            tail_start = max(0, len(full) - window)
            hits = [full.find(s, tail_start) for s in params.stop]
            hits = [h for h in hits if h >= 0]
            if hits:
                cut = min(hits)
                piece_text = full[len(turn.text) : cut] if cut > len(turn.text) else ""
                stopped = True
        turn.text += piece_text
        if piece_text or not stopped:
            self._post(turn, Piece(token=tok, text=piece_text))
        if stopped:
            self._finish(st, "stop")
        elif turn.num_generated >= params.max_tokens:
            self._finish(st, "length")

    def _finish(self, st: SeqState, reason: str) -> None:
        turn = st.turn
        if turn is None:
            return
        tail = turn.decoder.decode(b"", final=True)
        if tail and reason != "stop":
            turn.text += tail
        now = time.monotonic()
        self._post(turn, TurnResult(text=turn.text, num_prompt_tokens=turn.num_prompt,
                             num_generated=turn.num_generated, finish_reason=reason,
                             decode_s=now - (turn.first_token_at or turn.started)))
        turn.sampler.close()
        st.turn = None
        # An undecoded carry token goes back to the queue: the next turn decodes it first,
        # so the conversation keeps every token the session generated.
        with self._lock:
            if st.carry is not None:
                st.pending.appendleft(st.carry)
                st.carry = None

    # ------------------------------------------------------------------ snapshots

    def _publish(self) -> None:
        now = time.monotonic()
        while self._rate_window and self._rate_window[0][0] < now - _RATE_WINDOW_S:
            self._rate_window.popleft()
        span = (now - self._rate_window[0][0]) if len(self._rate_window) > 1 else 0.0
        agg = sum(n for _, n in self._rate_window) / span if span > 0 else 0.0
        prefix = self._shared_cells
        sessions = tuple(
            SessionLoad(id=st.id, state=st.state, private_cells=st.private,
                        context_len=st.pos, decode_tps=st.decode_tps,
                        duty_cycle=st.duty_cycle(now), age_s=now - st.created,
                        num_generated=st.num_generated)
            for st in self._sessions.values()
        )
        private = sum(s.private_cells for s in sessions)
        n_ctx = self._info.n_ctx if self._info else 0
        self._snapshot = PoolLoad(
            taken_at=now, sessions=sessions, step_ms=self._step_ms, agg_tps=agg,
            cells_used=prefix + private, cells_total=n_ctx, prefix_cells=prefix,
            naive_cells=(private + len(self._prefix) * len(sessions) if prefix else private),
            free_seq_ids=len(self._free_seqs),
            max_sessions=self.config.max_sessions, session_budget=self.config.session_budget,
            recent_steps=tuple(self._recent_steps),
        )

    def load(self) -> PoolLoad:
        if self._snapshot is None:
            raise RuntimeError("the pool is not started")
        return self._snapshot

    async def seq_pos_ranges(self) -> dict[int, tuple[int, int]]:
        """llama.cpp's own (min, max) position per live sequence, for cross-checks."""

        def do() -> dict[int, tuple[int, int]]:
            assert self._ctx is not None
            seqs = [PREFIX_SEQ, *self._sessions]
            return {s: self._ctx.seq_pos_range(s) for s in seqs}

        return await self._call(do)

    async def cell_census(self) -> CellCensus | None:
        """llama.cpp's own count of occupied cells and sequence references."""
        info = self.info

        def do() -> CellCensus | None:
            assert self._ctx is not None
            head = self._ctx.state_head(-1, header_bytes(info.n_ctx, info.n_seq_max))
            return parse_cell_census(head, info.n_ctx, info.n_seq_max)

        return await self._call(do)

    def native(self) -> Any:
        """The LlamaContext (for benchmarks that need raw access on the engine thread)."""
        return self._ctx
