"""The prefill budget on the real pool: chunked prefill while sessions decode."""

from __future__ import annotations

import asyncio
from pathlib import Path

from mesh.engine.config import SamplingParams
from mesh.engine.interface import Generation, StepSample
from mesh.engine.pool import SharedKVPool, held_steps
from tests.engine.test_pool import make_pool, run

LONG = "the water and the land of every house in the old city " * 10


class Cap:
    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.calls: list[tuple[int, int]] = []

    def __call__(self, num_decode: int, cells_used: int) -> int:
        self.calls.append((num_decode, cells_used))
        return self.tokens


def steps_with_a_late_prefill(model: Path, cap: Cap | None) -> tuple[list[StepSample], int]:
    """Session A decodes; then B's long text arrives. The steps, and B's token count."""

    async def body() -> tuple[list[StepSample], int]:
        pool = await make_pool(model, max_sessions=4, session_budget=256)
        pool.set_prefill_budget(cap)
        try:
            a, b = await pool.attach(), await pool.attach()
            a.append("hi")
            # A's turn is long enough (200 steps) that it is still decoding when B arrives, however
            # far the engine runs ahead of this consumer.
            gen_a = a.generate(SamplingParams(max_tokens=200, stop_at_eos=False))
            it = gen_a.__aiter__()
            for _ in range(3):
                await it.__anext__()  # A is decoding now
            n_b = pool.count_tokens(LONG)
            gen_b = b.generate(SamplingParams(max_tokens=4, stop_at_eos=False))
            async with held_steps(pool):  # B's text and turn reach the engine between two steps
                b.append(LONG)
                await gen_b.start()
            task_b = asyncio.ensure_future(_drain(gen_b))
            pieces_b = await task_b
            steps = await _steps_with_prefill(pool, n_b)
            rest = [p async for p in it]
            assert len(rest) == 197 and pieces_b == 4
            return steps, n_b
        finally:
            await pool.aclose()

    got: tuple[list[StepSample], int] = run(body())
    return got


async def _steps_with_prefill(pool: SharedKVPool, n: int) -> list[StepSample]:
    """The recent steps once the published snapshot holds ``n`` prefilled tokens (it is
    republished when B's turn ends, a few steps after B's text went in)."""
    for _ in range(400):
        steps = list(pool.load().recent_steps)
        if sum(s.num_prefill_tokens for s in steps) >= n:
            return steps
        await asyncio.sleep(0.005)
    raise AssertionError(f"no snapshot shows {n} prefilled tokens")


async def _drain(gen: Generation) -> int:
    return len([p async for p in gen])


def test_a_budget_chunks_prefill_while_a_session_decodes(tiny_model_path: Path) -> None:
    cap = Cap(8)
    steps, n_b = steps_with_a_late_prefill(tiny_model_path, cap)
    mixed = [s for s in steps if s.num_decode and s.num_prefill_tokens]
    assert n_b > 8 * 3
    assert mixed and all(s.num_prefill_tokens <= 8 for s in steps if s.num_decode)
    assert sum(s.num_prefill_tokens for s in steps) >= n_b  # all of B's text went in
    assert cap.calls and all(nd >= 1 and cells > 0 for nd, cells in cap.calls)
    assert all(s.cells_used > 0 for s in steps)


def test_without_a_budget_the_whole_text_goes_in_one_step(tiny_model_path: Path) -> None:
    steps, n_b = steps_with_a_late_prefill(tiny_model_path, None)
    assert any(s.num_decode and s.num_prefill_tokens == n_b for s in steps)
