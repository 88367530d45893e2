"""The pure halves of the llama.cpp adapter: batch preconditions, GGUF KV shape, redraw."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from mesh.engine.config import batch_problem, kv_shape_from_meta, resolve_flash_attn
from mesh.engine.sampling import REDRAW_TOP, Ids, Logits, redraw, token_data

LIMITS = {"n_batch": 8, "n_outputs_max": 2, "n_seq_max": 4}


@pytest.mark.parametrize(
    ("shape", "words"),
    [((0, 0, 0), "empty"), ((9, 1, 0), "n_batch 8"), ((3, 3, 0), "n_outputs_max is 2"),
     ((3, 1, 4), "sequence id 4 >= n_seq_max 4")],
)
def test_batch_problem_names_what_llama_cpp_would_abort_on(
    shape: tuple[int, int, int], words: str
) -> None:
    problem = batch_problem(*shape, **LIMITS)
    assert problem is not None and words in problem


def test_a_batch_at_the_limits_is_fine() -> None:
    assert batch_problem(8, 2, 3, **LIMITS) is None


def test_kv_shape_reads_the_architecture_keys_with_defaults() -> None:
    meta: dict[str, str] = {"general.architecture": "gemma3", "gemma3.block_count": "26",
            "gemma3.embedding_length": "1152", "gemma3.attention.head_count": "4",
            "gemma3.attention.head_count_kv": "1", "gemma3.attention.key_length": "256",
            "gemma3.context_length": "[1, 2]"}  # an array: the default (0)
    # value_length is absent: embedding / heads
    assert kv_shape_from_meta(lambda k: meta.get(k)) == (26, 1, 256, 288, 0)
    assert kv_shape_from_meta(lambda k: None) == (0, 0, 0, 0, 0)


def test_redraw_tries_the_best_logits_before_the_whole_vocabulary() -> None:
    n = REDRAW_TOP * 4
    logits = np.arange(n, dtype=np.float32)  # the best are the highest ids
    seen: list[int] = []

    def allow_below(limit: int) -> Callable[[Ids, Logits], int | None]:
        def draw(ids: Ids, lg: Logits) -> int | None:
            seen.append(len(ids))
            ok = ids[ids < limit]
            return int(ok.max()) if len(ok) else None
        return draw

    assert redraw(logits, n, allow_below(n)) == (n - 1, False)
    assert seen == [REDRAW_TOP]
    seen.clear()
    assert redraw(logits, n, allow_below(10)) == (9, True)
    assert seen == [REDRAW_TOP, n]
    with pytest.raises(RuntimeError, match="allows no token"):
        redraw(logits, n, allow_below(0))


def test_token_data_is_llama_token_data_laid_out() -> None:
    cand = token_data(np.array([3, 5], dtype=np.int32), np.array([0.5, 1.5], np.float32))
    assert cand.itemsize == 12 and cand["id"].tolist() == [3, 5] and cand["p"].sum() == 0


def test_flash_attn_auto_is_the_known_best_path() -> None:
    # 8K prefix x 8 rows; the choice by prefix and rows: tests/engine/test_prefix_attention_flag
    def fa(requested: str, kv: str, on_gpu: bool) -> str:
        return resolve_flash_attn(requested, kv, on_gpu=on_gpu, prefix_tokens=8192, rows=8)

    assert fa("auto", "f16", False) == "off"  # CPU: one matmul
    assert fa("auto", "q8_0", False) == "auto"  # needs flash
    assert fa("auto", "f16", True) == "auto"  # llama.cpp decides
    assert fa("on", "f16", False) == "on"
    assert fa("off", "f16", True) == "off"
