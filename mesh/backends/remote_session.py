"""A remote session: its conversation kept on mesh's side, one streamed completion a turn.

See :mod:`mesh.backends.openai` for the wire contract. The rules mirror the local pool's
(:mod:`mesh.engine.interface`): ``append`` never waits on the backend and raises
:class:`~mesh.engine.interface.ContextOverflow` past the budget; a turn that runs out of budget
ends ``context_full``; stop strings are cut by :class:`~mesh.engine.session.TurnOutput`
and, as in the pool, the stop string stays in the session's context (its text is kept in
the history, not in the turn's text); a backend that fails mid-turn detaches the session
and the generation raises :class:`~mesh.engine.interface.SessionFailed` naming the backend.

A stream that ends (``[DONE]``, or the body closes) without a ``finish_reason`` was cut
by the backend, not finished: llama-cpp-python's server does that to a running stream the
moment another request arrives (its ``--interrupt_requests``, on by default). The turn is
then resumed with one more request whose prompt continues after the text streamed so far,
for the tokens left. A stream that ends with no chunk at all is a failure, not a cut
(llama-cpp-python's server ends one so when the prompt exceeds its context).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

import httpx

from mesh.backends.remote_wire import sse_data
from mesh.engine.config import SamplingParams
from mesh.engine.interface import (
    ContextOverflow,
    Piece,
    PoolInfo,
    SessionFailed,
    SessionLoad,
    SessionState,
    TurnLine,
    TurnResult,
)
from mesh.engine.session import TurnOutput


class SessionHost(Protocol):
    """What a :class:`RemoteSession` needs from its engine (``OpenAIEngine`` is one), so
    this module does not import the engine's."""

    prefix_text: str
    sessions: dict[str, RemoteSession]
    turn_line: TurnLine

    @property
    def info(self) -> PoolInfo: ...

    @property
    def http(self) -> httpx.AsyncClient: ...

    @property
    def completions_url(self) -> str: ...

    def count_tokens(self, text: str) -> int: ...

    def record_token(self, gap_s: float | None, n: int = 1) -> None: ...

    def record_resume(self) -> None: ...

    def record_compaction(self, freed: int) -> None: ...

    def request_body(self, prompt: str, **fields: Any) -> dict[str, Any]: ...

__all__ = ["RemoteGeneration", "RemoteSession"]

_BUSY_RETRIES = 3  # a 429/503 from the backend is retried this often (Retry-After, ≤ 5 s)
_EWMA = 0.2
_STALE = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class RemoteSession:
    """One session on the backend (see the module docstring)."""

    def __init__(self, engine: SessionHost, sid: str) -> None:
        self.engine = engine
        self.id = sid
        self.history = ""  # every appended and generated text, in order
        self.pending = ""  # appended, not yet sent
        self.private = 0  # tokens of history (counted with the engine's tokenizer)
        self.pending_tokens = 0
        self.state = SessionState.IDLE
        self.detached = False
        self.created = time.monotonic()
        self.num_generated = 0
        self.decode_tps: float | None = None
        self.busy_s = 0.0
        self._busy_since: float | None = None

    @property
    def context_len(self) -> int:
        return self.engine.info.prefix_tokens + self.private + self.pending_tokens

    def append(self, text: str) -> None:
        if self.detached:
            raise SessionFailed(f"session {self.id} is detached")
        n = self.engine.count_tokens(text)
        budget = self.engine.info.session_budget
        if self.private + self.pending_tokens + n > budget:
            raise ContextOverflow(
                f"appending {n} tokens would exceed session {self.id}'s budget of "
                f"{budget} tokens")
        self.pending += text
        self.pending_tokens += n
        self.state = SessionState.PREFILLING

    def generate(self, params: SamplingParams) -> RemoteGeneration:
        params.validate()
        return RemoteGeneration(self, params)

    async def compact(self, text: str) -> bool:
        """Compaction: the history after the prefix becomes ``text`` (the next request sends
        the prefix, then ``text``, then what is appended), as the pool's
        :meth:`~mesh.engine.session.PooledSession.compact` does. False: a turn runs."""
        if self.detached:
            raise SessionFailed(f"session {self.id} is detached")
        if self._busy_since is not None or self.state is SessionState.WAITING:
            return False
        n = self.engine.count_tokens(text)
        budget = self.engine.info.session_budget
        if n + self.pending_tokens > budget:
            raise ContextOverflow(f"session {self.id}: a compacted history of {n} tokens with "
                                  f"{self.pending_tokens} queued exceeds its budget of {budget}")
        self.engine.record_compaction(self.private)
        self.history, self.private = text, n
        return True

    async def detach(self) -> None:
        if not self.detached:
            self.detached = True
            self.engine.sessions.pop(self.id, None)

    def busy(self, on: bool) -> None:
        now = time.monotonic()
        if on and self._busy_since is None:
            self._busy_since = now
        elif not on and self._busy_since is not None:
            self.busy_s += now - self._busy_since
            self._busy_since = None

    def snapshot(self, now: float) -> SessionLoad:
        age = now - self.created
        busy = self.busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        return SessionLoad(
            id=self.id, state=self.state, private_cells=self.private + self.pending_tokens,
            context_len=self.context_len, decode_tps=self.decode_tps,
            duty_cycle=busy / age if age > 0 else None, age_s=age,
            num_generated=self.num_generated)


class RemoteGeneration:
    """One turn: a streamed ``/v1/completions`` request (see the module docstring)."""

    def __init__(self, session: RemoteSession, params: SamplingParams) -> None:
        self._session = session
        self._params = params
        self._closed = False
        self.result: TurnResult | None = None
        self.usage: dict[str, Any] | None = None  # the backend's usage block, if it sent one

    def __aiter__(self) -> AsyncIterator[Piece]:
        return self._run()

    async def aclose(self) -> None:
        self._closed = True

    def _body(self, max_tokens: int, streamed: str = "") -> dict[str, Any]:
        s, p = self._session, self._params
        # The pool's sampler has no repetition penalty and no min-p; llama.cpp's servers
        # default to repeat_penalty 1.1 (llama-cpp-python) and min_p 0.05, which change
        # even a greedy turn. vLLM and SGLang take min_p too and ignore repeat_penalty.
        fields: dict[str, Any] = {"max_tokens": max_tokens, "temperature": p.temperature,
                                  "top_p": p.top_p, "min_p": 0.0, "repeat_penalty": 1.0}
        if p.top_k:
            fields["top_k"] = p.top_k
        if p.seed is not None:
            fields["seed"] = p.seed
        if not p.stop_at_eos:
            fields["ignore_eos"] = True  # vLLM, SGLang, llama-server
        if p.grammar is not None:
            fields["grammar"] = p.grammar  # llama.cpp servers; others ignore it
        # The prefix first, byte-identical every turn, then this session's history (and,
        # resuming a cut stream, what this turn streamed before the cut).
        prompt = s.engine.prefix_text + s.history + s.pending + streamed
        return s.engine.request_body(prompt, **fields)

    async def _run(self) -> AsyncIterator[Piece]:
        s = self._session
        if s.detached:
            raise SessionFailed(f"session {s.id} is detached")
        room = s.engine.info.session_budget - s.private - s.pending_tokens
        prompt_tokens = s.pending_tokens
        out = TurnOutput(self._params.stop)  # the pool's own stop-string rules
        start = time.monotonic()
        generated, finish, usage = 0, "cancelled", None
        s.state = SessionState.WAITING  # until the decode gate lets the turn run
        try:
            await s.engine.turn_line.enter()
        except BaseException:
            s.state = SessionState.IDLE if not s.pending else SessionState.PREFILLING
            raise
        s.busy(True)
        try:
            if room <= 0:
                finish = "context_full"
            else:
                finish = "length"
                limit = min(self._params.max_tokens, room)
                # aclosing: leaving the loop early (a stop string, a cancel) closes the
                # HTTP stream at once, which aborts the request on the backend.
                async with contextlib.aclosing(self._stream(limit)) as stream:
                    async for kind, value in stream:
                        if kind == "usage":
                            usage = value
                            continue
                        if kind == "finish":
                            finish = "length" if value == "length" else "eos"
                            continue
                        generated += 1
                        text = out.feed_text(value)
                        if text:
                            yield Piece(token=generated, text=text)
                        if out.matched is not None:
                            finish = "stop"
                            break
                        if self._closed:
                            finish = "cancelled"
                            break
                n = (usage or {}).get("completion_tokens")
                if finish in ("length", "eos") and isinstance(n, int) and n > generated:
                    generated = n  # a chunk may carry several tokens
                # Chunks are counted as tokens; a resumed stream can over-deliver (llama-cpp-
                # python's server flushes held-back text past max_tokens): at most the limit.
                generated = min(generated, limit)
                if finish == "length" and room < self._params.max_tokens and generated >= room:
                    finish = "context_full"
            tail = out.finish()
            if tail:
                yield Piece(token=-1, text=tail)
        finally:
            # Whatever was generated stays in the session (a cancelled turn too), as in
            # the pool; a failed session was detached and keeps nothing.
            s.engine.turn_line.leave()
            s.busy(False)
            if not s.detached:
                kept = out.text + (out.matched or out.held)
                s.history += s.pending + kept
                s.private += s.pending_tokens + s.engine.count_tokens(kept)
                s.pending, s.pending_tokens = "", 0
                s.num_generated += generated
                s.state = SessionState.IDLE
        self.usage = usage if isinstance(usage, dict) else None
        self.result = TurnResult(
            text=out.text, num_prompt_tokens=prompt_tokens, num_generated=generated,
            finish_reason=finish, decode_s=time.monotonic() - start, stop=out.matched)

    async def _stream(self, max_tokens: int) -> AsyncGenerator[tuple[str, Any]]:
        """("text", chunk) per streamed chunk, ("finish", reason), ("usage", {...}); a
        stream cut without a finish reason is resumed (module docstring)."""
        s = self._session
        streamed, n, busy, stale = "", 0, 0, 0
        while True:
            got, finished = 0, False
            try:
                request = self._request(max_tokens - n, streamed, busy < _BUSY_RETRIES,
                                        stale < 1)
                async with contextlib.aclosing(request) as events:
                    async for kind, value in events:
                        if kind == "busy":
                            busy += 1
                            await asyncio.sleep(_retry_after(value))
                            break
                        if kind == "stale":
                            stale += 1
                            break
                        if kind == "text":
                            got += 1
                            streamed += value
                        finished = finished or kind == "finish"
                        yield kind, value
                    else:
                        if finished or n + got >= max_tokens:
                            return
                        if got == 0:  # not a cut (that follows a chunk): a failure
                            raise SessionFailed(
                                f"backend {s.engine.completions_url} ended a stream with no "
                                f"token and no finish_reason ({_no_token_hint(s)})")
                        s.engine.record_resume()
            except SessionFailed:
                await s.detach()
                raise
            n += got

    async def _request(self, max_tokens: int, streamed: str, may_retry: bool,
                       may_reconnect: bool) -> AsyncGenerator[tuple[str, Any]]:
        """One streamed request: its events; or only ("busy", Retry-After) for a 429/503
        when ``may_retry``; or only ("stale", None) when ``may_reconnect`` and the
        connection broke before any answer (a kept-alive connection the server had
        dropped, as llama-cpp-python's server does after a failed request): the request
        never ran, so it is sent again, on a new connection."""
        s = self._session
        engine = s.engine
        url = engine.completions_url
        last: float | None = None
        answered = False
        try:
            async with engine.http.stream("POST", url, json=self._body(max_tokens, streamed)) as r:
                answered = True
                if r.status_code in (429, 503) and may_retry:
                    await r.aread()
                    yield "busy", r.headers.get("retry-after")
                    return
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")[:400]
                    raise SessionFailed(f"backend {url} answered HTTP {r.status_code}: "
                                        f"{text}")
                s.state = SessionState.PREFILLING
                async for line in r.aiter_lines():
                    doc = sse_data(line)
                    if doc is None:
                        continue
                    if "error" in doc:
                        raise SessionFailed(f"backend {url} failed mid-turn: {doc['error']}")
                    if isinstance(doc.get("usage"), dict):
                        yield "usage", doc["usage"]
                    for choice in doc.get("choices") or ():
                        text = choice.get("text") or ""
                        # A chunk is a token, its text empty for some (a control token, a
                        # partial UTF-8 character) — unless it is the one naming the finish.
                        if text or not choice.get("finish_reason"):
                            now = time.monotonic()
                            s.state = SessionState.DECODING
                            gap = None if last is None else now - last
                            if gap is not None:
                                s.decode_tps = _ewma(s.decode_tps, 1.0 / gap if gap else None)
                            engine.record_token(gap)
                            last = now
                            yield "text", text
                        if choice.get("finish_reason"):
                            yield "finish", choice["finish_reason"]
        except (httpx.HTTPError, ValueError) as exc:
            if may_reconnect and not answered and isinstance(exc, _STALE):
                yield "stale", None
                return
            hint = "" if last is not None else f" (before any token; {_no_token_hint(s)})"
            raise SessionFailed(f"backend {url} failed mid-turn: "
                                f"{type(exc).__name__}: {exc}{hint}") from exc


def _no_token_hint(s: RemoteSession) -> str:
    return ("its log says why; llama-cpp-python's server fails so when the prompt exceeds "
            f"its --n_ctx: this session holds {s.context_len} tokens")


def _retry_after(value: str | None) -> float:
    try:
        return min(5.0, max(0.1, float(value or 1)))
    except ValueError:
        return 1.0


def _ewma(old: float | None, new: float | None) -> float | None:
    if new is None:
        return old
    return new if old is None else old + _EWMA * (new - old)
