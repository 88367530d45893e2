"""How a pool is built (:class:`EngineConfig`) and how one turn samples
(:class:`SamplingParams`). Validation does no I/O and names the flag that fixes it."""

from __future__ import annotations

from dataclasses import dataclass

from mesh.engine.llama_rules import FLASH_ATTN_CONFLICT

__all__ = ["FLASH_ATTN", "KV_TYPES", "PREFIX_ATTENTION", "EngineConfig", "SamplingParams"]


FLASH_ATTN = ("auto", "on", "off")
PREFIX_ATTENTION = ("auto", "shared", "off")
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
    # auto | shared | off: decode rows attend the shared prefix together (mesh's patch to
    # llama.cpp's CPU flash-attention kernel). shared requires the patch and turns flash
    # attention on; off keeps llama.cpp's own path; auto: shared where the patch is built,
    # the pool runs on the CPU and the prefix is long enough, else off.
    prefix_attention: str = "auto"
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
        if self.prefix_attention not in PREFIX_ATTENTION:
            raise ValueError(f"prefix_attention must be one of {', '.join(PREFIX_ATTENTION)}, "
                             f"got {self.prefix_attention!r}")
        if self.prefix_attention == "shared" and self.flash_attn == "off":
            raise ValueError(FLASH_ATTN_CONFLICT)
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
    # Completion order: when the decode gate has room for fewer turns than wait, turns
    # with the lowest ``priority`` run first (and, shedding, are paused last); the agent
    # passes its task's start time, so turns of tasks already running go before a new
    # task's first turn. None: the session's attach time.
    priority: float | None = None

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
