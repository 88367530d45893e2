"""What a user reads of a turn (mesh.worker.text): loops cut, echoes caught, markup gone;
and the worker loop applying it on the FakeEngine (which echoes its input word by word)."""

from __future__ import annotations

import anyio
import pytest

from mesh.engine.config import SamplingParams
from mesh.sim.fake import FakeEngine
from mesh.template.loader import load_template
from mesh.worker.loop import AgentWorker, WorkerLimits
from mesh.worker.text import (
    NO_ANSWER,
    LoopGuard,
    cut_loop,
    echoed,
    has_loop,
    instruction_sentences,
    prose_params,
    strip_markup,
    template_texts,
    without_echo,
)
from mesh.worker.types import Subtask, WorkerResult

LIGHT = load_template("light")
PHRASE = "The Courier class is defined in the dispatch module."  # 9 words


def run(worker: AgentWorker, instructions: str) -> WorkerResult:
    async def main() -> WorkerResult:
        async def emit(event: object) -> None:
            return None

        return await worker.run(Subtask("t1", instructions), emit)

    return anyio.run(main)


# --------------------------------------------------------------------------- loops


def test_a_phrase_of_eight_words_a_third_time_is_a_loop_cut_before_the_repeat() -> None:
    text = f"Look: {PHRASE} {PHRASE} {PHRASE} {PHRASE}"
    assert has_loop(text)
    assert cut_loop(text) == f"Look: {PHRASE}"


def test_twice_or_shorter_phrases_are_not_loops() -> None:
    assert not has_loop(f"{PHRASE} and then {PHRASE}")  # twice
    seven = "a b c d e f g"
    assert not has_loop(f"{seven}. x {seven}. y {seven}.")  # 7 words, 3 times
    text = "The parcel weighs 40 kg, so Parcel raises ParcelError; the base is ValueError."
    assert cut_loop(text) == text


def test_the_stream_guard_cuts_at_the_same_place_whatever_the_pieces() -> None:
    text = "The answer is: " * 6
    whole = cut_loop(text)
    assert whole == "The answer is:"
    guard = LoopGuard()
    at = None
    for i in range(0, len(text), 3):  # pieces that split words
        at = guard.feed(text[i:i + 3])
        if at is not None:
            break
    assert at is not None and guard.text[:at].rstrip() == whole


def test_a_loop_in_punctuation_and_case_variants_is_still_a_loop() -> None:
    text = " ".join(["the file `a2a_bench.py` is a wrapper for the `a2a_bench.py` that is"] * 3)
    assert has_loop(text.upper()) and has_loop(text)


# --------------------------------------------------------------------------- echoes


def test_an_answer_holding_an_instruction_sentence_is_an_echo() -> None:
    sentences = instruction_sentences(template_texts(LIGHT))
    assert "use a tool only when you need to look at the project" in sentences
    answer = "Use a tool only when you need to look at the project.\nThe file is parcels.py."
    assert echoed(answer, sentences)
    assert without_echo(answer, sentences) == "The file is parcels.py."
    assert without_echo("Use a tool only when you need to look at the project.",
                        sentences) == NO_ANSWER
    assert not echoed("The file is parcels.py.", sentences)
    assert without_echo("parcels.py", sentences) == "parcels.py"


def test_short_sentences_and_the_request_itself_are_not_instructions() -> None:
    # The light template's instructions are the request alone: nothing of it counts.
    sentences = instruction_sentences(template_texts(LIGHT))
    assert not any("which file defines" in s for s in sentences)
    assert instruction_sentences(["You are the coordinator. Answer briefly."]) == []


# --------------------------------------------------------------------------- markup


def test_turn_markup_is_stripped() -> None:
    assert strip_markup("defines the shared KV_<answer> pool.</answer>") == \
        "defines the shared KV_ pool."
    assert strip_markup('read <call>read_file(path="x")</call> it') == 'read read_file(path="x") it'
    assert strip_markup("<final_answer>x</final_answer>", ("<final_answer>",)) == "x"
    assert strip_markup("a < b and <tool_call> c") == "a < b and  c"


# --------------------------------------------------------------------------- sampling


def test_prose_params_turn_dry_on_and_say_where_prose_is() -> None:
    plain = SamplingParams(grammar='root ::= "x"')
    assert not plain.repetition
    p = prose_params(plain, opens=("<answer>",), close="<", first=True)
    p.validate()
    assert p.repetition and p.dry_multiplier > 0 and p.repeat_penalty == 1.0
    # a grammar turn without any prose gets no repetition control at all
    assert not prose_params(plain).repetition
    assert prose_params(SamplingParams()).repetition  # free text: all of it is prose


@pytest.mark.parametrize("bad", [
    {"repeat_penalty": 0.5}, {"dry_multiplier": -1.0}, {"dry_base": 1.0},
    {"dry_allowed_length": 0}, {"prose_close": "ab"}, {"prose_open": ("",)},
    {"repeat_last_n": 0}, {"presence_penalty": 3.0}, {"dry_last_n": 0},
])
def test_bad_repetition_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad).validate()  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the worker


def test_a_looping_answer_is_stopped_and_cut_to_one_copy() -> None:
    engine = FakeEngine()
    result = run(AgentWorker(engine, LIGHT, {}),
                 "<answer>" + " ".join([PHRASE] * 12) + "</answer>")
    assert result.answer == PHRASE
    assert result.data["turn_finishes"] == ["loop"]
    assert result.finish_reason == "answer"
    # the turn was stopped at the third copy, not run to its end (12 copies of 9 words)
    assert result.num_generated < 3 * 9 + 5
    assert engine.sessions == {}


def test_markup_in_an_answer_never_reaches_the_user() -> None:
    # A last turn cut with a call in it: its text without the tags is not a sentence, so
    # one repair turn is asked for (the fake echoes the request: no sentence either), and
    # the answer says that no whole answer came; the fragment stays in the data.
    limits = WorkerLimits(max_turns=1, max_tokens_per_turn=64, max_total_tokens=64)
    result = run(AgentWorker(FakeEngine(), LIGHT, {}, limits=limits),
                 "It is in <call>grep(text='KV')</call>")
    assert result.finish_reason == "max_turns"
    assert "<" not in result.answer and result.answer.startswith("No complete answer")
    assert result.data["repaired"] == "cut mid-sentence (no full stop)"
    assert result.data["turn_finishes"] == ["stop", "stop"]  # the turn, then its repair


def test_an_answer_that_restates_the_instructions_is_not_given_as_one() -> None:
    result = run(AgentWorker(FakeEngine(), LIGHT, {}),
                 "<answer>Use a tool only when you need to look at the project. "
                 "It is parcels.py</answer>")
    assert result.answer == "It is parcels.py"
    assert result.data["echoed_sentences"] == 1
    result = run(AgentWorker(FakeEngine(), LIGHT, {}),
                 "<answer>Use a tool only when you need to look at the project.</answer>")
    assert result.answer == NO_ANSWER
