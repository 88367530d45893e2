"""``examples/langgraph_fanout.py`` prints sensible text whatever a weak model answers
(issue 41 item 7.3): labelled sub-questions and answers, no raw dumps, each odd reply
(repeats, echoes, JSON, markdown, a cut-off sentence, nothing) tidied or named.

The pure helpers on the odd replies SmolLM2 gave, then the script itself as a process
against a real ``mesh serve --model tiny`` (gibberish text: the worst case for layout).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("langgraph")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import langgraph_fanout as ex  # noqa: E402

from tests.reliability.serve_proc import running, small_project  # noqa: E402

Q = "How does a parcel get from the depot to the customer?"


def test_repeated_numbered_subquestions_are_deduplicated_and_filled_in() -> None:
    reply = f"1. {Q}\n2. {Q}\n3. {Q.upper()}\n\n- Question: Who drives the van?\n"
    subs, planned = ex.subquestions(reply, Q, 4)
    assert subs[:2] == [Q, "Who drives the van?"]
    assert planned == 2
    assert subs[2:] == [ex.ANGLES[0].format(q=Q), ex.ANGLES[1].format(q=Q)]


def test_subquestions_from_json_or_nothing() -> None:
    subs, planned = ex.subquestions('{"questions": ["Where is the depot?", "Who sorts it?"]}',
                                    Q, 2)
    assert (subs, planned) == (["Where is the depot?", "Who sorts it?"], 2)
    subs, planned = ex.subquestions("", Q, 3)
    assert planned == 0 and subs == [a.format(q=Q) for a in ex.ANGLES[:3]]


@pytest.mark.parametrize(
    ("reply", "tidied"),
    [
        # echoed question (SmolLM2 on "What can go wrong here: ...")
        (f"A parcel can go wrong here: {Q}", ""),
        (f"Part 3 of 3: {Q}\n\nPart 4 of 3: {Q}", ""),
        # a sentence repeated until the token limit, in a markdown list, cut off
        ("The main steps:\n\n- The van leaves the depot.\n- The van leaves the depot.\n"
         "- The van leaves the depot.\n- The delivery method is determined by the",
         "The main steps: The van leaves the depot."),
        ("1. **Floats**: small units.\n2. **Vans**: they carry parcels.",
         "Floats: small units. Vans: they carry parcels."),
        ('{"answer": "By van."}', "By van."),
        ("a parcel is carried by", "a parcel is carried by …"),
        # a list written inline; a list number left at the end
        ("The steps: 1. The van loads. 2. The van drives. 3.",
         "The steps: The van loads. The van drives."),
        ("The limit is 30. A parcel of 40 kg is refused.",
         "The limit is 30. A parcel of 40 kg is refused."),
        ("   \n", ""),
    ],
    ids=["echo", "echo-repeated", "repeats-cut-off", "markdown", "json", "cut-off-only",
         "inline-list", "a-number-ends-a-sentence", "empty"],
)
def test_tidy(reply: str, tidied: str) -> None:
    assert ex.tidy(reply, [Q]) == tidied


def test_the_report_is_labelled_text() -> None:
    subs, planned = ex.subquestions(f"1. {Q}", Q, 3)
    out: ex.FanOut = {"question": Q, "subquestions": subs, "planned": planned,
                      "answers": [(0, "By van."), (2, ""), (1, "The driver.")], "answer": ""}
    text = ex.report(out)
    lines = text.splitlines()
    assert lines[:2] == [f"question: {Q}", "plan: 3 sub-questions, 1 written by the planner, "
                                           "2 filled in (it wrote fewer distinct ones)"]
    assert f"[1/3] {Q}" in lines and "    By van." in lines
    assert f"[2/3] {subs[1]} (filled in)" in lines
    assert "(no usable answer" in text and "(the model did not merge" in text
    assert "{" not in text and "[(" not in text and "->" not in text


def test_the_script_against_a_real_server(tmp_path: Path) -> None:
    with running(tmp_path / "data", small_project(tmp_path / "project"), tmp_path / "cache",
                 "--policy", "none") as served:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "langgraph_fanout.py"), "--url",
             served.url, "--workers", "3", "--max-tokens", "24", Q],
            capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"question: {Q}" and lines[1].startswith("plan: 3 sub-questions")
    assert sum(line.startswith(("[1/3] ", "[2/3] ", "[3/3] ")) for line in lines) == 3
    assert "answer:" in lines
    assert "Traceback" not in proc.stderr
