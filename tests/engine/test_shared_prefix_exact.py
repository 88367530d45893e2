"""Shared-prefix attention (issue 32) matches the unshared path on the tiny model, end to end.

With the patched libggml-cpu loaded (``scripts/install.sh`` puts it into the venv, so CI runs
these), pools with flash attention on and a shared prefix past the kernel's minimum (256
cells) decode 8 and 2 sessions concurrently with mesh's switch on
(``prefix_attention="shared"``) and then off; the kernel's hit counter proves the path ran
only in the ``shared`` pool. Bit equality is not the contract: the shared path accumulates in
F32 where the old kernel uses F16 (docs/prefix-attention-kernel.md), so logits move by a few
hundredths. The greedy streams must be equal except where that can flip a choice: a session
may diverge only at a near-tie, checked against the path-off logits (teacher-forced through
the adapter). Through the adapter, the prompts' and every step's logits differ by at most
LOGIT_BOUND at 2 and at 8 rows, and a session's logits do not depend on the batch's size.

Measured here (8 sessions x 48 tokens): the shared pool's tokens equal the off pool's 83 % (4
sessions diverge, at two near-ties with path-off gaps of 0.004-0.013), 100 % at 2 sessions;
max |Δlogit| 0.032 over the prompts and the first step, 0.050 over all 49 steps (mean
0.0065); 2 rows vs 8 rows bit-equal.

The kernel's switch is process-wide: the ``kernel`` fixture restores it (and the variables it
reads) to the defaults afterwards, whatever the test did.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from mesh.engine import llama as prefix_attn
from mesh.engine.config import EngineConfig, SamplingParams
from mesh.engine.interface import PoolInfo
from mesh.engine.llama import Batch, LlamaContext, LlamaModel
from mesh.engine.pool import SharedKVPool
from mesh.engine.session import PooledSession

VOCABULARY_WORDS = """
the of and to in is it you that he was for on are as with his they at be this have from
or one had by word but not what all were we when your can said there use an each which
she do how their if will up other about out many then them these so some her would make like
him into time has look two more write go see number no way could people my than first water
been call who its now find long down day did get come made may part over new sound take only
little work know place year live me back give most very after thing our just name good
sentence man think say great where help through much before line right too mean old any same
tell boy follow came want show also around form three small set put end does another well
large must big even such because turn here why ask went men read need land different home
task agent tool file test code model error result step worker request token prefix session
"""
WORDS = VOCABULARY_WORDS.split()
# Words of the tiny vocabulary (one token each) in a seeded random order: ~330 tokens, past
# the kernel's 256. Not a repeated sentence: the random model loops on one, into near-ties.
PREFIX = " ".join(random.Random(0).choice(WORDS) for _ in range(330)) + "."
MIN_PREFIX_TOKENS = 300
TOKENS = 48  # greedy tokens per session
# Max |Δlogit| between the paths: K1 measured 0.027 on tiny, 0.050 here over 8 x 49 rows.
LOGIT_BOUND = 0.1
# The random model has near-ties (top-2 margins down to ~1e-3 in 8 x 48 steps), where any
# change of floating-point order may pick the other token. With every logit within
# LOGIT_BOUND, a choice can flip only where the two tokens' logits were within twice that.
NEAR_TIE = 2 * LOGIT_BOUND
HITS = "ggml_cpu_shared_prefix_attn_hits"


def prompt(i: int) -> str:
    """Session ``i``'s own question (each session's suffix differs)."""
    return f"\nQuestion {i + 1}: what is the water like near house {i}? Answer:"


@pytest.fixture
def kernel() -> Iterator[Callable[[], int]]:
    """The patched kernel's hit counter; skips where the loaded llama.cpp lacks the patch.

    Afterwards the switch is back at its defaults: the environment variables the kernel
    reads and mesh's record of its own write as they were, and the kernel told to re-read
    them (``ggml_cpu_shared_prefix_attn_set(-1, 0)``: lazily, at its next op)."""
    if not prefix_attn.shared_prefix_attn_available():
        pytest.skip("the loaded libggml-cpu lacks mesh's shared-prefix attention patch; "
                    "install it with scripts/install.sh (native/patches/install_patch.sh)")
    llama = prefix_attn.llama_library()
    hits, setter = (prefix_attn._function(llama, HITS),
                    prefix_attn._function(llama, prefix_attn.SET_SYMBOL))
    if hits is None or setter is None:
        pytest.skip(f"this patched libggml-cpu exports no {HITS} or {prefix_attn.SET_SYMBOL}")
    hits.argtypes, hits.restype = [], ctypes.c_int64
    setter.argtypes, setter.restype = [ctypes.c_int, ctypes.c_int64], None
    saved = {k: os.environ.get(k) for k in (prefix_attn.ENV_DISABLE, prefix_attn.ENV_MIN)}
    switched = prefix_attn._switched
    os.environ.pop(prefix_attn.ENV_MIN, None)  # the kernel's default minimum, 256
    try:
        yield lambda: int(hits())
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        prefix_attn._switched = switched
        setter(-1, 0)


# ------------------------------------------------------------------ the adapter


def forced_logits(path: Path, feed: list[list[int]], on: bool) -> npt.NDArray[np.float32]:
    """[rows, steps, n_vocab] through the adapter, in the pool's layout (prefix in sequence
    0, shared with sequences 1..rows; one row per session): step 0 is each session's logits
    after its private prompt (one session per decode: its prompt's tokens are the rows),
    step ``s`` those of a decode step of all rows feeding ``feed[r][s - 1]`` (teacher
    forcing: the same inputs whatever the path computes). ``on``: mesh's switch."""
    prefix_attn.set_shared_prefix_attn(on)
    rows, steps = len(feed), 1 + min(len(f) for f in feed)
    model = LlamaModel(path)
    pre = model.tokenize(PREFIX, add_bos=True)
    prompts = [model.tokenize(prompt(r), add_bos=False) for r in range(rows)]
    n_ctx = len(pre) + sum(len(p) for p in prompts) + rows * steps + 256
    ctx = LlamaContext(model, n_ctx=n_ctx, n_seq_max=rows + 1, n_batch=256,
                       n_outputs_max=rows + 1, n_threads=1, swa_full=True, flash_attn="on")
    batch = Batch(256)
    out = np.zeros((rows, steps, model.n_vocab), dtype=np.float32)
    try:
        for i in range(0, len(pre), 256):
            batch.clear()
            for j, tok in enumerate(pre[i:i + 256]):
                batch.add(tok, i + j, 0, False)
            assert ctx.decode(batch) == 0
        for r in range(rows):
            ctx.seq_copy(0, r + 1)
        for r, toks in enumerate(prompts):
            batch.clear()
            for j, tok in enumerate(toks):
                batch.add(tok, len(pre) + j, r + 1, j == len(toks) - 1)
            assert ctx.decode(batch) == 0
            out[r, 0] = ctx.logits_row(len(toks) - 1)
        for s in range(1, steps):
            batch.clear()
            for r, toks in enumerate(prompts):
                batch.add(feed[r][s - 1], len(pre) + len(toks) + s - 1, r + 1, True)
            assert ctx.decode(batch) == 0
            for r in range(rows):
                out[r, s] = ctx.logits_row(r)
    finally:
        batch.close()
        ctx.close()
        model.close()
    return out


# ------------------------------------------------------------------ through the pool


def pool_tokens(path: Path, mode: str, sessions: int) -> tuple[list[list[int]], PoolInfo]:
    """Each session's greedy tokens, all sessions decoding concurrently, and the pool's info.
    ``mode`` is mesh's switch (``--prefix-attention``); flash attention is on in both."""
    async def body() -> tuple[list[list[int]], PoolInfo]:
        cfg = EngineConfig(model_path=str(path), max_sessions=sessions, session_budget=128,
                           n_threads=1, flash_attn="on", prefix_attention=mode)
        pool = SharedKVPool(cfg, PREFIX)
        info = await pool.start()
        try:
            attached = [await pool.attach() for _ in range(sessions)]
            for i, s in enumerate(attached):
                s.append(prompt(i))
            params = SamplingParams(max_tokens=TOKENS, stop_at_eos=False)

            async def collect(s: PooledSession) -> list[int]:
                return [p.token async for p in s.generate(params) if p.token >= 0]

            streams = await asyncio.gather(*(collect(s) for s in attached))
            return list(streams), info
        finally:
            await pool.aclose()

    return asyncio.run(body())


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


@pytest.mark.parametrize("sessions", [8, 2])
def test_greedy_tokens_equal_with_the_path_on_and_off(tiny_model_path: Path,
                                                      kernel: Callable[[], int],
                                                      sessions: int) -> None:
    before = kernel()
    shared, info_on = pool_tokens(tiny_model_path, "shared", sessions)
    between = kernel()
    plain, info_off = pool_tokens(tiny_model_path, "off", sessions)
    after = kernel()
    assert info_on.prefix_tokens >= MIN_PREFIX_TOKENS, info_on.prefix_tokens
    assert (info_on.flash_attn, info_on.prefix_attention) == ("on", "shared")
    assert (info_off.flash_attn, info_off.prefix_attention) == ("on", "off")
    # The path ran in the shared pool's decode steps (2 layers x ~TOKENS steps of
    # `sessions` rows; half that is plenty of margin), and never in the off pool's.
    assert between - before >= TOKENS, (before, between)
    assert after == between, "the kernel's path ran with --prefix-attention off"
    assert [len(s) for s in shared] == [TOKENS] * sessions
    assert [len(s) for s in plain] == [TOKENS] * sessions
    diverged = {i: first_divergence(a, b)
                for i, (a, b) in enumerate(zip(shared, plain, strict=True)) if a != b}
    if not diverged:
        return
    # A divergence passes only at a near-tie: where the shared run's token scored within
    # NEAR_TIE of the off run's under the off path (the adapter reproduces the pool's
    # logits: teacher-forced argmax = the pool's greedy tokens).
    reference = forced_logits(tiny_model_path, plain, on=False)
    gaps = {i: float(reference[i, t, plain[i][t]] - reference[i, t, shared[i][t]])
            for i, t in diverged.items()}
    assert all(gap <= NEAR_TIE for gap in gaps.values()), \
        f"session: (first differing token, its path-off logit gap): " \
        f"{ {i: (diverged[i], gaps[i]) for i in diverged} }"


def test_logits_close_with_the_path_on_and_off_at_2_and_8_rows(
        tiny_model_path: Path, kernel: Callable[[], int]) -> None:
    """Teacher-forced through the adapter: the prompts' logits (rows = a prompt's tokens)
    and TOKENS decode steps of 2 and of 8 rows, fed the path-off pool's greedy tokens."""
    streams, _ = pool_tokens(tiny_model_path, "off", 8)
    logits: dict[tuple[int, bool], npt.NDArray[np.float32]] = {}
    for rows in (2, 8):
        for on in (True, False):
            before = kernel()
            logits[rows, on] = forced_logits(tiny_model_path, streams[:rows], on)
            # on: every prompt decode and every step took the path, in both of tiny's layers
            grew = kernel() - before
            assert grew == 2 * (rows + TOKENS) if on else grew == 0, (rows, on, grew)
        on_, off_ = logits[rows, True], logits[rows, False]
        delta = float(np.abs(on_ - off_).max())  # the first step's rows and all later ones
        assert delta <= LOGIT_BOUND, (rows, delta)
        # the off path reproduces the pool's greedy choices; the shared path too, except
        # at near-ties
        assert (off_[:, :-1].argmax(-1) == np.array(streams[:rows])[:, :TOKENS]).all()
        top2 = np.sort(off_, axis=-1)[..., -2:]
        clear = (top2[..., 1] - top2[..., 0]) > NEAR_TIE
        assert (on_.argmax(-1) == off_.argmax(-1))[clear].all(), rows
    # Batch composition: sessions 0 and 1 see the same prefix, prompts and inputs in both
    # runs; the shared path gives them the same logits (to the bound) with 2 rows as with 8.
    composed = float(np.abs(logits[2, True] - logits[8, True][:2]).max())
    assert composed <= LOGIT_BOUND, composed
