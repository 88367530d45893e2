"""When the synthesis turn runs, and what becomes of its text (scripted fake engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
from a2a.types import a2a_pb2 as pb

from mesh.agent.plans import Plan, PlannedSubtask
from mesh.agent.synthesis import (
    SYNTHESIS_INSTRUCTIONS,
    Outcome,
    direct_answer,
    needs_synthesis,
    synthesis_answer,
)
from mesh.worker.types import WorkerResult
from tests.support.agent_helpers import Scripted, ScriptedEngine, plan_json, serve_agent
from tests.support.coord_helpers import artifact, request, sdk, send_all, text_of

S = pb.TaskState


async def _send(url: str, req: pb.SendMessageRequest) -> pb.Task:
    async with sdk(url, streaming=False) as client:
        (response,) = await send_all(client, req)
    return response.task


def _ok(id_: str, answer: str) -> Outcome:
    return Outcome(id_, f"part {id_}", WorkerResult(answer, 1, 3, 0, "answer"))


@pytest.mark.anyio
async def test_a_plan_of_one_subtask_answers_with_its_worker_and_no_synthesis(
    tmp_path: Path,
) -> None:
    engine = ScriptedEngine(Scripted([plan_json("find the weight check")]))
    with serve_agent(tmp_path, engine) as served:
        task = await _send(served.url, request("where is the weight checked?"))
    assert task.status.state == S.TASK_STATE_COMPLETED
    assert served.admission.admitted == [f"{task.id}/plan", f"{task.id}/p1"]
    assert len(engine.turns) == 1 and engine.turns[0][0].rstrip().endswith("Plan:")
    assert text_of(artifact(task, "answer").parts).startswith("echo: find the weight check")


@pytest.mark.anyio
async def test_a_synthesis_that_restates_its_prompt_is_replaced_by_the_reports(
    tmp_path: Path,
) -> None:
    echo = SYNTHESIS_INSTRUCTIONS + "\n\nUser request:\nwhere and how?"
    engine = ScriptedEngine(Scripted([plan_json("find the check", "say what 40 kg does")],
                                     synthesis=echo))
    with serve_agent(tmp_path, engine) as served:
        task = await _send(served.url, request("where and how?"))
    answer = text_of(artifact(task, "answer").parts)
    assert "You are the coordinator" not in answer
    assert answer.startswith("[p1]\necho: find the check") and "[p2]\necho: say what" in answer


def test_synthesis_runs_for_two_or_more_or_a_failure() -> None:
    assert not needs_synthesis([_ok("p1", "x")])
    assert needs_synthesis([_ok("p1", "x"), _ok("p2", "y")])
    assert needs_synthesis([_ok("p1", "x"), Outcome("p2", "b", error="boom")])


def test_the_synthesis_text_is_cleaned_and_checked_for_its_frame() -> None:
    plan = Plan("delegate", (PlannedSubtask("part p1"), PlannedSubtask("part p2")))
    outs = [_ok("p1", "parcels.py"), _ok("p2", "ValueError")]
    text = "It is parcels.py<answer>, based on ValueError.</answer>"
    assert synthesis_answer(text, plan, outs) == ("It is parcels.py, based on ValueError.", "")
    # the report frame copied back: a report's header line, 'ended with ...', 'Answer:'
    for frame in ("[p1] part p1", "ended with answer after 1 turn(s)", "Answer:"):
        answer, why = synthesis_answer(f"It is x.\n{frame}\nmore", plan, outs)
        assert why and answer == "[p1]\nparcels.py\n\n[p2]\nValueError", frame
    loop = "The file is parcels.py and the class is there. " * 4
    assert synthesis_answer(loop, plan, outs)[0] == "The file is parcels.py and the class is there."
    assert synthesis_answer("  ", plan, outs)[1] == "the synthesis wrote nothing"


def test_a_plans_own_answer_loses_loops_markup_and_the_planning_prompt() -> None:
    looped = "The answer is: " * 10
    assert direct_answer(looped, ("read_file",), 4) == "The answer is:"
    echo = ("You cannot open the project's files yourself: workers can, with their tools. "
            "It is 30 kg.")
    assert direct_answer(echo, ("read_file",), 4) == "It is 30 kg."
    assert direct_answer("<answer>30 kg</answer>", (), 4) == "30 kg"


def test_a_synthesis_or_direct_answer_restating_the_system_text_is_an_echo() -> None:
    from mesh.template.loader import load_template
    from mesh.worker.text import NO_ANSWER, template_texts

    system = tuple(template_texts(load_template("light")))
    plan = Plan("delegate", (PlannedSubtask("part p1"), PlannedSubtask("part p2")))
    outs = [_ok("p1", "parcels.py"), _ok("p2", "ValueError")]
    gemma = 'You are a small coding assistant working in the project "sample".\n' \
            "Use a tool only when you need to look at the project."
    answer, why = synthesis_answer(gemma, plan, outs, system)
    assert why and answer.startswith("[p1]\nparcels.py")
    assert synthesis_answer(gemma, plan, outs)[1] == ""  # without the texts it cannot tell
    assert direct_answer(gemma, ("read_file",), 4, system) == NO_ANSWER


@pytest.mark.anyio
async def test_a_looping_synthesis_is_stopped_at_the_loop_and_cut(tmp_path: Path) -> None:
    sentence = "The weight is checked in parcels.py by the Parcel class itself."
    engine = ScriptedEngine(Scripted([plan_json("find the check", "say what 40 kg does")],
                                     synthesis=" ".join([sentence] * 30)))
    with serve_agent(tmp_path, engine) as served:
        task = await _send(served.url, request("where and how?"))
    assert text_of(artifact(task, "answer").parts) == sentence
    streamed = text_of(artifact(task, "stream-synthesis").parts)
    assert len(streamed) < 4 * len(sentence)  # stopped at the third copy, not run to 30
