"""Stop strings on the real tiny model: stops of several tokens, cut exactly.

Each stop is taken from what the model actually writes: a reference turn (no stops) gives
the pieces, a stop is the text of 2..5 consecutive pieces, and the same turn, replayed with
that stop, must end right before the stop's first occurrence.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mesh.engine.config import SamplingParams
from mesh.engine.interface import Piece, TurnResult
from mesh.engine.pool import SharedKVPool, held_steps
from tests.engine.test_pool import make_pool, run

PROMPT = "Tell me about the water and the land:"
N = 40


async def turn(pool: SharedKVPool, stop: tuple[str, ...] = ()) -> tuple[list[Piece], TurnResult]:
    s = await pool.attach()
    try:
        s.append(PROMPT)
        gen = s.generate(SamplingParams(max_tokens=N, stop_at_eos=False, stop=stop))
        pieces = [p async for p in gen]
        assert gen.result is not None
        return pieces, gen.result
    finally:
        await s.detach()


def span(pieces: list[Piece], start: int, n: int) -> str:
    return "".join(p.text for p in pieces[start : start + n])


def first_clean_start(pieces: list[Piece], n: int) -> int:
    """A start index whose n pieces are all non-empty (each a real token of the stop)."""
    for i in range(5, len(pieces) - n):
        if all(p.text for p in pieces[i : i + n]):
            return i
    raise AssertionError("the reference turn has no run of non-empty pieces")


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path) -> tuple[Path, list[Piece], str]:
    async def body() -> tuple[list[Piece], TurnResult]:
        pool = await make_pool(tiny_model_path, max_sessions=4)
        try:
            return await turn(pool)
        finally:
            await pool.aclose()

    pieces, result = run(body())
    assert result.text == "".join(p.text for p in pieces)
    return tiny_model_path, pieces, result.text


def replay(model: Path, stops: list[tuple[str, ...]]) -> list[tuple[list[Piece], TurnResult]]:
    async def body() -> list[tuple[list[Piece], TurnResult]]:
        pool = await make_pool(model, max_sessions=4)
        try:
            return [await turn(pool, stop) for stop in stops]
        finally:
            await pool.aclose()

    got: list[tuple[list[Piece], TurnResult]] = run(body())
    return got


def check(pieces: list[Piece], result: TurnResult, ref_text: str, stop: str,
          matched: str | None = None) -> None:
    streamed = "".join(p.text for p in pieces)
    assert streamed == result.text, "streaming and the final text differ"
    assert result.finish_reason == "stop"
    assert result.stop == (matched or stop)
    assert result.text == ref_text[: ref_text.index(matched or stop)]
    assert (matched or stop) not in streamed


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_a_stop_of_n_tokens_is_cut_whole(reference: tuple[Path, list[Piece], str],
                                         n: int) -> None:
    model, pieces, ref_text = reference
    stop = span(pieces, first_clean_start(pieces, n), n)
    [(got, result)] = replay(model, [(stop,)])
    check(got, result, ref_text, stop)
    assert len(got) < len(pieces)


def test_two_overlapping_stops(reference: tuple[Path, list[Piece], str]) -> None:
    model, pieces, ref_text = reference
    i = first_clean_start(pieces, 4)
    a, b = span(pieces, i, 3), span(pieces, i + 1, 3)  # b starts inside a
    long_, inner = span(pieces, i, 5), span(pieces, i + 2, 1)  # inner completes first
    (g1, r1), (g2, r2), (g3, r3) = replay(model, [(b, a), (a, b), (long_, inner)])
    first = a if ref_text.index(a) <= ref_text.index(b) else b
    check(g1, r1, ref_text, first)
    check(g2, r2, ref_text, first)
    early = inner if ref_text.index(inner) < ref_text.index(long_) + len(long_) else long_
    check(g3, r3, ref_text, early)


def test_a_stop_at_the_very_first_token(reference: tuple[Path, list[Piece], str]) -> None:
    model, pieces, ref_text = reference
    one, three = pieces[0].text, span(pieces, 0, 3)
    assert one, "the first piece is empty; pick another prompt"
    (g1, r1), (g2, r2) = replay(model, [(one,), (three,)])
    for got, result, stop in ((g1, r1, one), (g2, r2, three)):
        check(got, result, ref_text, stop)
        assert result.text == ""


def test_a_stop_that_never_comes_holds_nothing_back(
    reference: tuple[Path, list[Piece], str],
) -> None:
    model, pieces, ref_text = reference
    # Every piece's last character starts the stop, so text is held back at many steps.
    stops = tuple(p.text[-1] + "\x00never" for p in pieces if p.text)
    [(got, result)] = replay(model, [stops])
    assert result.finish_reason == "length" and result.stop is None
    assert result.text == ref_text == "".join(p.text for p in got)


def test_stops_in_concurrent_sessions_are_cut_independently(
    reference: tuple[Path, list[Piece], str],
) -> None:
    model, pieces, ref_text = reference
    stops = [span(pieces, first_clean_start(pieces, n), n) for n in (2, 3, 5)]

    async def body() -> list[tuple[list[Piece], TurnResult]]:
        pool = await make_pool(model, max_sessions=4)
        try:
            async with held_steps(pool):  # all turns begin in the same step
                tasks = [asyncio.ensure_future(turn(pool, (s,))) for s in stops]
                await asyncio.sleep(0.05)
            return list(await asyncio.gather(*tasks))
        finally:
            await pool.aclose()

    for (got, result), stop in zip(run(body()), stops, strict=True):
        check(got, result, ref_text, stop)


CALLS = (
    "Tool calls, one per line:\n"
    '<call>read_file(path="a.py", start=1, lines=80)</call>\n'
    '<call>read_file(path="b.py", start=1, lines=80)</call>\n'
    '<call>read_file(path="c.py", start=1, lines=80)</call>\n'
    '<call>read_file(path="d.py", start=1, lines=80)</call>\n'
    '<call>read_file(path="'
)


@pytest.mark.slow
def test_a_tool_call_on_gemma_ends_without_its_stop() -> None:
    from mesh.engine.models import resolve_model

    model = resolve_model("gemma", env={}).path

    async def body() -> tuple[int, TurnResult]:
        pool = await make_pool(model, max_sessions=2, session_budget=512, n_threads=None)
        try:
            n_stop = pool.count_tokens("</call>")
            s = await pool.attach()
            s.append(CALLS)
            gen = s.generate(SamplingParams(max_tokens=30, stop=("</call>",)))
            streamed = "".join([p.text async for p in gen])
            assert gen.result is not None and streamed == gen.result.text
            return n_stop, gen.result
        finally:
            await pool.aclose()

    n_stop, result = run(body())
    assert n_stop >= 3, "in Gemma 3's vocabulary </call> is several tokens"
    assert result.finish_reason == "stop" and result.stop == "</call>"
    assert "</" not in result.text and result.text.endswith("lines=80)"), result.text
