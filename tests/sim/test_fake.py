"""FakeEngine ends turns as the pool does: exact stop strings, context_full, same errors."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mesh.engine.config import SamplingParams
from mesh.engine.interface import ContextOverflow, Piece, TurnResult
from mesh.sim.fake import FakeEngine


def turn(engine: FakeEngine, text: str, **params: Any) -> tuple[list[Piece], TurnResult]:
    async def body() -> tuple[list[Piece], TurnResult]:
        s = await engine.attach()
        s.append(text)
        gen = s.generate(SamplingParams(**params))
        pieces = [p async for p in gen]
        assert gen.result is not None
        return pieces, gen.result

    return asyncio.run(body())


def test_a_stop_string_over_several_words_is_cut_and_named() -> None:
    pieces, result = turn(FakeEngine(), "alpha beta gamma delta", max_tokens=10,
                          stop=("delta", "beta gamma"))
    assert result.finish_reason == "stop" and result.stop == "beta gamma"
    assert result.text == "alpha " == "".join(p.text for p in pieces)
    assert result.num_generated == 3  # the tokens generated, the stop's included


def test_held_text_is_released_at_the_length_limit() -> None:
    pieces, result = turn(FakeEngine(), "alpha beta", max_tokens=2, stop=("beta gamma",))
    assert result.finish_reason == "length" and result.stop is None
    assert result.text == "alpha beta" == "".join(p.text for p in pieces)


def test_running_out_of_budget_ends_the_turn_with_context_full() -> None:
    engine = FakeEngine(session_budget=20)
    pieces, result = turn(engine, "a b c d e", max_tokens=100)
    assert result.finish_reason == "context_full"
    assert result.num_generated == 15 == len(pieces)
    [s] = engine.sessions.values()
    assert s.private_cells == 20


def test_appending_past_the_budget_raises_context_overflow() -> None:
    async def body() -> None:
        s = await FakeEngine(session_budget=20).attach()
        with pytest.raises(ContextOverflow, match="budget"):
            s.append("w " * 21)

    asyncio.run(body())


def test_the_grammar_is_accepted_and_ignored() -> None:
    _, result = turn(FakeEngine(), "x y", max_tokens=2, grammar='root ::= "yes"')
    assert result.text == "x y"
