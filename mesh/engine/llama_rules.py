"""What llama.cpp requires, as plain Python (no ``llama_cpp`` import: testable alone).

* :data:`KV_GGML_TYPE`: ggml.h's ``enum ggml_type`` ids of the KV cache types mesh offers;
* :func:`kv_shape_from_meta`: a model's KV shape from its GGUF metadata keys;
* :func:`batch_problem`: the batch shapes ``llama_decode`` would abort the whole process on
  (the adapter, :class:`mesh.engine.llama.LlamaContext`, raises ValueError instead);
* :func:`resolve_flash_attn` and :func:`resolve_prefix_attention`: what ``--flash-attn`` and
  ``--prefix-attention`` resolve to (the measured FA table: :data:`FA_ON_VS_OFF`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["FA_ON_VS_OFF", "FLASH_ATTN_CONFLICT", "KV_GGML_TYPE", "PREFIX_ATTENTION_NOT_BUILT",
           "batch_problem", "fa_on_vs_off", "kv_shape_from_meta", "resolve_flash_attn",
           "resolve_prefix_attention"]

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
# bench/results/prefix_attention.json, its "best" list, the f16 rows' ``fa_on_vs_off``
# (SmolLM2-135M Q4_1, 2 threads, 64-token suffix per row, median of 3 steps; run with
# ``bench/prefix_attention_bench.py --long-prefixes "" --rows 1,8,32 --steps 3``).
# FA on wins at 1K-2K for every row count and with one row at every prefix; FA off wins at
# 8K with 8+ rows and at 4K with 32 (its non-flash matrix product reads the prefix once a
# step, the CPU flash kernel once a row). Crossovers: ~4.4K prefix at 8 rows, ~3K at 32.
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
    """The flash-attention setting to hand llama.cpp for ``--flash-attn requested``.

    ``auto`` means the known-best path, not llama.cpp's own default:

    * with shared-prefix attention on (``shared_prefix``): ``on`` — the patched kernel runs
      only inside flash attention;
    * on a CPU with an f16 cache: by the measured table (:func:`fa_on_vs_off`) at the
      pool's prefix length and expected decoding rows (``max_sessions``): ``on`` where flash
      attention's step was faster, ``off`` where llama.cpp's non-flash path (all rows'
      queries against all cells in one matrix product) was;
    * a quantized V cache needs flash attention, and on a GPU llama.cpp's own choice (flash
      kernels) stands: ``auto`` stays ``auto`` there.

    ``on`` and ``off`` are passed through.
    """
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

    ``shared`` requires the patch (``available``), the CPU and flash attention; ValueError
    naming the fix otherwise. ``auto`` is ``shared`` where all three hold, the prefix is at
    least ``min_prefix`` tokens (the kernel's own threshold, below which it does not run)
    and the environment has not disabled it (``GGML_CPU_SHARED_PREFIX_ATTN=0``); else
    ``off``. ``flash_attn`` is the *requested* flash-attention mode.
    """
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
