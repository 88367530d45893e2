"""What llama.cpp requires, as plain Python (no ``llama_cpp`` import: testable alone).

* :data:`KV_GGML_TYPE`: ggml.h's ``enum ggml_type`` ids of the KV cache types mesh offers;
* :func:`kv_shape_from_meta`: a model's KV shape from its GGUF metadata keys;
* :func:`batch_problem`: the batch shapes ``llama_decode`` would abort the whole process on
  (the adapter, :class:`mesh.engine.llama.LlamaContext`, raises ValueError instead).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["KV_GGML_TYPE", "batch_problem", "kv_shape_from_meta", "resolve_flash_attn"]

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


def resolve_flash_attn(requested: str, kv_type: str, *, on_gpu: bool) -> str:
    """The flash-attention setting to hand llama.cpp for ``--flash-attn requested``.

    ``auto`` means the known-best path for the device and cache type, not llama.cpp's own
    default: on a CPU with an f16 cache that is flash attention *off* — llama.cpp's
    non-flash path multiplies all rows' queries against all cells in one matrix product,
    reading the shared prefix's K once per step, while its CPU flash kernel reads it once
    per row (SmolLM2, 8 decoding rows: 1.25x faster at a 1.9K prefix, 1.77x at 6K; see
    DESIGN.md, third round). A quantized V cache needs flash attention, and on a GPU
    llama.cpp's own choice (flash kernels) stands, so ``auto`` stays ``auto`` there.
    ``on`` and ``off`` are passed through.
    """
    if requested == "auto" and not on_gpu and kv_type == "f16":
        return "off"
    return requested
