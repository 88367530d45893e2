"""How a pool is configured and what llama.cpp requires of that configuration. Pure
Python, no ``llama_cpp`` import: testable alone. Read top to bottom:

**What llama.cpp requires.** :data:`KV_GGML_TYPE` (ggml's type ids of the KV cache types
mesh offers), :func:`kv_shape_from_meta` (a model's KV shape from its GGUF metadata),
:func:`batch_problem` (the batch shapes ``llama_decode`` would abort the process on; the
adapter, :class:`mesh.engine.llama.LlamaContext`, raises ValueError instead), and what
``--flash-attn`` and ``--prefix-attention`` resolve to (:func:`resolve_flash_attn`,
:func:`resolve_prefix_attention`; the measured FA table: :data:`FA_ON_VS_OFF`).

**The configuration.** How a pool is built (:class:`EngineConfig`) and how one turn samples
(:class:`SamplingParams`). Validation does no I/O and names the flag that fixes it.

**The KV tier.** Given the memory the KV cache may take, its element type and the number of
session slots that fit. A KV cell costs, per layer, K and V elements of the cache's type:
f16 2 bytes, q8_0 34 bytes per 32 elements, q4_0 18 per 32 (ggml's block sizes). With
``swa_full`` every layer keeps full-size caches, so ``layers * (k + v) * bytes`` is the cost
of one cell. The pool needs ``prefix + sessions * session_budget`` cells; a naive server
(every session with its own copy of the prefix) needs ``sessions * (prefix + session_budget)``.

Rule: the highest-precision type (f16, then q8_0, then q4_0) at which ``want_sessions``
sessions fit; its slots are all that fit, up to ``cap``. If even q4_0 does not hold
``want_sessions``, q4_0 with as many as fit; if not one session fits, ValueError.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "FA_ON_VS_OFF", "FLASH_ATTN", "FLASH_ATTN_CONFLICT", "KV_GGML_TYPE", "KV_TYPES",
    "PREFIX_ATTENTION", "PREFIX_ATTENTION_NOT_BUILT", "TYPICAL_SUFFIX", "EngineConfig", "KVShape",
    "SamplingParams", "Tier", "batch_problem", "choose_tier", "elements_per_block", "fa_on_vs_off",
    "kv_shape_from_meta", "resolve_flash_attn", "resolve_prefix_attention"
]


# -------------------- what llama.cpp requires ---------------------------------

KV_GGML_TYPE = {"f16": 1, "q4_0": 2, "q8_0": 8}  # ggml.h's enum ggml_type


def kv_shape_from_meta(meta: Callable[[str], str | None]) -> tuple[int, int, int, int, int]:
    """(layers, KV heads, K and V elements per head, training context) read through
    ``meta`` (GGUF key -> value text, None when absent)."""
    arch = meta("general.architecture") or ""

    def num(key: str, default: int = 0) -> int:
        value = meta(f"{arch}.{key}")
        try:
            return int(value) if value is not None else default
        except ValueError:  # a per-layer array: not handled, use the default
            return default

    layers, embd = num("block_count"), num("embedding_length")
    heads = num("attention.head_count")
    kv_heads = num("attention.head_count_kv", heads)
    head = embd // heads if heads else 0
    k, v = num("attention.key_length", head), num("attention.value_length", head)
    return layers, kv_heads, k, v, num("context_length")


def batch_problem(n_tokens: int, n_outputs: int, max_seq: int, *, n_batch: int,
                  n_outputs_max: int, n_seq_max: int) -> str | None:
    """Why llama.cpp would abort on this batch shape (None: it is safe to decode)."""
    if n_tokens == 0:
        return "empty batch"
    if n_tokens > n_batch:
        return f"batch of {n_tokens} tokens exceeds n_batch {n_batch}"
    if n_outputs > n_outputs_max:
        return f"batch asks for {n_outputs} output rows; n_outputs_max is {n_outputs_max}"
    if max_seq >= n_seq_max:
        return f"sequence id {max_seq} >= n_seq_max {n_seq_max}"
    return None


# --flash-attn auto on a CPU with an f16 cache: step time with flash attention on divided by
# the step with it off (< 1: on is faster), per (prefix tokens, decoding rows). From
# bench/prefix_attention/results/prefix_attention.json ("best", the f16 rows'
# ``fa_on_vs_off``; SmolLM2-135M Q4_1, 2 threads, 64-token suffix per row, median of 3
# steps). FA off wins at 8K with 8+ rows and at 4K with 32 (its non-flash matrix product
# reads the prefix once a step, the CPU flash kernel once a row).
FA_ON_VS_OFF_PREFIXES = (1024, 2048, 4096, 8192)
FA_ON_VS_OFF_ROWS = (1, 8, 32)
FA_ON_VS_OFF = (  # one row per prefix above; columns: the rows above
    (0.853, 0.883, 0.749),
    (0.902, 0.967, 0.881),
    (0.853, 0.986, 1.090),
    (0.835, 1.103, 1.314),
)


def _bracket(axis: tuple[int, ...], value: float) -> tuple[int, float]:
    """Index ``i`` and weight ``t`` in [0, 1] placing ``value`` between ``axis[i]`` and
    ``axis[i + 1]`` on a log2 scale; clamped to the measured range (the edge holds)."""
    x = math.log2(min(max(value, axis[0]), axis[-1]))
    for i in range(len(axis) - 1):
        lo, hi = math.log2(axis[i]), math.log2(axis[i + 1])
        if x <= hi:
            return i, (x - lo) / (hi - lo)
    return len(axis) - 2, 1.0


def fa_on_vs_off(prefix_tokens: int, rows: int) -> float:
    """The measured step ratio (flash attention on / off) at this prefix and row count:
    bilinear in log2(prefix) and log2(rows) between the measured points of
    :data:`FA_ON_VS_OFF`; outside them the nearest measured edge holds (the bench found the
    ratio rising with both, so clamping does not flip a choice it would make further out)."""
    i, tp = _bracket(FA_ON_VS_OFF_PREFIXES, max(prefix_tokens, 1))
    j, tr = _bracket(FA_ON_VS_OFF_ROWS, max(rows, 1))
    t = FA_ON_VS_OFF
    low = t[i][j] * (1 - tr) + t[i][j + 1] * tr
    high = t[i + 1][j] * (1 - tr) + t[i + 1][j + 1] * tr
    return low * (1 - tp) + high * tp


def resolve_flash_attn(requested: str, kv_type: str, *, on_gpu: bool, prefix_tokens: int,
                       rows: int, shared_prefix: bool = False) -> str:
    """The flash-attention setting to hand llama.cpp for ``--flash-attn requested``
    (``on`` and ``off`` pass through). ``auto`` is the known-best path: ``on`` with
    shared-prefix attention (its kernel runs only inside flash attention); on a CPU with an
    f16 cache, by the measured table (:func:`fa_on_vs_off`) at the pool's prefix and
    expected decoding rows; else (a quantized V cache needs flash attention, a GPU has its
    flash kernels) llama.cpp's own ``auto``."""
    if requested != "auto":
        return requested
    if shared_prefix:
        return "on"
    if on_gpu or kv_type != "f16":
        return "auto"
    return "on" if fa_on_vs_off(prefix_tokens, rows) < 1.0 else "off"


PREFIX_ATTENTION_NOT_BUILT = (
    "this llama.cpp was built without mesh's shared-prefix attention patch; reinstall with "
    "scripts/install.sh or pass --prefix-attention off")


def resolve_prefix_attention(requested: str, *, available: bool, on_gpu: bool,
                             flash_attn: str, prefix_tokens: int, min_prefix: int,
                             disabled_by_env: bool = False) -> str:
    """``shared`` or ``off``: whether decode rows attend the shared prefix together (the
    patched llama.cpp CPU flash-attention kernel) for ``--prefix-attention requested``.
    ``shared`` requires the patch (``available``), the CPU and flash attention (the
    *requested* ``flash_attn``); ValueError naming the fix otherwise. ``auto`` is ``shared``
    where all three hold, the prefix is at least ``min_prefix`` tokens (the kernel's own
    threshold) and ``GGML_CPU_SHARED_PREFIX_ATTN=0`` has not disabled it; else ``off``."""
    if requested == "off":
        return "off"
    if requested == "shared":
        if not available:
            raise ValueError(PREFIX_ATTENTION_NOT_BUILT)
        if on_gpu:
            raise ValueError("--prefix-attention shared runs in llama.cpp's CPU attention; "
                             "with layers on the GPU pass --gpu-layers 0 or "
                             "--prefix-attention off")
        if flash_attn == "off":
            raise ValueError(FLASH_ATTN_CONFLICT)
        return "shared"
    usable = available and not on_gpu and flash_attn != "off" and not disabled_by_env
    return "shared" if usable and prefix_tokens >= min_prefix else "off"


FLASH_ATTN_CONFLICT = (
    "--prefix-attention shared runs inside flash attention, which --flash-attn off turns "
    "off; drop --flash-attn off (shared turns it on) or pass --prefix-attention off")

# -------------------- the configuration ---------------------------------------

FLASH_ATTN = ("auto", "on", "off")
# The suffix cells a session is expected to hold, for sizing the pool (kv_cells None):
# mesh's agents held ~0.4 GB of SmolLM2 KV at N = 32 with a 4K prefix, ~410 suffix cells
# each (issue 44); a session that needs more takes them from the pool, up to its budget.
TYPICAL_SUFFIX = 512
PREFIX_ATTENTION = ("auto", "shared", "off")
KV_TYPES = ("f16", "q8_0", "q4_0")  # highest precision first


@dataclass(frozen=True)
class EngineConfig:
    """How the pool is built. Validation does no I/O; see :meth:`validate`.

    ``n_ctx`` is the KV buffer in cells, shared by the prefix and every session's private
    suffix; ``None`` sizes it as ``prefix + suffix_cells`` (rounded up to 256).
    ``session_budget`` is the most private cells one session may hold. ``kv_cells`` is the
    one pool of suffix cells every session takes from as it grows, each up to its budget
    (``None``: sized to need, see :attr:`suffix_cells`).
    """

    model_path: str
    max_sessions: int = 16
    session_budget: int = 2048
    n_ctx: int | None = None
    kv_cells: int | None = None
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
    weights: str = "auto"  # --weights: auto | as-is | q8_0 | q4_0 (models.cpu_weights)
    # False is the baseline without a pool: every session prefills its own private copy
    # of the prefix (for comparisons; sizes n_ctx for max_sessions * (prefix + budget)).
    share_prefix: bool = True
    # The native step (fill, llama_decode and sampling in one C call, GIL released).
    # None: use it when it is built, else say so once and run the Python step.
    native: bool | None = None
    flash_attn: str = "auto"  # auto | on | off (llama.cpp's flash attention)
    kv_type: str = "f16"  # f16 | q8_0 | q4_0: element type of the KV cache (K and V)
    prefix_attention: str = "auto"  # auto | shared | off: see resolve_prefix_attention
    # Sessions attached at once, resident or parked (an idle session is parked when the pool
    # needs its id or cells). None: 4 x max_sessions; max_sessions: attach never parks.
    max_attached: int | None = None
    # Park a session idle this long even when no one needs the room (None: on demand only).
    park_idle_s: float | None = None
    # Host bytes for swapped suffixes (a parked session's private cells copied to RAM and
    # written back exactly on resume); past it (0: always) parking recomputes.
    park_memory: int = 0

    @property
    def suffix_cells(self) -> int:
        """``kv_cells`` resolved: ``max_sessions * min(session_budget, TYPICAL_SUFFIX)``,
        and never less than one whole ``session_budget`` (so one session can always grow
        to its cap once the others are parked)."""
        if self.kv_cells is not None:
            return self.kv_cells
        return max(self.session_budget,
                   self.max_sessions * min(self.session_budget, TYPICAL_SUFFIX))

    @property
    def attached_limit(self) -> int:
        """``max_attached`` resolved."""
        return 4 * self.max_sessions if self.max_attached is None else self.max_attached

    def validate(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is empty; pass --model PATH or set MESH_MODEL")
        _check(self, (
            ("max_sessions", self.max_sessions >= 1, ">= 1"),
            ("park_memory", self.park_memory >= 0, ">= 0 bytes"),
            ("park_idle_s", self.park_idle_s is None or self.park_idle_s >= 0, ">= 0 seconds"),
            ("session_budget", self.session_budget >= 16, ">= 16 tokens"),
            ("n_ctx", self.n_ctx is None or self.n_ctx >= 64, ">= 64 cells"),
            ("n_threads", self.n_threads is None or self.n_threads >= 1, ">= 1"),
        ))
        if self.max_attached is not None and self.max_attached < self.max_sessions:
            raise ValueError(f"max_attached ({self.max_attached}) must be >= max_sessions "
                             f"({self.max_sessions}); pass --max-attached N or leave it unset")
        if self.kv_cells is not None and self.kv_cells < self.session_budget:
            raise ValueError(f"kv_cells ({self.kv_cells}) must hold at least one session's "
                             f"budget ({self.session_budget}); raise --kv-cells or lower "
                             "--session-budget")
        if self.n_batch < self.max_sessions + 1:
            raise ValueError(
                f"n_batch ({self.n_batch}) must exceed max_sessions ({self.max_sessions}) "
                "so every decoding session fits in one step"
            )
        _check(self, (
            ("prefill_chunk", 1 <= self.prefill_chunk <= self.n_batch, "in 1..n_batch"),
            ("weights", self.weights in ("auto", "as-is", "q8_0", "q4_0"),
             "auto, as-is, q8_0 or q4_0"),
            ("flash_attn", self.flash_attn in FLASH_ATTN, f"one of {', '.join(FLASH_ATTN)}"),
            ("prefix_attention", self.prefix_attention in PREFIX_ATTENTION,
             f"one of {', '.join(PREFIX_ATTENTION)}"),
        ))
        if self.prefix_attention == "shared" and self.flash_attn == "off":
            raise ValueError(FLASH_ATTN_CONFLICT)
        _check(self, (("kv_type", self.kv_type in KV_TYPES, f"one of {', '.join(KV_TYPES)}"),))
        if self.kv_type != "f16" and self.flash_attn == "off":
            raise ValueError(f"a {self.kv_type} KV cache needs flash attention "
                             "(llama.cpp quantizes V only with it); use --flash-attn auto|on "
                             "or --kv-type f16")


def _check(obj: object, rules: tuple[tuple[str, bool, str], ...]) -> None:
    """Raise ValueError ``<field> must be <rule>, got <value>`` for the first rule broken."""
    for name, ok, rule in rules:
        if not ok:
            value = getattr(obj, name)
            got = repr(value) if isinstance(value, str) else value
            raise ValueError(f"{name} must be {rule}, got {got}")


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
    # A GBNF grammar (root rule ``root``) this turn's generated tokens must follow.
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
    # Completion order under the decode gate: lowest first (and, shedding, paused last);
    # the agent passes its task's start time. None: the session's attach time.
    priority: float | None = None

    @property
    def repetition(self) -> bool:
        """Whether any repetition control is on (and has prose to act on)."""
        on = (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
              or self.frequency_penalty != 0.0 or self.dry_multiplier > 0.0)
        return on and (self.grammar is None or self.prose_first or bool(self.prose_open))

    def validate(self) -> None:
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.grammar is not None and not self.grammar.strip():
            raise ValueError("grammar is empty; pass None for unconstrained sampling")
        if any(not o for o in self.prose_open):
            raise ValueError("prose_open strings must be non-empty")
        _check(self, (
            ("max_tokens", self.max_tokens >= 1, ">= 1"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_k", self.top_k >= 0, ">= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("repeat_penalty", 1.0 <= self.repeat_penalty <= 2.0, "in [1, 2] (1: off)"),
            ("repeat_last_n", 1 <= self.repeat_last_n <= 4096, "in 1..4096"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2] (0: off)"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0,
             "in [-2, 2] (0: off)"),
            ("dry_multiplier", 0.0 <= self.dry_multiplier <= 5.0, "in [0, 5] (0: off)"),
            ("dry_base", 1.0 < self.dry_base <= 4.0, "in (1, 4]"),
            ("dry_last_n", 1 <= self.dry_last_n <= 8192, "in 1..8192"),
            ("dry_allowed_length", self.dry_allowed_length >= 1, ">= 1"),
            ("prose_close", len(self.prose_close) <= 1, "one character or empty"),
        ))

# -------------------- the kv tier ---------------------------------------------

GIB = 1024**3
_PAD = 255  # llama.cpp rounds the cache up to a multiple of 256 cells
_BYTES_PER_BLOCK = {"f16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}  # (bytes, elements)


def elements_per_block(kv_type: str) -> int:
    return _BYTES_PER_BLOCK[kv_type][1]


@dataclass(frozen=True)
class KVShape:
    """What one KV cell holds: per layer, ``kv_heads`` heads of ``head_k`` K and ``head_v``
    V elements."""

    layers: int
    kv_heads: int
    head_k: int
    head_v: int

    @property
    def k(self) -> int:
        return self.kv_heads * self.head_k

    @property
    def v(self) -> int:
        return self.kv_heads * self.head_v

    def cell_bytes(self, kv_type: str) -> float:
        size, per = _BYTES_PER_BLOCK[kv_type]
        return self.layers * (self.k + self.v) * size / per

    def supports(self, kv_type: str) -> bool:
        """llama.cpp quantizes a cache only when the block size divides each head."""
        per = elements_per_block(kv_type)
        return self.head_k % per == 0 and self.head_v % per == 0


@dataclass(frozen=True)
class Tier:
    kv_type: str
    sessions: int  # session slots pooled in the memory
    naive_sessions: int  # sessions with a private prefix copy each, same memory and type
    n_ctx: int  # cells: prefix + sessions * session_budget
    memory_bytes: int
    cell_bytes: float
    prefix_tokens: int
    session_budget: int

    def describe(self) -> str:
        used = self.n_ctx * self.cell_bytes / GIB
        return (f"kv tier: {self.kv_type} cache in {self.memory_bytes / GIB:.2f} GiB "
                f"({self.cell_bytes / 1024:.1f} KiB a cell): {self.sessions} session slots "
                f"x {self.session_budget} tokens + a {self.prefix_tokens}-token prefix "
                f"({self.n_ctx} cells, {used:.2f} GiB) pooled; "
                f"{self.naive_sessions} with a prefix copy each")


def _fit(shape: KVShape, kv_type: str, memory: int, prefix: int, budget: int,
         cap: int) -> tuple[int, int, int]:
    cells = int(memory // shape.cell_bytes(kv_type)) - _PAD  # the pool pads n_ctx up
    pooled = max(0, min(cap, (cells - prefix) // budget)) if cells > prefix else 0
    naive = min(cap, cells // (prefix + budget))
    return pooled, naive, cells


def choose_tier(shape: KVShape, memory_bytes: int, *, prefix_tokens: int, session_budget: int,
                want_sessions: int, cap: int = 255,
                types: tuple[str, ...] = KV_TYPES) -> Tier:
    """The tier for ``memory_bytes`` of KV cache among ``types`` (highest precision
    first); see the module docstring."""
    if memory_bytes <= 0:
        raise ValueError(f"the KV memory must be positive, got {memory_bytes} bytes")
    usable = [t for t in types if shape.supports(t)]
    if not usable:
        raise ValueError(f"this model's KV heads ({shape.head_k} K, {shape.head_v} V "
                         f"elements) are not whole {'/'.join(types)} blocks; use --kv-type f16")
    best: tuple[str, int, int] | None = None
    for kv_type in usable:
        pooled, naive, _ = _fit(shape, kv_type, memory_bytes, prefix_tokens, session_budget,
                                cap)
        best = (kv_type, pooled, naive)
        if pooled >= min(want_sessions, cap):
            break
    assert best is not None
    kv_type, pooled, naive = best
    if pooled < 1:
        need = (prefix_tokens + session_budget) * shape.cell_bytes(kv_type) / GIB
        raise ValueError(
            f"{memory_bytes / GIB:.2f} GiB of KV memory holds not even the prefix "
            f"({prefix_tokens} tokens) and one session ({session_budget}) at {kv_type} "
            f"(needs {need:.2f} GiB); raise --kv-memory or lower --prefix-tokens or "
            "--session-budget")
    return Tier(kv_type=kv_type, sessions=pooled, naive_sessions=naive,
                n_ctx=prefix_tokens + pooled * session_budget, memory_bytes=memory_bytes,
                cell_bytes=shape.cell_bytes(kv_type), prefix_tokens=prefix_tokens,
                session_budget=session_budget)
