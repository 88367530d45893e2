"""The pool's totals (sessions attached, suffix tokens prefilled) on the real tiny model and
on the fake engine: what the agent bench reads to say what the shared prefix saved."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mesh.engine.config import SamplingParams
from mesh.engine.interface import Engine
from mesh.sim.fake import FakeEngine
from tests.engine.test_pool import make_pool

PARAMS = SamplingParams(max_tokens=4, stop_at_eos=False)
TEXTS = ("Read parcels.py and say where the weight is checked.", "And the 40 kg case?")


async def _turns(engine: Engine, n: int) -> int:
    """``n`` sessions of two turns each, detached at the end; the prompt tokens they had."""
    prompt = 0
    for _ in range(n):
        session = await engine.attach()
        for text in TEXTS:
            session.append(text)
            gen = session.generate(PARAMS)
            _ = [p async for p in gen]
            assert gen.result is not None
            prompt += gen.result.num_prompt_tokens
        await session.detach()
    return prompt


@pytest.mark.parametrize("share_prefix", [True, False])
def test_the_pool_counts_sessions_and_prefilled_tokens(
    tiny_model_path: Path, share_prefix: bool
) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path, share_prefix=share_prefix)
        try:
            before = pool.load()
            assert (before.sessions_attached, before.prefill_tokens) == (0, 0)
            prompt = await _turns(pool, 3)
            after = pool.load()
            assert after.sessions == ()
            assert after.sessions_attached == 3
            assert after.prefill_tokens == prompt
            # naive: each session's first turn prefilled its own copy of the prefix too
            suffix = sum(pool.count_tokens(t) for t in TEXTS) * 3
            copies = 0 if share_prefix else 3 * pool.info.prefix_tokens
            assert suffix <= prompt - copies <= suffix + 6  # + BOS/separator tokens at most
        finally:
            await pool.aclose()

    asyncio.run(body())


def test_the_fake_engine_counts_as_the_pool_does() -> None:
    async def body() -> None:
        engine = FakeEngine()
        prompt = await _turns(engine, 2)
        load = engine.load()
        assert (load.sessions_attached, load.prefill_tokens) == (2, prompt)
        assert prompt == sum(len(t.split()) for t in TEXTS) * 2

    asyncio.run(body())
