"""AgentWorker's turn loop on the FakeEngine (which echoes its input, one word per token).

The echo makes the model's "decisions" scripted: instructions containing a tool call make
the first turn call that tool; a tool whose output contains a call keeps the loop going.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

from mesh.sim.fake import FakeEngine
from mesh.template.loader import load_template
from mesh.worker.loop import AgentWorker, WorkerFailed, WorkerLimits
from mesh.worker.tools import ProjectTools
from mesh.worker.types import EventKind, Subtask, WorkerEvent, WorkerResult

LIGHT = load_template("light")


class Recorder:
    def __init__(self) -> None:
        self.events: list[WorkerEvent] = []

    async def __call__(self, event: WorkerEvent) -> None:
        self.events.append(event)

    def kinds(self, kind: EventKind) -> list[WorkerEvent]:
        return [e for e in self.events if e.kind is kind]


def run(worker: AgentWorker, instructions: str, emit: Recorder | None = None) -> WorkerResult:
    async def main() -> WorkerResult:
        return await worker.run(Subtask("t1", instructions), emit or Recorder())

    return anyio.run(main)


async def looping_tool(args: Mapping[str, Any]) -> str:
    """Names a new call each time (a repeated call would end the loop early)."""
    return f"again <call>grep(text='{args.get('text', '')}x')</call>"


async def same_call_tool(args: Mapping[str, Any]) -> str:
    return "again <call>grep(text='x')</call>"


def test_finishes_on_a_final_answer() -> None:
    engine = FakeEngine()
    result = run(AgentWorker(engine, LIGHT, {}), "<answer>forty-two</answer>")
    assert result.finish_reason == "answer"
    assert result.answer == "forty-two"
    assert result.num_turns == 1 and result.num_tool_calls == 0
    assert engine.sessions == {}


def test_runs_a_real_tool_then_answers(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("<answer>It says hello.</answer>\n")
    engine = FakeEngine()
    emit = Recorder()
    worker = AgentWorker(engine, LIGHT, ProjectTools(tmp_path).as_tools())
    result = run(worker, "<call>read_file(path='notes.txt')</call>", emit)
    # The fake echoes the tool result: the answer is that turn as a whole, tags removed.
    assert result.finish_reason == "answer"
    assert result.answer.endswith("read_file(path='notes.txt') returned: 1 It says hello.")
    assert result.data["evidence"] == [{"path": "notes.txt", "lines": "1-1",
                                        "source": "read_file"}]
    assert result.num_turns == 2 and result.num_tool_calls == 1
    assert [e.text for e in emit.kinds(EventKind.TOOL_CALL)] == ["read_file(path='notes.txt')"]
    assert "<answer>It says hello." in emit.kinds(EventKind.TOOL_RESULT)[0].text
    assert [e.text for e in emit.kinds(EventKind.TURN_STARTED)] == ["turn 1", "turn 2"]
    assert emit.kinds(EventKind.TEXT)
    assert engine.sessions == {}


def test_stops_at_max_turns_without_running_the_last_call() -> None:
    calls: list[Mapping[str, Any]] = []

    async def grep(args: Mapping[str, Any]) -> str:
        calls.append(args)
        return f"again <call>grep(text='x{len(calls)}')</call>"  # a new call each time

    engine = FakeEngine()
    worker = AgentWorker(engine, LIGHT, {"grep": grep}, limits=WorkerLimits(max_turns=3))
    result = run(worker, "<call>grep(text='x')</call>")
    assert result.finish_reason == "max_turns"
    assert result.num_turns == 3
    assert result.num_tool_calls == len(calls) == 2
    assert result.data["repeated_calls"] == 0
    assert engine.sessions == {}


class GrammarLog(FakeEngine):
    """The fake engine, keeping each turn's grammar (the fake itself ignores it)."""

    def __init__(self) -> None:
        super().__init__()
        self.grammars: list[str | None] = []

    async def attach(self) -> Any:
        session = await super().attach()
        generate = session.generate

        def logged(params: Any) -> Any:
            self.grammars.append(params.grammar)
            return generate(params)

        session.generate = logged  # type: ignore[method-assign]
        return session


def test_a_repeated_call_is_not_run_again_and_the_next_turn_must_answer() -> None:
    calls: list[Mapping[str, Any]] = []

    async def grep(args: Mapping[str, Any]) -> str:
        calls.append(args)
        return await same_call_tool(args)  # names the same call again

    engine = GrammarLog()
    emit = Recorder()
    worker = AgentWorker(engine, LIGHT, {"grep": grep}, limits=WorkerLimits(max_turns=6))
    run(worker, "<call>grep(text='x')</call>", emit)
    assert len(calls) == 1  # the repeat on turn 2 was answered from the context, not run
    repeated = [e for e in emit.kinds(EventKind.TOOL_RESULT) if e.data.get("repeated")]
    assert repeated and "already called grep(text='x') on turn 1" in repeated[0].text
    # Turn 1 and 2 offer the tool; turn 3 (after the repeat) offers only the answer.
    assert engine.grammars[0] is not None and "t-grep" in engine.grammars[0]
    assert "t-grep" in (engine.grammars[1] or "")
    assert "t-grep" not in (engine.grammars[2] or "t-grep")


def test_the_last_turn_offers_only_the_answer() -> None:
    engine = GrammarLog()
    worker = AgentWorker(engine, LIGHT, {"grep": looping_tool},
                         limits=WorkerLimits(max_turns=1))
    run(worker, "<call>grep(text='x')</call>")
    assert len(engine.grammars) == 1
    assert engine.grammars[0] is not None and "t-grep" not in engine.grammars[0]
    assert "answer ::=" in engine.grammars[0]


def test_stops_at_the_token_limit() -> None:
    limits = WorkerLimits(max_turns=50, max_tokens_per_turn=8, max_total_tokens=20)
    worker = AgentWorker(FakeEngine(), LIGHT, {"grep": looping_tool}, limits=limits)
    result = run(worker, "<call>grep(text='x')</call>")
    assert result.finish_reason == "max_tokens"
    assert result.num_generated <= 20


def test_a_full_context_ends_the_subtask_as_context_full() -> None:
    # The session's budget runs out mid-turn: the engine ends the turn with context_full
    # (as the pool does) and the loop ends the subtask so, never reading the cut text as
    # an answer.
    engine = FakeEngine(session_budget=30)
    worker = AgentWorker(engine, LIGHT, {"grep": looping_tool})
    result = run(worker, "<call>grep(text='x')</call>")
    assert result.finish_reason == "context_full", result
    assert engine.sessions == {}


def test_unknown_tools_and_garbage_are_reported_to_the_model() -> None:
    emit = Recorder()
    result = run(AgentWorker(FakeEngine(), LIGHT, {}), "<call>rm(path='/')</call>", emit)
    assert result.num_turns >= 2 and result.data["turn_finishes"][0] == "stop"
    errors = emit.kinds(EventKind.TOOL_RESULT)
    assert errors[0].data["error"] is True and "unknown tool 'rm'" in errors[0].text
    emit = Recorder()
    run(AgentWorker(FakeEngine(), LIGHT, {}), "<call>read_file('x')</call>", emit)
    assert "pass arguments by name" in emit.kinds(EventKind.TOOL_RESULT)[0].text


def test_a_turn_cut_by_length_is_not_an_answer() -> None:
    async def chatty(args: Mapping[str, Any]) -> str:
        return " ".join(f"word{i}" for i in range(200))  # no loop: "word " * 200 is one

    limits = WorkerLimits(max_turns=2, max_tokens_per_turn=16, max_total_tokens=200)
    worker = AgentWorker(FakeEngine(), LIGHT, {"grep": chatty}, limits=limits)
    result = run(worker, "<call>grep(text='x')</call>")
    assert result.data["turn_finishes"] == ["stop", "length"]
    assert result.finish_reason == "max_turns"


def test_tools_not_enabled_by_the_template_are_not_offered() -> None:
    async def delegate(args: Mapping[str, Any]) -> str:
        raise AssertionError("light does not enable delegate")

    emit = Recorder()
    run(AgentWorker(FakeEngine(), LIGHT, {"delegate": delegate}), "<call>delegate()</call>", emit)
    assert "unknown tool 'delegate'" in emit.kinds(EventKind.TOOL_RESULT)[0].text


def test_a_failing_engine_fails_the_task_with_the_reason_and_detaches() -> None:
    engine = FakeEngine()
    engine.fail_next = "llama_decode returned -1"
    with pytest.raises(WorkerFailed, match="llama_decode returned -1") as info:
        run(AgentWorker(engine, LIGHT, {}), "hello")
    assert "t1" in str(info.value) and "turn 1" in str(info.value)
    assert engine.sessions == {}


def test_a_failing_tool_run_detaches() -> None:
    async def broken(args: Mapping[str, Any]) -> str:
        raise RuntimeError("bug in tool")

    engine = FakeEngine()
    with pytest.raises(RuntimeError, match="bug in tool"):
        run(AgentWorker(engine, LIGHT, {"grep": broken}), "<call>grep(text='x')</call>")
    assert engine.sessions == {}


def test_cancellation_detaches_and_propagates() -> None:
    engine = FakeEngine()
    worker = AgentWorker(engine, LIGHT, {})

    async def main() -> bool:
        with anyio.CancelScope() as scope:

            async def emit(event: WorkerEvent) -> None:
                if event.kind is EventKind.TEXT:
                    scope.cancel()

            await worker.run(Subtask("t1", "a long task " * 20), emit)
        return scope.cancelled_caught

    assert anyio.run(main) is True
    assert engine.sessions == {}


def test_pool_full_is_a_clear_failure() -> None:
    engine = FakeEngine(max_sessions=1)

    async def main() -> None:
        await engine.attach()
        await AgentWorker(engine, LIGHT, {}).run(Subtask("t2", "x"), Recorder())

    with pytest.raises(WorkerFailed, match="t2: no session"):
        anyio.run(main)


def test_heavy_template_json_calls(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    worker = AgentWorker(FakeEngine(), load_template("heavy"), ProjectTools(tmp_path).as_tools())
    emit = Recorder()
    call = '<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call>'
    result = run(worker, call, emit)
    assert result.num_tool_calls == 1
    assert "1\tx = 1" in emit.kinds(EventKind.TOOL_RESULT)[0].text


def test_with_first_call_the_first_turn_must_call_a_tool(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("<answer>It says hello.</answer>\n")
    engine = GrammarLog()
    worker = AgentWorker(engine, LIGHT, ProjectTools(tmp_path).as_tools(), first_call=True)
    result = run(worker, "<call>read_file(path='notes.txt')</call>")
    assert result.answer.endswith("It says hello.") and len(engine.grammars) == 2
    first, second = (g or "" for g in engine.grammars)
    assert "root ::= free call\n" in first  # turn 1: a call, no answer
    assert "root ::= free (call | answer) | reply\n" in second



def _long_grep() -> tuple[list[Mapping[str, Any]], Any]:
    calls: list[Mapping[str, Any]] = []

    async def grep(args: Mapping[str, Any]) -> str:
        calls.append(args)
        filler = " ".join(f"w{i}x{len(calls)}" for i in range(40))  # no loop to catch
        return f"{filler} again <call>grep(text='x{len(calls)}')</call>"

    return calls, grep


def test_a_worker_near_its_budget_compacts_its_turns_and_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The session's suffix would outgrow its budget: the turns so far become one summary
    (the task, the calls made, the evidence, the latest results), their cells are freed,
    and the loop goes on; without compaction the same run ends on its budget."""
    limits = WorkerLimits(max_turns=12, max_total_tokens=40000)
    calls, grep = _long_grep()
    assert not calls
    engine = FakeEngine(session_budget=800)
    emit = Recorder()
    result = run(AgentWorker(engine, LIGHT, {"grep": grep}, limits=limits),
                 "<call>grep(text='x')</call>", emit)
    assert result.data["compactions"] >= 1, result.data
    assert engine.load().compactions == result.data["compactions"]
    assert result.finish_reason not in ("context_full", "max_tokens")
    status = [e.text for e in emit.kinds(EventKind.STATUS) if "compacted" in e.text]
    assert len(status) == result.data["compactions"]
    assert engine.sessions == {} and len(calls) >= 2

    import mesh.worker.loop as loop_mod
    monkeypatch.setattr(loop_mod, "COMPACT_AT", 100.0)  # never
    _, grep = _long_grep()
    engine = FakeEngine(session_budget=800)
    plain = run(AgentWorker(engine, LIGHT, {"grep": grep}, limits=limits),
                "<call>grep(text='x')</call>")
    assert plain.data["compactions"] == 0
    assert plain.finish_reason in ("context_full", "max_tokens"), plain.finish_reason
