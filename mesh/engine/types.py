"""The engine's public vocabulary: configuration, sampling, load snapshots, errors.

Nothing here touches llama.cpp, so the gate, the worker and the HTTP layers can import
these types (and build honest fakes of the engine) without loading a model.

The seam itself is two protocols, :class:`Engine` and :class:`Session`:

* ``Engine.check_attach()`` answers whether a session can be attached *now* without
  mutating anything; ``Engine.attach()`` commits (check, then commit).
* ``Session.append(text)`` queues suffix text for prefill; it never blocks on the model.
* ``Session.generate(params)`` prefills whatever was appended, then streams the generated
  pieces. The returned :class:`Generation` is an async iterator of :class:`Piece`; when it
  is exhausted, ``Generation.result`` holds the :class:`TurnResult`. Generated tokens stay
  in the session's context, so the next ``append`` continues the conversation.
* ``Session.detach()`` frees the session's private KV cells; the shared prefix stays.
  Detaching twice is a no-op. A session whose decode failed is detached by the engine and
  its generation raises :class:`SessionFailed`.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

__all__ = [
    "AttachCheck",
    "ContextOverflow",
    "Engine",
    "EngineConfig",
    "EngineError",
    "Generation",
    "ModelError",
    "Piece",
    "PoolFull",
    "PoolInfo",
    "PoolLoad",
    "PrefillBudget",
    "SamplingParams",
    "Session",
    "SessionFailed",
    "SessionLoad",
    "SessionState",
    "StepSample",
    "TurnAdmission",
    "TurnResult",
]


# --------------------------------------------------------------------------- errors


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelError(EngineError):
    """The model file is missing, unreadable or not a GGUF llama.cpp can load."""


class PoolFull(EngineError):
    """No sequence id or not enough free KV cells for another session."""


class ContextOverflow(EngineError):
    """A session would grow past its context budget."""


class SessionFailed(EngineError):
    """The session cannot go on (a decode failed, it was detached, or the pool closed)."""


# --------------------------------------------------------------------------- config


FLASH_ATTN = ("auto", "on", "off")
KV_TYPES = ("f16", "q8_0", "q4_0")  # highest precision first


@dataclass(frozen=True)
class EngineConfig:
    """How the pool is built. Validation does no I/O; see :meth:`validate`.

    ``n_ctx`` is the KV buffer in cells, shared by the prefix and every session's private
    suffix; ``None`` sizes it as ``prefix + max_sessions * session_budget`` (rounded up).
    ``session_budget`` is the most private cells one session may hold (its context limit
    beyond the prefix).
    """

    model_path: str
    max_sessions: int = 16
    session_budget: int = 2048
    n_ctx: int | None = None
    n_threads: int | None = None  # None: every core
    n_batch: int = 512  # token budget of one decode step (decode tokens + prefill chunks)
    prefill_chunk: int = 256  # most prefix tokens decoded per call while building the prefix
    swa_full: bool = True  # full-size SWA cache, so a session can roll back safely
    seed: int = 0
    cache_dir: str | None = None  # where warm-start prefix snapshots live; None: no cache
    n_gpu_layers: int = -1  # layers to offload when llama.cpp was built with a GPU backend
    # llama.cpp's extra CPU buffer types (repacked weights, AMX). Off by default: the AMX
    # path segfaults on AMX-capable Xeons with llama-cpp-python 0.3.36.
    extra_buffers: bool = False
    # False is the baseline without a pool: every session prefills its own private copy
    # of the prefix (for comparisons; sizes n_ctx for max_sessions * (prefix + budget)).
    share_prefix: bool = True
    # The native step (native/: fill, llama_decode and sampling in one C call, GIL
    # released). None: use it when it is built, else say so once and run the Python step.
    native: bool | None = None
    flash_attn: str = "auto"  # auto | on | off (llama.cpp's flash attention)
    kv_type: str = "f16"  # f16 | q8_0 | q4_0: element type of the KV cache (K and V)
    # Sessions attached at once, resident in the cache or parked off it (an idle session
    # is parked when the pool needs its sequence id or cells, and re-prefilled before its
    # next turn). None: 4 x max_sessions; max_sessions: attach never parks.
    max_attached: int | None = None
    # Park a session idle this long even when no one needs the room (None: on demand only).
    park_idle_s: float | None = None
    # Host bytes for swapped suffixes: a parked session's private cells are copied to host
    # RAM (llama.cpp's per-sequence state, suffix cells only) and written back on resume,
    # exactly; past this bound (0: always) parking falls back to recompute.
    park_memory: int = 0

    @property
    def attached_limit(self) -> int:
        """``max_attached`` resolved."""
        return 4 * self.max_sessions if self.max_attached is None else self.max_attached

    def validate(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is empty; pass --model PATH or set MESH_MODEL")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if self.max_attached is not None and self.max_attached < self.max_sessions:
            raise ValueError(f"max_attached ({self.max_attached}) must be >= max_sessions "
                             f"({self.max_sessions}); pass --max-attached N or leave it unset")
        if self.park_memory < 0:
            raise ValueError(f"park_memory must be >= 0 bytes, got {self.park_memory}")
        if self.park_idle_s is not None and self.park_idle_s < 0:
            raise ValueError(f"park_idle_s must be >= 0 seconds, got {self.park_idle_s}")
        if self.session_budget < 16:
            raise ValueError(f"session_budget must be >= 16 tokens, got {self.session_budget}")
        if self.n_ctx is not None and self.n_ctx < 64:
            raise ValueError(f"n_ctx must be >= 64 cells, got {self.n_ctx}")
        if self.n_threads is not None and self.n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {self.n_threads}")
        if self.n_batch < self.max_sessions + 1:
            raise ValueError(
                f"n_batch ({self.n_batch}) must exceed max_sessions ({self.max_sessions}) "
                "so every decoding session fits in one step"
            )
        if not 1 <= self.prefill_chunk <= self.n_batch:
            raise ValueError(f"prefill_chunk must be in 1..n_batch, got {self.prefill_chunk}")
        if self.flash_attn not in FLASH_ATTN:
            raise ValueError(f"flash_attn must be one of {', '.join(FLASH_ATTN)}, "
                             f"got {self.flash_attn!r}")
        if self.kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {', '.join(KV_TYPES)}, "
                             f"got {self.kv_type!r}")
        if self.kv_type != "f16" and self.flash_attn == "off":
            raise ValueError(f"a {self.kv_type} KV cache needs flash attention "
                             "(llama.cpp quantizes V only with it); use --flash-attn auto|on "
                             "or --kv-type f16")


@dataclass(frozen=True)
class SamplingParams:
    """Per-turn sampling. ``temperature == 0`` is greedy (top_k/top_p are then unused)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None  # None: derived from the pool seed and the session id
    stop: tuple[str, ...] = ()
    stop_at_eos: bool = True
    # A GBNF grammar (llama.cpp's grammar format, root rule ``root``) every generated token
    # must follow; None: unconstrained. Applies to this turn's generated tokens only.
    grammar: str | None = None
    # Repetition control for prose (llama.cpp's penalties and DRY samplers), counted over
    # the prose tokens this turn generated (never the prompt): ``repeat_penalty`` > 1
    # divides the logit of each token of the last ``repeat_last_n`` (1.0: off);
    # ``presence_penalty``/``frequency_penalty`` subtract (0: off); ``dry_multiplier`` > 0
    # penalizes continuing a sequence already written, by dry_multiplier * dry_base **
    # (length - dry_allowed_length). Defaults: all off (mesh.worker.text.PROSE sets them).
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_last_n: int = 512  # DRY looks this far back for an earlier copy of the sequence
    # Which tokens are prose. Without a grammar: all of them. Under a grammar, structure
    # (tags, call syntax, JSON keys) is never penalized: prose runs from the turn's start
    # when ``prose_first``, and after any of ``prose_open``, until the character
    # ``prose_close``; with neither, a grammar turn gets no repetition control.
    prose_open: tuple[str, ...] = ()
    prose_close: str = ""
    prose_first: bool = False

    @property
    def repetition(self) -> bool:
        """Whether any repetition control is on (and has prose to act on)."""
        on = (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
              or self.frequency_penalty != 0.0 or self.dry_multiplier > 0.0)
        return on and (self.grammar is None or self.prose_first or bool(self.prose_open))

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.grammar is not None and not self.grammar.strip():
            raise ValueError("grammar is empty; pass None for unconstrained sampling")
        if not 1.0 <= self.repeat_penalty <= 2.0:
            raise ValueError(f"repeat_penalty must be in [1, 2] (1: off), "
                             f"got {self.repeat_penalty}")
        if not 1 <= self.repeat_last_n <= 4096:
            raise ValueError(f"repeat_last_n must be in 1..4096, got {self.repeat_last_n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0: off), got {getattr(self, name)}")
        if not 0.0 <= self.dry_multiplier <= 5.0:
            raise ValueError(f"dry_multiplier must be in [0, 5] (0: off), "
                             f"got {self.dry_multiplier}")
        if not 1.0 < self.dry_base <= 4.0:
            raise ValueError(f"dry_base must be in (1, 4], got {self.dry_base}")
        if not 1 <= self.dry_last_n <= 8192:
            raise ValueError(f"dry_last_n must be in 1..8192, got {self.dry_last_n}")
        if self.dry_allowed_length < 1:
            raise ValueError(f"dry_allowed_length must be >= 1, got {self.dry_allowed_length}")
        if len(self.prose_close) > 1:
            raise ValueError(f"prose_close must be one character or empty, "
                             f"got {self.prose_close!r}")
        if any(not o for o in self.prose_open):
            raise ValueError("prose_open strings must be non-empty")


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Piece:
    """One generated token and the text it released.

    ``text`` may be empty (mid-UTF-8 character, or held back as a possible start of a stop
    string). Held text released when a turn ends without a token of its own (``eos``,
    ``context_full``, ``cancelled``) comes as a last piece with ``token == -1``. The pieces'
    texts always join to ``TurnResult.text``.
    """

    token: int
    text: str


@dataclass(frozen=True)
class TurnResult:
    """How a turn ended.

    ``finish_reason`` is one of ``stop`` (a stop string matched: ``stop`` names it, and no
    part of it is in ``text``), ``eos`` (the model ended its turn), ``length``
    (``max_tokens`` reached), ``context_full`` (the session's budget or the KV buffer has no
    room for another token) or ``cancelled`` (the consumer stopped early). Only ``stop`` and
    ``eos`` are turns the model finished; the others were cut.
    """

    text: str
    num_prompt_tokens: int
    num_generated: int
    finish_reason: str
    decode_s: float
    stop: str | None = None
    # Seconds the turn waited for the decode gate before its first step (turn-start
    # latency; 0.0 where no gate runs or the turn was admitted at once).
    wait_s: float = 0.0


@dataclass(frozen=True)
class AttachCheck:
    """Answer of :meth:`Engine.check_attach`: ``ok`` or the reason it would be refused."""

    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class PoolInfo:
    """Facts learned when the pool was built; immutable for the pool's life."""

    model_path: str
    model_name: str
    n_ctx: int
    n_seq_max: int
    max_sessions: int
    session_budget: int
    n_vocab: int
    prefix_tokens: int
    prefix_hash: str  # sha256 of the prefix token ids
    warm_started: bool
    build_s: float
    # Which engine runs the sessions: "llama.cpp" (the local pool) or "openai:URL" (a
    # serving cluster behind an OpenAI-compatible API, mesh.backends.openai).
    engine: str = "llama.cpp"
    n_params: int = 0  # the model's parameter count; 0 where the engine cannot tell


# --------------------------------------------------------------------------- load


class SessionState(enum.StrEnum):
    PREFILLING = "prefilling"  # has appended text not yet decoded
    DECODING = "decoding"  # generating tokens
    IDLE = "idle"  # waiting for input (a tool call, the next turn)
    WAITING = "waiting"  # a turn was asked for; the decode gate has not let it run yet


@dataclass(frozen=True)
class SessionLoad:
    """One session in a :class:`PoolLoad` snapshot."""

    id: str
    state: SessionState
    private_cells: int  # suffix cells this session owns (appended + generated)
    context_len: int  # prefix + private cells: what attention reads per token
    decode_tps: float | None  # EWMA of this session's decode tokens/s; None until measured
    duty_cycle: float | None  # observed share of wall time spent prefilling or decoding
    age_s: float
    num_generated: int
    parked: bool = False  # its private cells are off the cache (re-prefilled on resume)


@dataclass(frozen=True)
class StepSample:
    """Timing of one engine step, for the gate's online throughput model."""

    num_decode: int  # sessions that decoded a token in the step
    num_prefill_tokens: int
    sum_context: int  # Σ context_len of the decoding sessions
    step_s: float  # wall time of the whole step (host work + llama_decode)
    # Cells in use in the whole cache during the step (prefix + every session's private
    # cells, idle sessions' included): with one unified cache every decoding row attends
    # over all of them (masked), so step time grows with num_decode × cells_used.
    cells_used: int = 0


@dataclass(frozen=True)
class PoolLoad:
    """A consistent snapshot of the pool, taken between steps. Pure data."""

    taken_at: float  # time.monotonic() of the snapshot
    sessions: tuple[SessionLoad, ...]
    step_ms: float | None  # EWMA of step wall time
    agg_tps: float  # decode tokens/s over the recent window, all sessions
    cells_used: int  # prefix + Σ private cells
    cells_total: int  # n_ctx
    prefix_cells: int
    naive_cells: int  # what the same sessions would hold with a private prefix copy each
    free_seq_ids: int
    max_sessions: int
    session_budget: int
    recent_steps: tuple[StepSample, ...] = field(default_factory=tuple)
    # Totals since the pool started (0 where an engine does not count them): sessions that
    # attached, and suffix tokens prefilled in steps (appended text, tool results; with a
    # private prefix per session, the prefix copies too). Deltas of the two, with
    # prefix_cells, say what the shared prefix saved: prefix × sessions not prefilled.
    sessions_attached: int = 0
    prefill_tokens: int = 0
    # Parking (0 where an engine does not park): attached sessions allowed at once
    # (resident + parked), the suffix tokens parked sessions hold off the cache, and since
    # start: parks, resumes and the suffix tokens resumes re-prefilled (their recompute;
    # a swapped resume re-prefills none).
    max_attached: int = 0
    parked_tokens: int = 0
    parks: int = 0
    resumes: int = 0
    resume_tokens: int = 0
    parked_bytes: int = 0  # host RAM held by swapped suffixes (at most park_memory)
    swaps: int = 0  # parks that swapped (the rest recompute on resume)

    @property
    def num_parked(self) -> int:
        return sum(1 for s in self.sessions if s.parked)

    @property
    def num_resident(self) -> int:
        """Attached sessions whose cells are in the cache (they hold a sequence id)."""
        return len(self.sessions) - self.num_parked

    @property
    def attach_room(self) -> int:
        """Sessions that may still attach: free sequence ids, or with parking on, the
        attached limit left (cells aside)."""
        if self.max_attached > self.max_sessions:
            return max(0, self.max_attached - len(self.sessions))
        return self.free_seq_ids

    @property
    def reduction(self) -> float:
        """naive / pooled cell count (1.0 with no sessions)."""
        if not self.sessions or not self.cells_used:
            return 1.0
        return self.naive_cells / self.cells_used

    @property
    def cells_free(self) -> int:
        return self.cells_total - self.cells_used

    def count(self, state: SessionState) -> int:
        return sum(1 for s in self.sessions if s.state is state)


# --------------------------------------------------------------------------- seams


class PrefillBudget(Protocol):
    """How many prefill tokens a step may carry next to ``num_decode`` decoding rows while
    ``cells_used`` cells are in use, so the step stays within what the floor allows.

    Pure and cheap: the engine thread calls it once per step. The pool never asks it when
    nothing is decoding (such a step takes the full ``n_batch``).
    """

    def __call__(self, num_decode: int, cells_used: int) -> int: ...


class TurnAdmission(Protocol):
    """The decode gate: how many more turns may start running in the next step.

    A turn *runs* from the first step that prefills or decodes for it until it ends; a
    turn that was asked for (``generate``) but does not run yet *waits*, first come first
    served, with its session's cells kept. ``num_running`` turns run now, over
    ``cells_used`` cells; ``recent`` are the last measured steps (oldest first). Pure and
    cheap: the engine thread asks it once per step while a turn waits. The pool always
    lets one turn run when none does (progress).
    """

    def turn_room(self, num_running: int, cells_used: int,
                  recent: Sequence[StepSample]) -> int: ...


@runtime_checkable
class Generation(Protocol):
    """Async iterator of :class:`Piece`; ``result`` is set once it is exhausted."""

    result: TurnResult | None

    def __aiter__(self) -> AsyncIterator[Piece]: ...

    async def aclose(self) -> None:
        """Stop generating early (the tokens so far stay in the session)."""


@runtime_checkable
class Session(Protocol):
    id: str

    @property
    def context_len(self) -> int: ...

    def append(self, text: str) -> None:
        """Queue suffix text; raises ContextOverflow if it cannot fit the budget."""

    def generate(self, params: SamplingParams) -> Generation:
        """Prefill what was appended, then stream up to ``params.max_tokens`` pieces."""

    async def detach(self) -> None:
        """Free this session's private cells. Idempotent."""


@runtime_checkable
class Engine(Protocol):
    @property
    def info(self) -> PoolInfo: ...

    def check_attach(self) -> AttachCheck:
        """Would ``attach`` succeed now? Pure read; mutates nothing."""

    async def attach(self) -> Session:
        """Share the prefix with a new session; raises PoolFull with the reason."""

    def load(self) -> PoolLoad:
        """A snapshot for the gate and ``/capacity``."""

    def count_tokens(self, text: str) -> int:
        """How many tokens ``text`` is (no BOS), for budgeting."""

    async def aclose(self) -> None:
        """Stop the engine thread and free every native handle."""
