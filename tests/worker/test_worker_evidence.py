"""What an answer rests on (mesh.worker.evidence), and answers that are never fragments."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mesh.sim.fake import FakeEngine
from mesh.template.loader import file_entry, load_template
from mesh.worker.evidence import (
    Evidence,
    cited,
    defined_lines,
    evidence_of,
    named_files,
    outline_lines,
    render_evidence,
    unknown_files,
)
from mesh.worker.grammar import ProjectPaths
from mesh.worker.loop import AgentWorker
from mesh.worker.text import fragment
from mesh.worker.tools import ProjectTools
from tests.worker.test_worker_loop import GrammarLog, run

LIGHT = load_template("light")
FILES = ["courier/parcels.py", "courier/routes.py", "README.md"]


@pytest.mark.parametrize(("text", "why"), [
    ("The Parcel class is defined in courier/parcels.py.", ""),
    ("It is in courier/parcels.py", ""),  # ends on a path: no full stop needed
    ("ok", ""),
    ("30 kg", ""),
    ("file in the", "cut mid-sentence (ends on 'the')"),
    ("This is", "cut mid-sentence (ends on 'is')"),
    ("and a", "cut mid-sentence (ends on 'a')"),
    ("write_to_file(", "part of a tool call"),
    ('read_file(path="x"', "part of a tool call"),
    ("It is <answer> here.", "markup"),
    ("The file is `pool.py and more.", "an open quote"),
    ("The weight is checked in the parcels module, later", "cut mid-sentence (no full stop)"),
    ("", "empty"),
])
def test_a_fragment_says_why(text: str, why: str) -> None:
    assert fragment(text) == why


def test_tools_show_lines_and_answers_cite_files() -> None:
    read = evidence_of("read_file", "1\tx\n2\ty\n(courier/parcels.py: lines 1-2 of 50)")
    grep = evidence_of("grep", "courier/routes.py:38: def two_opt\ncourier/routes.py:54: x\n"
                               "(2 matches in 3 files searched)")
    assert read == [Evidence("courier/parcels.py", "1-2", "read_file")]
    assert grep == [Evidence("courier/routes.py", "38, 54", "grep")]
    assert evidence_of("list_files", "courier/\nREADME.md") == []
    # the files the answer names first (by path or by a name only one file has), then the rest
    assert named_files("See routes.py and courier/parcels.py.", FILES) == [
        "courier/routes.py", "courier/parcels.py"]
    assert cited("It is in routes.py.", [*read, *grep], FILES) == [*grep, *read]
    assert cited("It is in README.md.", read, FILES) == [
        Evidence("README.md", "", "named"), *read]
    assert render_evidence([e.to_dict() for e in grep]) == (
        "Evidence: courier/routes.py lines 38, 54")
    assert render_evidence([]) == ""


def test_made_up_files_are_found() -> None:
    text = "It is courier.py or src/main.py, not courier/parcels.py, parcels.py or 30.0 kg."
    assert unknown_files(text, FILES) == ["courier.py", "src/main.py"]
    assert unknown_files(text, []) == []  # no project: nothing to check against


def test_the_lines_cited_define_what_the_answer_names() -> None:
    text = '"""Parcels."""\n\nMAX_KG = 30\n\n\nclass SharedKVPool:\n    pass\n'
    entry = file_entry("pool.py", text, len(text))
    assert outline_lines("The shared KV pool is in pool.py.", entry) == "6"
    assert outline_lines("It weighs at most max kg.", entry) == "3"
    assert outline_lines("Nothing here.", entry) == ""
    numbered = "\n".join(f"{i}\t{line}" for i, line in enumerate(text.splitlines(), 1))
    assert defined_lines("the SharedKVPool class", numbered) == "6"


def test_an_answer_cites_its_outline_lines(tmp_path: Path) -> None:
    (tmp_path / "pool.py").write_text("class SharedKVPool:\n    pass\n")
    text = (tmp_path / "pool.py").read_text()
    template = dataclasses.replace(LIGHT, outline=(file_entry("pool.py", text, len(text)),))
    worker = AgentWorker(FakeEngine(), template, ProjectTools(tmp_path).as_tools(),
                         paths=ProjectPaths.of(["pool.py"]))
    result = run(worker, "<answer>The shared KV pool is in pool.py.</answer>")
    assert result.answer.endswith("The shared KV pool is in pool.py.")
    assert result.data["evidence"] == [{"path": "pool.py", "lines": "1", "source": "outline"}]


def test_the_first_message_repeats_the_outline_lines_that_match() -> None:
    text = '"""The shared KV pool."""\n\n\nclass SharedKVPool:\n    pass\n'
    outline = (file_entry("mesh/engine/pool.py", text, len(text)),
               file_entry("README.md", "# mesh\n", 7))
    engine = FakeEngine()
    template = dataclasses.replace(LIGHT, outline=outline)
    result = run(AgentWorker(engine, template, {}), "Which file defines the shared KV pool?")
    # the fake echoes the first message: the request, then the matching outline line
    assert "mesh/engine/pool.py (5 lines): The shared KV pool | class SharedKVPool L4" in (
        result.data.get("fragment", "") + result.answer)


def test_a_fragment_gets_one_repair_turn_under_the_sentence_grammar() -> None:
    engine = GrammarLog()
    paths = ProjectPaths.of(FILES, ["courier"])
    result = run(AgentWorker(engine, LIGHT, {}, paths=paths), "<answer>file in the</answer>")
    assert len(engine.grammars) == 2
    repair = engine.grammars[1] or ""
    assert repair.startswith('root ::= "<answer>" sentence "</answer>"')
    assert result.data["repaired"] == "cut mid-sentence (ends on 'the')"
    # the fake echoes the repair's request, which is not an answer: never a fragment
    assert result.answer.startswith("No complete answer")
    assert "file in the" not in result.answer


def test_a_made_up_file_is_repaired_under_a_grammar_that_names_a_real_one() -> None:
    engine = GrammarLog()
    paths = ProjectPaths.of(FILES, ["courier"])
    result = run(AgentWorker(engine, LIGHT, {}, paths=paths),
                 "<answer>It is defined in src/main.py.</answer>")
    assert "which the project does not have" in result.data["repaired"]
    repair = engine.grammars[1] or ""
    assert '"courier" ("/" ' in repair or '"courier/" ' in repair  # the project's paths


def test_after_outline_lines_were_shown_the_repair_must_name_a_file() -> None:
    text = '"""The shared KV pool."""\n\n\nclass SharedKVPool:\n    pass\n'
    template = dataclasses.replace(LIGHT, outline=(file_entry("courier/parcels.py", text, 9),))
    engine = GrammarLog()
    paths = ProjectPaths.of(FILES, ["courier"])
    run(AgentWorker(engine, template, {}, paths=paths),
        "Which file defines the shared KV pool?")  # the fake's echo: not one sentence
    repair = engine.grammars[-1] or ""
    assert repair.startswith('root ::= "<answer>" sentence "</answer>"')
    assert "[ ] path-prose (" in repair and "([ ] path-prose" not in repair  # not optional
