"""Repetition control through the llama.cpp adapter: a penalized turn samples its chain
(penalties, DRY) on the Python step and in the native step; prose only under a grammar."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mesh.engine import native
from mesh.engine.config import SamplingParams
from mesh.engine.llama import LlamaModel
from mesh.engine.sampling import GreedySampler, ProseTracker, Sampler, make_sampler
from tests.engine.test_pool import make_pool, run

PROMPT = "a a a a a a a a"
STEPS = [False, True] if native.load()[0] is not None else [False]


def _tokens(model: Path, params: SamplingParams, native_step: bool) -> list[int]:
    async def body() -> list[int]:
        pool = await make_pool(model, max_sessions=2, native=native_step)
        try:
            s = await pool.attach()
            s.append(PROMPT)
            return [p.token async for p in s.generate(params)]
        finally:
            await pool.aclose()

    tokens: list[int] = run(body())
    return tokens


def _repeats(tokens: list[int], n: int = 2) -> int:
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) - len(set(grams))


@pytest.mark.parametrize("native_step", STEPS)
def test_greedy_loops_and_a_penalized_turn_does_not(tiny_model_path: Path,
                                                    native_step: bool) -> None:
    base = SamplingParams(max_tokens=40, stop_at_eos=False)
    greedy = _tokens(tiny_model_path, base, native_step)
    assert _repeats(greedy) >= 2, greedy  # the random model falls into a 2-token loop
    penalized = _tokens(tiny_model_path, SamplingParams(
        max_tokens=40, stop_at_eos=False, repeat_penalty=2.0, presence_penalty=2.0),
        native_step)
    assert len(set(penalized)) == len(penalized), penalized  # no token twice
    dry = _tokens(tiny_model_path, SamplingParams(
        max_tokens=40, stop_at_eos=False, dry_multiplier=2.0, dry_base=2.0,
        dry_allowed_length=1), native_step)
    assert dry != greedy and _repeats(dry) < _repeats(greedy), dry
    # the same draws before any repeat: the penalty changes only what repeats
    first = next(i for i, t in enumerate(greedy) if t in greedy[:i])
    assert penalized[:first] == greedy[:first]


def test_the_adapter_builds_a_chain_for_a_penalized_greedy_turn(tiny_model_path: Path) -> None:
    model = LlamaModel(tiny_model_path)
    try:
        plain = make_sampler(temperature=0.0, top_k=0, top_p=1.0, seed=0, model=model,
                             rep=SamplingParams())
        assert isinstance(plain, GreedySampler) and plain.handle is None  # argmax, as before
        pen = make_sampler(temperature=0.0, top_k=0, top_p=1.0, seed=0, model=model,
                           rep=SamplingParams(dry_multiplier=0.8))
        assert isinstance(pen, Sampler) and pen.penalized and pen.handle is not None
        pen.close()
        # under a grammar: the structure chain until the prose opens
        gram = make_sampler(temperature=0.0, top_k=0, top_p=1.0, seed=0, model=model,
                            grammar='root ::= "x"',
                            rep=SamplingParams(grammar='root ::= "x"', dry_multiplier=0.8,
                                               prose_open=("<answer>",), prose_close="<"))
        assert isinstance(gram, Sampler) and not gram.penalized
        gram.close()
    finally:
        model.close()


def test_prose_is_tracked_from_the_markers_of_a_worker_turn_and_a_plan() -> None:
    worker = ProseTracker(("<answer>",), "<", first=True)
    states = []
    for piece in [b"I look", b" <", b"call>grep(", b"text='x')</", b"call>"]:
        worker.feed(piece)
        states.append(worker.prose)
    assert states == [True, False, False, False, False]
    worker = ProseTracker(("<answer>",), "<", first=True)
    for piece in [b"so <ans", b"wer>", b"It is x"]:
        worker.feed(piece)
    assert worker.prose
    worker.feed(b"</answer>")
    assert not worker.prose
    plan = ProseTracker(('"answer":"', '"instructions":"'), '"', first=False)
    seen = []
    for piece in [b'{"action":"', b'answer', b'","answer":"', b"It is", b' 30 kg', b'"}']:
        plan.feed(piece)
        seen.append(plan.prose)
    assert seen == [False, False, True, True, True, False]


@pytest.mark.parametrize("native_step", STEPS)
def test_a_grammar_turn_penalizes_only_its_prose_and_follows_the_grammar(
        tiny_model_path: Path, native_step: bool) -> None:
    grammar = 'root ::= [ab]{6} "<x>" [ab]{12} "<"'
    base = SamplingParams(max_tokens=40, stop_at_eos=False, grammar=grammar)
    rep = replace(base, repeat_penalty=2.0, presence_penalty=2.0, prose_open=("<x>",),
                  prose_close="<")

    async def text(params: SamplingParams) -> str:
        pool = await make_pool(tiny_model_path, max_sessions=2, native=native_step)
        try:
            s = await pool.attach()
            s.append(PROMPT)
            return "".join([p.text async for p in s.generate(params)])
        finally:
            await pool.aclose()

    out = run(text(rep))  # runs through both chains, switching at "<x>"
    head, _, tail = out.partition("<x>")
    assert len(head) == 6 and set(head) <= {"a", "b"}, out
    assert tail.endswith("<") and set(tail[:-1]) <= {"a", "b"}, out
    assert head == run(text(base))[:6]  # before the prose: as without penalties
