"""The engine seam over an OpenAI-compatible ``/v1/completions`` API (``--engine openai:URL``).

vLLM, SGLang, llama-server, llama-cpp-python's server and mesh's own ``/v1/completions``
all serve it. :class:`OpenAIEngine` implements :class:`~mesh.engine.interface.Engine` on top:

* A session keeps its conversation **on mesh's side** (appended text plus generated text).
  Each turn sends one completion whose prompt is the immutable prefix text, byte-identical
  every time, then the session's history: exactly what those servers' prefix caches (vLLM's
  automatic prefix caching, SGLang's radix cache, llama.cpp's slot cache) need to hit.
* Streaming (SSE); stop strings are cut on mesh's side by the local pool's own
  :class:`~mesh.engine.session.TurnOutput` (they are not sent to the backend, whose rules
  differ), and the stream is closed at the match, which aborts the request there.
* ``load()`` is built from the streamed tokens: per-session decode tokens/s (EWMA of the
  gaps between chunks, first chunk excluded: that gap is the prefill) and one
  :class:`~mesh.engine.interface.StepSample` per gap (rows = sessions decoding then), so the
  gate's throughput model learns this backend as it learns the local pool. When the backend
  exposes ``/metrics`` (vLLM, llama-server, mesh), it is polled and
  :meth:`OpenAIEngine.backend_metrics` reports running/waiting requests, inter-token
  latency and KV use (``/capacity`` shows them under ``engine.backend``).
* A grammar (plans, tool calls) goes out in the field the backend reads: vLLM's
  ``structured_outputs.grammar``, SGLang's ``ebnf``, llama.cpp's ``grammar`` (by the
  model's ``owned_by`` in ``GET /v1/models``); vLLM ignores an unknown field silently.
* A backend that lists its context (vLLM's ``max_model_len``) must hold the prefix plus
  one full session, checked at start (else a session would fail mid-turn).
* Limits are mesh's: ``max_sessions`` sessions of ``session_budget`` tokens each; the
  backend's own scheduler does the batching and the KV cache.

No A2A and no Starlette here; the one HTTP client is httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from mesh.backends.remote_session import RemoteSession
from mesh.backends.remote_wire import (
    backend_counters,
    backend_gauges,
    check_context,
    grammar_fields,
    parse_prometheus,
)
from mesh.engine.interface import (
    AttachCheck,
    ModelError,
    PoolFull,
    PoolInfo,
    PoolLoad,
    PrefillBudget,
    SessionState,
    StepSample,
    TurnAdmission,
    TurnLine,
)

__all__ = ["BackendConfig", "OpenAIEngine"]

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
        self._info = PoolInfo(**{**self._info.__dict__, "build_s": time.monotonic() - t0})
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

    def load(self) -> PoolLoad:
        now = time.monotonic()
        rows = tuple(s.snapshot(now) for s in self.sessions.values())
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
        ms = step_s * 1000
        self._step_ms = ms if self._step_ms is None else self._step_ms + 0.2 * (ms - self._step_ms)
        self.turn_line.poke()

    def record_compaction(self, freed: int) -> None:
        """A session's history was compacted, dropping ``freed`` tokens of it."""
        self.compactions += 1
        self.compacted_cells += freed

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

    def request_body(self, prompt: str, **fields: Any) -> dict[str, Any]:
        """A streamed completion of ``prompt``; a ``grammar`` field goes out in the field
        this backend reads (:func:`~mesh.backends.remote_wire.grammar_fields`)."""
        grammar = fields.pop("grammar", None)
        if grammar is not None:
            fields.update(grammar_fields(self.owner, grammar))
        return {"model": self.model_id, "prompt": prompt, "stream": True,
                "stream_options": {"include_usage": True}, **fields}
