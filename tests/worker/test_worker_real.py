"""The worker loop on the real tiny model (random weights: pure noise) under the grammar.

Whatever the noise, every turn is a sentence of the turn grammar: it parses, it ends on a
close tag (``stop``), never half-way (``length``), and it names only enabled tools.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from mesh.engine.config import EngineConfig
from mesh.engine.pool import SharedKVPool
from mesh.template.chat import ChatFormat
from mesh.template.loader import Template, load_template, sample_project_dir
from mesh.worker.loop import AgentWorker
from mesh.worker.tools import ProjectTools
from mesh.worker.types import EventKind, Subtask, WorkerEvent, WorkerResult

CHAT = ChatFormat.plain()


def _variant(name: str, *, grammar: bool, max_turns: int) -> Template:
    t = load_template(name)
    turns = t.manifest.turns.model_copy(
        update={"grammar": grammar, "temperature": 1.0, "max_turns": max_turns}
    )
    manifest = t.manifest.model_copy(update={"turns": turns})
    return Template(name=t.name, root=t.root, manifest=manifest, renderer=t.renderer)


def _run_tasks(model: Path, template: Template, n: int) -> list[tuple[WorkerResult, list[str]]]:
    async def main() -> list[tuple[WorkerResult, list[str]]]:
        cfg = EngineConfig(model_path=str(model), max_sessions=4, session_budget=3072,
                           n_threads=1)
        pool = SharedKVPool(cfg, CHAT.prefix_text("You are an agent in the sample project."))
        await pool.start()
        tools = ProjectTools(sample_project_dir()).as_tools()
        out: list[tuple[WorkerResult, list[str]]] = []
        try:
            for i in range(n):
                results: list[str] = []

                async def emit(event: WorkerEvent, results: list[str] = results) -> None:
                    if event.kind is EventKind.TOOL_RESULT:
                        results.append(event.text)

                worker = AgentWorker(pool, template, tools, chat=CHAT)
                res = await worker.run(Subtask(f"t{i}", f"Question {i}: where is Parcel?"), emit)
                out.append((res, results))
        finally:
            await pool.aclose()
        return out

    return anyio.run(main)


@pytest.mark.parametrize("name", ["light", "heavy"])
def test_noise_under_the_grammar_gives_only_parseable_turns(
    tiny_model_path: Path, name: str
) -> None:
    runs = _run_tasks(tiny_model_path, _variant(name, grammar=True, max_turns=3), 10)
    finishes: list[Any] = []
    for result, tool_results in runs:
        assert result.data["parse_errors"] == 0, result
        assert all(f == "stop" for f in result.data["turn_finishes"]), result
        assert not any("unknown tool" in r for r in tool_results), tool_results
        finishes.append(result.finish_reason)
    # The noise does both: some tasks call tools, some answer.
    assert sum(r.num_tool_calls for r, _ in runs) > 0


def test_without_the_grammar_the_noise_writes_no_call_or_answer(tiny_model_path: Path) -> None:
    # Guards the test above: the same noise, unconstrained, is cut by length.
    runs = _run_tasks(tiny_model_path, _variant("light", grammar=False, max_turns=1), 2)
    for result, _ in runs:
        assert result.data["turn_finishes"] != ["stop"], result
