"""The agent bench's questions: every multi-part fact is in the sample project's files the
question needs (two or more), and the checker wants all of them, as whole words."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.agent.__main__ import Question, check, questions, split_evidence

SAMPLE = Path(__file__).resolve().parents[2] / "templates" / "sample"


def _file(name: str) -> str:
    """The file as a worker meets it: its path (list_files), then its text (read_file)."""
    found = [p for p in (SAMPLE / name, SAMPLE / "courier" / name) if p.is_file()]
    assert found, f"{name} is not in templates/sample"
    return f"{found[0].relative_to(SAMPLE)}\n{found[0].read_text()}"


@pytest.mark.parametrize("q", questions("multi"), ids=lambda q: q.facts[0])
def test_multi_part_facts_come_from_two_or_more_files(q: Question) -> None:
    assert q.multi and len(q.files) >= 2 and len(q.facts) >= 2
    texts = [_file(f) for f in q.files]
    for fact in q.facts:
        assert any(check(t, Question("", (fact,), True)) == [] for t in texts), fact
        assert check(q.text, Question("", (fact,), True)) == [fact], "the question gives it away"
    assert check(" ".join(texts), q) == []  # the files together answer it


def test_there_are_enough_multi_part_questions_and_limit_keeps_each_kind() -> None:
    assert len(questions("multi")) >= 8
    picked = questions("all", 2)
    assert [q.multi for q in picked] == [False, False, True, True]


def test_the_multi_part_checker_wants_every_fact_as_a_whole_word() -> None:
    q = Question("?", ("10", "Manhattan", "two_opt|2-opt"), multi=True)
    assert check("The length is 10 (Manhattan); it calls 2-opt.", q) == []
    assert check("The length is 100, Manhattan, two_opt.", q) == ["10"]
    assert check("10 and two_opt", q) == ["Manhattan"]
    assert check("parcels_x", Question("?", ("parcels",), multi=True)) == ["parcels"]
    assert check("from courier.parcels import", Question("?", ("parcels",), multi=True)) == []
    single = Question("?", ("30",))
    assert check("MAX_WEIGHT_KG = 30.0", single) == []  # single: plain substring, as before


def test_the_checker_reads_the_answer_not_its_evidence() -> None:
    # Round 7's first run kept only the last text part, the evidence line, and scored a
    # file named there as the model's answer.
    parts = ["The Parcel class is ", "defined in courier/parcels.py.",
             "\n\nEvidence: courier/parcels.py lines 17"]
    assert split_evidence(parts) == ("The Parcel class is defined in courier/parcels.py.",
                                     "Evidence: courier/parcels.py lines 17")
    assert split_evidence(["\n\nEvidence: courier/parcels.py lines 17"]) == (
        "", "Evidence: courier/parcels.py lines 17")
