"""Grammar-constrained sampling on the real tiny model (random weights: pure noise)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mesh.engine.types import SamplingParams
from tests.engine.test_pool import PREFIX, make_pool, run

YES_NO = 'root ::= "yes" | "no"'


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_noise_under_a_grammar_is_always_a_sentence_of_it(
    tiny_model_path: Path, temperature: float
) -> None:
    async def body() -> list[tuple[str, str]]:
        pool = await make_pool(tiny_model_path, max_sessions=4)
        out: list[tuple[str, str]] = []
        try:
            for seed in range(8):
                s = await pool.attach()
                s.append(f"Answer {seed}:")
                params = SamplingParams(max_tokens=20, temperature=temperature, seed=seed,
                                        stop_at_eos=False, grammar=YES_NO)
                gen = s.generate(params)
                streamed = "".join([p.text async for p in gen])
                assert gen.result is not None
                assert streamed == gen.result.text
                out.append((gen.result.text, gen.result.finish_reason))
                await s.detach()
        finally:
            await pool.aclose()
        return out

    results = run(body())
    assert all(text in ("yes", "no") for text, _ in results), results
    assert all(reason == "stop" for _, reason in results), results


def test_without_the_grammar_the_noise_is_not_yes_or_no(tiny_model_path: Path) -> None:
    # Guards the test above: the tiny model does not say yes/no on its own.
    async def body() -> str:
        pool = await make_pool(tiny_model_path, max_sessions=2)
        try:
            s = await pool.attach()
            s.append("Answer 0:")
            gen = s.generate(SamplingParams(max_tokens=6, stop_at_eos=False))
            return "".join([p.text async for p in gen])
        finally:
            await pool.aclose()

    assert run(body()) not in ("yes", "no")


def test_an_invalid_grammar_is_a_value_error_and_the_pool_goes_on(
    tiny_model_path: Path,
) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path, max_sessions=2)
        try:
            s = await pool.attach()
            s.append("Hello")
            bad = s.generate(SamplingParams(max_tokens=4, grammar="root ::= (unclosed"))
            with pytest.raises(ValueError, match="GBNF grammar does not parse"):
                [p async for p in bad]
            ok = s.generate(SamplingParams(max_tokens=4, stop_at_eos=False))
            assert len([p async for p in ok]) == 4
        finally:
            await pool.aclose()

    run(body())


def test_a_grammar_longer_than_max_tokens_ends_by_length(tiny_model_path: Path) -> None:
    async def body() -> tuple[str, str]:
        pool = await make_pool(tiny_model_path, max_sessions=2)
        try:
            s = await pool.attach()
            s.append(PREFIX[:20])
            gen = s.generate(SamplingParams(max_tokens=3, stop_at_eos=False,
                                            grammar='root ::= "a" "b"+ "c"'))
            text = "".join([p.text async for p in gen])
            assert gen.result is not None
            return text, gen.result.finish_reason
        finally:
            await pool.aclose()

    text, reason = run(body())
    assert reason == "length"
    assert re.fullmatch(r"ab+", text), text  # a token may hold several b's
