"""``--engine openai:URL``: an OpenAI-compatible server (vLLM, SGLang, llama-server,
llama-cpp-python's server, another mesh) as the engine, over its ``/v1/completions`` API:
what is read off the wire (pure: the engine spec, SSE events, ``/metrics``), a remote
session, and :class:`OpenAIEngine` over them. docs/vllm.md says what a session sends, the
backend's flags, and what the gate reads. httpx is the one HTTP client.

* A session keeps its conversation on mesh's side; each turn sends one streamed completion
  whose prompt is the prefix text, byte-identical every time, then the session's history.
* The rules mirror the local pool's (:mod:`mesh.engine.interface`): ``append`` never waits
  and raises :class:`~mesh.engine.interface.ContextOverflow` past the budget; stop strings
  are cut on mesh's side by the pool's :class:`~mesh.engine.session.TurnOutput`; a backend
  that fails mid-turn detaches the session (:class:`~mesh.engine.interface.SessionFailed`).
* A stream that ends without a ``finish_reason`` after a chunk was cut by the backend
  (llama-cpp-python's server cuts one when another request arrives): the turn is resumed
  with one more request continuing after the text streamed so far. A stream that ends with
  no chunk at all is a failure (that server ends one so past its context).
* ``load()`` is built from the streamed tokens (EWMA decode tokens/s per session, one
  :class:`~mesh.engine.interface.StepSample` per gap between chunks, the prefill excluded);
  ``/metrics`` is polled for :meth:`OpenAIEngine.backend_metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import math
import re
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import httpx

from mesh.engine.config import SamplingParams
from mesh.engine.interface import (
    AttachCheck,
    ContextOverflow,
    ModelError,
    Piece,
    PoolFull,
    PoolInfo,
    PoolLoad,
    PrefillBudget,
    SessionFailed,
    SessionLoad,
    SessionState,
    StepSample,
    TurnAdmission,
    TurnLine,
    TurnResult,
)
from mesh.engine.session import TurnOutput

__all__ = [
    "BackendConfig", "OpenAIEngine", "RemoteGeneration", "RemoteSession", "backend_counters",
    "backend_gauges", "check_context", "grammar_fields", "parse_engine_spec", "parse_prometheus",
    "sse_data"
]


# -------------------- the wire ------------------------------------------------

ENGINE_LOCAL = "llama.cpp"
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_engine_spec(spec: str) -> str | None:
    """``--engine`` value → the backend's base URL, or None for the local pool.

    ``llama.cpp`` (or ``local``) is the local pool; ``openai:URL`` is an OpenAI-compatible
    server at URL (``http://host:port``, with or without a trailing ``/v1``). Raises
    ``ValueError`` naming the fix.
    """
    if spec in (ENGINE_LOCAL, "local"):
        return None
    if not spec.startswith("openai:"):
        raise ValueError(f"--engine must be 'llama.cpp' or 'openai:URL', got {spec!r}")
    url = spec.removeprefix("openai:").rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--engine openai:URL needs an absolute http(s) URL, got {url!r}")
    return url.removesuffix("/v1")


def sse_data(line: str) -> dict[str, Any] | None:
    """The JSON object of one ``data: {...}`` SSE line; None for anything else (comments,
    blank lines, ``[DONE]``, other fields). A ``data:`` line that is not JSON raises
    ``ValueError`` (the backend broke the stream)."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return None
    doc = json.loads(payload)
    if not isinstance(doc, dict):
        raise ValueError(f"SSE data is not a JSON object: {payload[:80]!r}")
    return doc


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text → ``{name: value}``, samples of one name with several label sets
    summed (a backend serving one model reports one set; summing is right for counts)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if math.isfinite(value):
            out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def _mean(metrics: Mapping[str, float], histogram: str) -> float | None:
    """A Prometheus histogram's mean (``_sum`` over ``_count``), None without samples."""
    n, total = metrics.get(histogram + "_count"), metrics.get(histogram + "_sum")
    return total / n if n and total is not None else None


def backend_gauges(metrics: Mapping[str, float]) -> dict[str, float | None]:
    """The few numbers the gate's readers want, from vLLM's, llama-server's or mesh's own
    metric names (whichever the backend exposes; absent ones are None)."""

    def first(*names: str) -> float | None:
        return next((metrics[n] for n in names if n in metrics), None)

    itl = _mean(metrics, "vllm:time_per_output_token_seconds")
    if itl is None:
        itl = _mean(metrics, "vllm:inter_token_latency_seconds")
    tps = first("llamacpp:predicted_tokens_seconds", "mesh_session_tps_p50")
    if tps is None and itl:
        tps = 1.0 / itl
    return {
        "running": first("vllm:num_requests_running", "llamacpp:requests_processing"),
        "waiting": first("vllm:num_requests_waiting", "llamacpp:requests_deferred",
                         "mesh_gate_queue_length"),
        "inter_token_s": itl,
        "decode_tps": tps,
        "kv_usage": first("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                          "llamacpp:kv_cache_usage_ratio"),
    }


def backend_counters(metrics: Mapping[str, float]) -> dict[str, float]:
    """The backend's prefix-cache counters since it started, where it counts them (vLLM:
    ``vllm:prefix_cache_queries_total`` / ``hits_total``, in prompt tokens), and the hit
    rate they give: how much of every prompt mesh sent was served from the cache."""
    out: dict[str, float] = {}
    queries = metrics.get("vllm:prefix_cache_queries_total")
    hits = metrics.get("vllm:prefix_cache_hits_total")
    if queries is not None and hits is not None:
        out = {"prefix_cache_queries": queries, "prefix_cache_hits": hits}
        if queries > 0:
            out["prefix_cache_hit_rate"] = hits / queries
    return out


def grammar_fields(owner: str | None, grammar: str) -> dict[str, Any]:
    """The request field that carries a GBNF ``grammar`` to a backend, by who serves the
    model (``owned_by`` in its ``GET /v1/models``). vLLM reads ``structured_outputs.grammar``
    (xgrammar takes GBNF) and silently ignores llama.cpp's ``grammar`` field, so a plan or a
    tool call would go unconstrained there; SGLang reads ``ebnf``; llama.cpp's servers and
    mesh read ``grammar``."""
    if owner == "vllm":
        return {"structured_outputs": {"grammar": grammar}}
    if owner == "sglang":
        return {"ebnf": grammar}
    return {"grammar": grammar}


def check_context(url: str, model_id: str | None, n_prefix: int, session_budget: int,
                  max_model_len: object) -> None:
    """A backend that says its context (vLLM: ``max_model_len`` in ``/v1/models``) must
    hold the prefix plus one full session; otherwise a session would fail mid-turn (HTTP
    400) once it grows past it, so refuse at start, naming the fix (``ModelError``)."""
    if not isinstance(max_model_len, int) or max_model_len <= 0:
        return
    need = n_prefix + session_budget
    if need > max_model_len:
        raise ModelError(
            f"{url} serves {model_id!r} with a context of {max_model_len} tokens; mesh "
            f"needs the {n_prefix}-token prefix plus a {session_budget}-token session = "
            f"{need}: start the backend with a longer context (vLLM: --max-model-len "
            f"{need}) or lower --session-budget to {max_model_len - n_prefix} or less")

# -------------------- remote sessions -----------------------------------------

_BUSY_RETRIES = 3  # a 429/503 from the backend is retried this often (Retry-After, ≤ 5 s)
_EWMA = 0.2
_STALE = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class RemoteSession:
    """One session on the backend (see the module docstring)."""

    def __init__(self, engine: OpenAIEngine, sid: str) -> None:
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
            raise ContextOverflow(f"appending {n} tokens would exceed session {self.id}'s "
                                  f"budget of {budget} tokens")
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
        self.engine.compactions += 1
        self.engine.compacted_cells += self.private
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

    def snapshot(self, now: float, turn_place: int | None = None) -> SessionLoad:
        age = now - self.created
        busy = self.busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        return SessionLoad(
            id=self.id, state=self.state, private_cells=self.private + self.pending_tokens,
            context_len=self.context_len, decode_tps=self.decode_tps,
            duty_cycle=busy / age if age > 0 else None, age_s=age,
            num_generated=self.num_generated, turn_place=turn_place)


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
            fields.update(grammar_fields(s.engine.owner, p.grammar))
        # The prefix first, byte-identical every turn, then this session's history (and,
        # resuming a cut stream, what this turn streamed before the cut).
        prompt = s.engine.prefix_text + s.history + s.pending + streamed
        return {"model": s.engine.model_id, "prompt": prompt, "stream": True,
                "stream_options": {"include_usage": True}, **fields}

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
        priority = s.created if self._params.priority is None else self._params.priority
        try:
            await s.engine.turn_line.enter(priority, s.id)  # completion order, as the pool
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

# -------------------- the engine ----------------------------------------------

logger = logging.getLogger(__name__)
Tokenize = Callable[[str], list[int]]
_RATE_WINDOW_S = 5.0
_METRICS_EVERY_S = 2.0


@dataclass(frozen=True)
class BackendConfig:
    """How to reach the backend and what mesh allows on it."""

    url: str  # base URL, without /v1
    model: str | None = None  # the model id to request; None: the first of GET /v1/models
    max_sessions: int = 16
    session_budget: int = 2048
    api_key: str | None = None
    timeout_s: float = 300.0
    poll_metrics: bool = True
    warm_prefix: bool = True  # send the prefix once at start so the backend caches it

    def validate(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"backend URL must be absolute http(s), got {self.url!r}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if self.session_budget < 16:
            raise ValueError(f"session_budget must be >= 16 tokens, got {self.session_budget}")


class OpenAIEngine:
    """:class:`~mesh.engine.interface.Engine` over a remote completions API (module docstring).

    ``tokenize`` (the same model's tokenizer, no BOS) counts tokens for budgets and the
    prefix hash; without it a token is estimated as 4 characters and the hash is taken over
    the prefix text's bytes (then only mesh nodes built the same way compare equal).
    ``prefix_ids`` are the prefix's token ids as the local pool would decode them (BOS
    included), so the card's prefix hash equals a local pool's on the same model.
    """

    def __init__(
        self,
        config: BackendConfig,
        prefix_text: str,
        *,
        tokenize: Tokenize | None = None,
        prefix_ids: list[int] | None = None,
        http: httpx.AsyncClient | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        config.validate()
        self._on_close = on_close
        self.config = config
        self.prefix_text = prefix_text
        self._tokenize = tokenize
        self._prefix_ids = prefix_ids
        # One client for the engine's life (mesh serve starts and serves it on one loop):
        # the given one, or one made on first use and closed by aclose.
        self._owns_http = http is None
        self._http = http
        self._closed = False
        self.sessions: dict[str, RemoteSession] = {}
        self.resumed_streams = 0  # streams the backend cut without a finish reason
        self.compactions = 0  # Session.compact calls, and the history tokens they dropped
        self.compacted_cells = 0
        self.recent: deque[StepSample] = deque(maxlen=64)
        # The decode gate holds turns here, before their request goes out.
        self.turn_line = TurnLine(lambda: self.load().cells_used, lambda: tuple(self.recent))
        self._rate: deque[tuple[float, int]] = deque()
        self._step_ms: float | None = None
        self._info: PoolInfo | None = None
        self._ids = itertools.count(1)
        self._metrics: dict[str, float | None] | None = None
        self._metrics_task: asyncio.Task[None] | None = None
        self.model_id = config.model or ""
        self.owner: str | None = None  # the model's owned_by (vllm, sglang, llamacpp, ...)

    # ------------------------------------------------------------------ life

    @property
    def info(self) -> PoolInfo:
        if self._info is None:
            raise RuntimeError("the engine is not started; await engine.start() first")
        return self._info

    @property
    def http(self) -> httpx.AsyncClient:
        """The engine's one HTTP client (RuntimeError once closed)."""
        if self._closed:
            raise RuntimeError("the engine is closed (aclose was called); build a new "
                               "OpenAIEngine to reach the backend")
        if self._http is None:
            cfg = self.config
            headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
            self._http = httpx.AsyncClient(
                headers=headers, timeout=httpx.Timeout(cfg.timeout_s, connect=10.0))
        return self._http

    @property
    def completions_url(self) -> str:
        return self.config.url + "/v1/completions"

    async def start(self, progress: Callable[[int, int], None] | None = None) -> PoolInfo:
        """Reach the backend (``GET /v1/models``), pick the model, send the prefix once."""
        t0 = time.monotonic()
        try:
            r = await self.http.get(self.config.url + "/v1/models")
            r.raise_for_status()
            listed = [m for m in r.json().get("data", []) if m.get("id")]
            models = [str(m["id"]) for m in listed]
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise ModelError(
                f"cannot list models at {self.config.url}/v1/models ({exc}); is the "
                "OpenAI-compatible server running there? (--engine openai:URL)") from exc
        if not self.model_id:
            if not models:
                raise ModelError(f"{self.config.url} serves no model; pass its id")
            self.model_id = models[0]
        elif models and self.model_id not in models:
            raise ModelError(f"{self.config.url} does not serve {self.model_id!r}; it "
                             f"serves {', '.join(models)}")
        mine = [m for m in listed if str(m["id"]) == self.model_id]
        self.owner = str(mine[0]["owned_by"]) if mine and mine[0].get("owned_by") else None
        n_prefix = len(self._prefix_ids) if self._prefix_ids is not None else (
            self.count_tokens(self.prefix_text))
        check_context(self.config.url, self.model_id, n_prefix, self.config.session_budget,
                      mine[0].get("max_model_len") if mine else None)
        if self._prefix_ids is not None:
            digest = hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in self._prefix_ids))
        else:
            digest = hashlib.sha256(self.prefix_text.encode())
        cfg = self.config
        self._info = PoolInfo(
            model_path=f"openai:{cfg.url}", model_name=self.model_id,
            n_ctx=n_prefix + cfg.max_sessions * cfg.session_budget,
            n_seq_max=cfg.max_sessions + 1, max_sessions=cfg.max_sessions,
            session_budget=cfg.session_budget, n_vocab=0, prefix_tokens=n_prefix,
            prefix_hash=digest.hexdigest(), warm_started=False, build_s=0.0,
            engine=f"openai:{cfg.url}")
        if cfg.warm_prefix:
            await self._warm()
        if progress is not None:
            progress(n_prefix, n_prefix)
        self._info = replace(self._info, build_s=time.monotonic() - t0)
        if cfg.poll_metrics and self._metrics_task is None:
            # Held for the engine's life (the loop keeps weak refs only); aclose cancels it.
            self._metrics_task = asyncio.get_running_loop().create_task(self._poll_metrics())
        return self._info

    async def _warm(self) -> None:
        """One 1-token completion of the prefix (and a newline: some servers, mesh's own
        among them, refuse an empty turn after it), so the backend's prefix cache holds it."""
        body = {"model": self.model_id, "prompt": self.prefix_text + "\n", "max_tokens": 1,
                "temperature": 0.0}
        try:
            r = await self.http.post(self.completions_url, json=body)
        except httpx.HTTPError as exc:
            raise ModelError(f"{self.completions_url} did not answer: {exc}") from exc
        if r.status_code >= 400:
            raise ModelError(f"{self.completions_url} refused the prefix: HTTP "
                             f"{r.status_code} {r.text[:300]}")

    async def _poll_metrics(self) -> None:
        url = self.config.url + "/metrics"
        while True:
            try:
                r = await self.http.get(url, timeout=5.0)
                if r.status_code == 404:
                    return  # no metrics endpoint: the streamed tokens are all there is
                if r.status_code == 200:
                    found = parse_prometheus(r.text)
                    self._metrics = {**backend_gauges(found), **backend_counters(found)}
            except httpx.HTTPError:
                self._metrics = None
            await asyncio.sleep(_METRICS_EVERY_S)

    def backend_metrics(self) -> dict[str, float | None] | None:
        """The backend's own gauges from its last ``/metrics`` scrape (None: none yet).
        Polling runs from :meth:`start` to :meth:`aclose`."""
        return self._metrics

    async def aclose(self) -> None:
        """Detach the sessions, stop the metrics poll, close an owned client (a given one
        is its owner's to close). Idempotent."""
        for s in list(self.sessions.values()):
            await s.detach()
        self._closed = True
        task, self._metrics_task = self._metrics_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        http, self._http = self._http, None
        if http is not None and self._owns_http:
            await http.aclose()
        if self._on_close is not None:
            self._on_close()
            self._on_close = None

    # ------------------------------------------------------------------ the seam

    def check_attach(self) -> AttachCheck:
        if self._info is None:
            return AttachCheck(False, "the engine is not started")
        if len(self.sessions) >= self.config.max_sessions:
            return AttachCheck(False, f"all {self.config.max_sessions} session slots are "
                                      "in use")
        return AttachCheck(True)

    async def attach(self) -> RemoteSession:
        check = self.check_attach()
        if not check.ok:
            raise PoolFull(check.reason)
        session = RemoteSession(self, f"r{next(self._ids)}")
        self.sessions[session.id] = session
        return session

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` with the configured tokenizer (no BOS)."""
        if self._tokenize is None:
            raise RuntimeError("no tokenizer configured for this backend")
        return self._tokenize(text)

    def count_tokens(self, text: str) -> int:
        if self._tokenize is not None:
            return len(self._tokenize(text))
        return -(-len(text) // 4)

    def set_prefill_budget(self, budget: PrefillBudget | None) -> None:
        """Ignored: the backend schedules its own prefill (chunked or not)."""

    def set_turn_admission(self, gate: TurnAdmission | None) -> None:
        """The decode gate: a turn's request goes out once the gate has room for it, as
        measured on the streamed steps (``recent``)."""
        self.turn_line.gate = gate

    def turn_place(self, session_id: str) -> int | None:
        return self.turn_line.place(session_id)

    def load(self) -> PoolLoad:
        now = time.monotonic()
        places = self.turn_line.places()
        rows = tuple(s.snapshot(now, places.get(s.id)) for s in self.sessions.values())
        prefix = self.info.prefix_tokens
        private = sum(r.private_cells for r in rows)
        return PoolLoad(
            taken_at=now, sessions=rows, step_ms=self._step_ms, agg_tps=self._agg_tps(now),
            cells_used=prefix + private, cells_total=self.info.n_ctx, prefix_cells=prefix,
            naive_cells=private + prefix * len(rows),
            free_seq_ids=self.config.max_sessions - len(rows),
            max_sessions=self.config.max_sessions,
            session_budget=self.config.session_budget, recent_steps=tuple(self.recent),
            compactions=self.compactions, compacted_cells=self.compacted_cells)

    # ------------------------------------------------------------------ measuring

    def record_token(self, gap_s: float | None, n: int = 1) -> None:
        """A session received ``n`` streamed tokens ``gap_s`` after its previous chunk
        (None: its first chunk, whose gap is the prefill and is not a decode step)."""
        now = time.monotonic()
        self._rate.append((now, n))
        if gap_s is None or gap_s <= 0:
            return
        decoding = [s for s in self.sessions.values() if s.state is SessionState.DECODING]
        step_s = gap_s / max(1, n)
        self.recent.append(StepSample(
            num_decode=max(1, len(decoding)), num_prefill_tokens=0,
            sum_context=sum(s.context_len for s in decoding), step_s=step_s,
            cells_used=self.info.prefix_tokens + sum(s.private for s in self.sessions.values())))
        self._step_ms = _ewma(self._step_ms, step_s * 1000)
        self.turn_line.poke()

    def record_resume(self) -> None:
        """A stream was cut without a finish reason and is being resumed (logged once)."""
        self.resumed_streams += 1
        if self.resumed_streams == 1:
            logger.warning(
                "backend %s cut a stream without a finish_reason (another request "
                "arrived?); resuming it costs a new request each time; llama-cpp-python's "
                "server: start it with --interrupt_requests False", self.config.url)

    def _agg_tps(self, now: float) -> float:
        while self._rate and self._rate[0][0] < now - _RATE_WINDOW_S:
            self._rate.popleft()
        span = now - self._rate[0][0] if len(self._rate) > 1 else 0.0
        return sum(n for _, n in self._rate) / span if span > 0 else 0.0
