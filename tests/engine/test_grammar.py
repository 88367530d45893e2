"""Grammar-constrained sampling on the real tiny model (random weights: pure noise)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mesh.engine.config import SamplingParams
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


def _generate(model_path: Path, grammar: str, first: bool, temperature: float, seed: int,
              n: int = 24) -> tuple[list[int], int]:
    """Tokens a lone sampler writes after a short prompt; and its redraw count."""
    from mesh.engine.llama import Batch, LlamaContext, LlamaModel
    from mesh.engine.sampling import Sampler

    model = LlamaModel(model_path)
    ctx = LlamaContext(model, n_ctx=256, n_seq_max=1, n_batch=64, n_outputs_max=1,
                       n_threads=1, swa_full=True)
    batch = Batch(64)
    sampler = Sampler(model, temperature=temperature, top_k=40, top_p=1.0, seed=seed,
                      grammar=grammar, grammar_first=first)
    try:
        ids = model.tokenize("Noise under a grammar:", add_bos=True)
        for i, t in enumerate(ids):
            batch.add(t, i, 0, i == len(ids) - 1)
        assert ctx.decode(batch) == 0
        out: list[int] = []
        for pos in range(len(ids), len(ids) + n):
            tok = sampler.sample(ctx, batch.n_tokens - 1)
            if model.is_eog(tok):
                break
            out.append(tok)
            batch.clear()
            batch.add(tok, pos, 0, True)
            assert ctx.decode(batch) == 0
        return out, sampler.num_redraws
    finally:
        sampler.close()
        batch.close()
        ctx.close()


DIGITS = 'root ::= [0-9]{3} "-" [a-z]{2,5} ("." [0-9]{1,4})?'


def test_draw_then_check_is_greedy_exact_and_stays_in_the_language(
    tiny_model_path: Path,
) -> None:
    # Greedy: the best allowed token either way, so the same tokens as the grammar-first
    # chain; the noise is rejected often, so the redraw path is exercised.
    fast, redraws = _generate(tiny_model_path, DIGITS, False, 0.0, 0)
    slow, _ = _generate(tiny_model_path, DIGITS, True, 0.0, 0)
    assert fast == slow and redraws > 0
    from mesh.engine.llama import LlamaModel

    model = LlamaModel(tiny_model_path)
    for seed in range(6):  # seeded draws: always a sentence of the grammar
        toks, _ = _generate(tiny_model_path, DIGITS, False, 1.0, seed)
        text = b"".join(model.token_bytes(t) for t in toks).decode()
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}(\.[0-9]{1,4})?", text), text
