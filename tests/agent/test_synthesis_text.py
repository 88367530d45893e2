"""The synthesis answer's clean-up: repeated paragraphs go, everything else stays."""

from __future__ import annotations

from mesh.agent.synthesis import without_repeats


def test_a_paragraph_repeated_by_a_looping_model_is_kept_once() -> None:
    text = "The weight is checked in parcels.py.\n\nThe file is in a.\n\nThe file is in a.\n\n" \
           "The  file is\nin a.\n\nA 40 kg parcel is refused."
    assert without_repeats(text) == ("The weight is checked in parcels.py.\n\nThe file is in a."
                                     "\n\nA 40 kg parcel is refused.")


def test_distinct_paragraphs_and_their_line_breaks_are_untouched() -> None:
    text = "First line\nsecond line\n\n- a\n- b\n\n```\ncode\n```"
    assert without_repeats(text) == text
    assert without_repeats("  \n\n") == ""


def test_the_answer_artifact_names_its_evidence_after_the_data_part() -> None:
    from google.protobuf.json_format import MessageToDict

    from mesh.agent.plans import Plan, PlannedSubtask
    from mesh.agent.synthesis import Outcome, answer_parts, evidence, synthesis_answer
    from mesh.worker.types import WorkerResult

    plan = Plan("delegate", (PlannedSubtask("Which file defines Parcel?"),))
    cites = [{"path": "courier/parcels.py", "lines": "17", "source": "outline"}]
    result = WorkerResult("It is courier/parcels.py.", 1, 9, 0, "answer",
                          {"evidence": cites})
    outcomes = [Outcome("p1", "Which file defines Parcel?", result=result)]
    found = evidence(result.answer, outcomes)
    assert found == cites
    text, data, line = answer_parts(result.answer, plan, outcomes, found)
    assert text.text == "It is courier/parcels.py."
    assert MessageToDict(data.data)["evidence"] == cites  # parts[1]: the data, as before
    assert line.text == "\n\nEvidence: courier/parcels.py lines 17"  # shown under it
    # no worker (a plan's own answer): the project files it names, lines unknown
    assert evidence("See README.md.", [], ["README.md", "x.py"]) == [
        {"path": "README.md", "lines": "", "source": "named"}]
    assert len(answer_parts("Hi.", plan, [], [])) == 2  # no evidence, no evidence line
    # a synthesis that is not whole gives way to the workers' reports
    two = [*outcomes, Outcome("p2", "x", result=result)]
    answer, why = synthesis_answer("The file is in the", plan, two)
    assert "not whole" in why and "courier/parcels.py" in answer
