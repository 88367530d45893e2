"""The agent worker: one subtask as a multi-turn loop on one pool session.

Turn loop (formats come from the template):

1. attach a session; append the rendered instructions as the first user message, in the
   model's chat format (:class:`~mesh.template.chat.ChatFormat`);
2. generate up to ``max_tokens_per_turn`` tokens (stopping at the tool-call or answer close
   tag) under the turn grammar (:mod:`mesh.worker.grammar`; off with ``turns.grammar =
   false``), streaming every piece as a ``TEXT`` event;
3. parse the turn: a finished turn (``stop``/``eos``) with an answer (inside the answer tags,
   or with no tool call at all) ends the subtask; each tool call is run, its (token-capped)
   output rendered with the template's ``tool_result`` file and sent as the next user
   message; unreadable calls are answered with errors. A turn cut by ``length`` is never an
   answer (the model is told it was cut); ``context_full`` ends the subtask as such;
4. repeat until an answer, ``max_turns`` (the last turn's calls are not run: nobody would
   read their results) or ``max_total_tokens``; a session that outgrows its context budget
   ends with ``max_tokens`` too.

What the user reads (:mod:`mesh.worker.text`): prose is sampled with repetition control
(DRY, never on a call's syntax), a turn that repeats a phrase is stopped at the repeat
(finish ``loop``, a finished turn), and the final answer loses turn tags and any sentence of
the template's own instructions.

With ``first_call`` the first turn's grammar offers only tool calls (small models
otherwise answer from the prompt without looking). Under the grammar the last turn offers
no tools (only the answer), and so does the turn
after a call that repeats an earlier one word for word: that call is not run again (its
result is already in the context) and the model is told to answer. Small models otherwise
loop on one call until ``max_turns``.

The session is detached in every case, shielded from cancellation. Engine failures become
:class:`WorkerFailed` naming the subtask and turn; tool refusals (:class:`ToolError`) are
reported to the model, not raised.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from mesh.engine.config import SamplingParams
from mesh.engine.interface import ContextOverflow, Engine, EngineError, Session
from mesh.template.chat import ChatFormat, ChatFormatError, Message
from mesh.template.loader import Template
from mesh.template.prefix import truncate
from mesh.worker.grammar import ProjectPaths, turn_grammar
from mesh.worker.stream import Tally, WorkerFailed, closed_text, release, stream_turn
from mesh.worker.text import (
    clean,
    echoed,
    prose_params,
    template_sentences,
    without_echo,
)
from mesh.worker.toolcalls import ToolCall, parse_turn
from mesh.worker.tools import ToolError, ToolFn
from mesh.worker.types import Emit, EventKind, Subtask, WorkerEvent, WorkerResult

__all__ = [
    "SESSION_SYSTEM",
    "AgentWorker",
    "WorkerFailed",
    "WorkerLimits",
    "release",
    "stream_turn",
]

# A session renders its turns without the shared system text (ChatFormat.check makes sure
# the continuation does not depend on it); this stands in for it.
SESSION_SYSTEM = "(the shared prefix)"


@dataclass(frozen=True)
class WorkerLimits:
    max_turns: int = 8
    max_tokens_per_turn: int = 256
    max_total_tokens: int = 2048
    max_tool_output_tokens: int = 512

    @classmethod
    def from_template(cls, template: Template) -> WorkerLimits:
        m = template.manifest
        return cls(
            max_turns=m.turns.max_turns,
            max_tokens_per_turn=m.turns.max_tokens_per_turn,
            max_total_tokens=m.turns.max_total_tokens,
            max_tool_output_tokens=m.tools.max_output_tokens,
        )

    def validate(self) -> None:
        for name in ("max_turns", "max_tokens_per_turn", "max_total_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tool_output_tokens < 16:
            raise ValueError("max_tool_output_tokens must be >= 16")


class AgentWorker:
    """A :class:`~mesh.worker.types.Worker` running the template's turn loop.

    ``tools`` maps tool names to async callables; only names the template enables are
    offered (a call to any other is answered with an error). ``chat`` is the model's chat
    format (:class:`~mesh.template.chat.ChatFormat`); the engine's prefix must be
    ``chat.prefix_text(system)``. Default: the plain format.
    """

    def __init__(
        self,
        engine: Engine,
        template: Template,
        tools: Mapping[str, ToolFn],
        *,
        limits: WorkerLimits | None = None,
        chat: ChatFormat | None = None,
        paths: ProjectPaths | None = None,
        first_call: bool = False,
    ) -> None:
        self._engine = engine
        self._first_call = first_call  # turn 1 must call a tool (under the grammar)
        self._paths = paths  # the project's paths a call may name (None: any string)
        self._template = template
        self._chat = chat or ChatFormat.plain()
        enabled = set(template.manifest.tools.enabled)
        self._tools: dict[str, ToolFn] = {n: fn for n, fn in tools.items() if n in enabled}
        # The grammar offers the enabled tools the worker has (never an unknown one).
        self._tool_names = sorted(self._tools) or sorted(enabled)
        self.limits = limits or WorkerLimits.from_template(template)
        self.limits.validate()
        # The template's own sentences: an answer that reproduces one is an echo.
        self._sentences = template_sentences(template)

    async def run(self, subtask: Subtask, emit: Emit) -> WorkerResult:
        try:
            session = await self._engine.attach()
        except EngineError as exc:
            raise WorkerFailed(f"subtask {subtask.id}: no session: {exc}") from exc
        try:
            await emit(WorkerEvent(EventKind.STATUS, f"session {session.id} attached"))
            return self._final(await self._turns(session, subtask, emit))
        finally:
            await release(session)

    async def _turns(self, session: Session, subtask: Subtask, emit: Emit) -> WorkerResult:
        syntax = self._template.manifest.tool_calls
        lim = self.limits
        state = Tally(session.id)
        chat = self._chat
        first = self._template.instructions(subtask.id, subtask.instructions).strip("\n")
        messages: list[Message] = [{"role": "user", "content": first}]
        seen: dict[str, int] = {}  # each call made (name and arguments) -> its turn
        answer_now = False  # the next turn offers only the answer
        try:
            session.append(chat.continuation(SESSION_SYSTEM, messages))
            for turn in range(1, lim.max_turns + 1):
                state.turns = turn
                budget = min(lim.max_tokens_per_turn, lim.max_total_tokens - state.generated)
                await emit(WorkerEvent(EventKind.TURN_STARTED, f"turn {turn}", turn))
                # Repetition control on the prose (reasoning, then the answer after its
                # open tag), never on a call's syntax; a loop ends the turn.
                params = prose_params(SamplingParams(
                    max_tokens=budget,
                    priority=subtask.priority,
                    temperature=self._template.manifest.turns.temperature,
                    stop=(syntax.close, syntax.answer_close),
                    grammar=self._grammar(budget, answer_only=answer_now
                                          or turn == lim.max_turns,
                                          call_only=self._first_call and turn == 1),
                ), opens=(syntax.answer_open,), close="<", first=True)
                result = await stream_turn(session, params, emit, turn, loop_stop=True)
                state.generated += result.num_generated
                state.last_text = result.text
                state.finishes.append(result.finish_reason)
                reply = closed_text(result, params.stop)
                if result.finish_reason == "context_full":
                    return state.result(result.text.strip(), "context_full")
                cut = result.finish_reason not in ("stop", "eos", "loop")
                parsed = parse_turn(reply, syntax)
                state.parse_errors += len(parsed.errors)
                if not cut:
                    if parsed.answer is not None:
                        return state.result(parsed.answer, "answer")
                    if not parsed.calls and not parsed.errors:
                        return state.result(result.text.strip(), "answer")
                if turn == lim.max_turns:
                    break
                if state.generated >= lim.max_total_tokens:
                    return state.result(result.text.strip(), "max_tokens")
                results: list[str] = []
                if cut:
                    results.append(
                        self._template.tool_result(
                            call="(turn cut)", is_error=True, turn=turn,
                            output=f"your turn was cut after {result.num_generated} tokens "
                            f"({result.finish_reason}); write one short tool call or the "
                            f"answer between {syntax.answer_open} and {syntax.answer_close}",
                        )
                    )
                for call in parsed.calls if not cut else ():
                    key = call.display()
                    if key in seen:
                        answer_now = True
                        state.repeated_calls += 1
                        output = (f"you already called {key} on turn {seen[key]}; its result "
                                  f"is above. Do not call it again: write the answer now "
                                  f"between {syntax.answer_open} and {syntax.answer_close}")
                        await emit(WorkerEvent(EventKind.TOOL_RESULT, output, turn,
                                               {"error": True, "repeated": True}))
                        results.append(self._template.tool_result(
                            call=key, output=output, is_error=True, turn=turn))
                        continue
                    seen[key] = turn
                    output, is_error = await self._call(call, emit, turn)
                    state.tool_calls += 1
                    results.append(
                        self._template.tool_result(
                            call=call.display(), output=output, is_error=is_error, turn=turn
                        )
                    )
                for error in parsed.errors if not cut else ():
                    await emit(WorkerEvent(EventKind.TOOL_RESULT, error, turn, {"error": True}))
                    results.append(
                        self._template.tool_result(
                            call="(unreadable call)", output=error, is_error=True, turn=turn
                        )
                    )
                user = "\n\n".join(r.strip("\n") for r in results)
                session.append(chat.reply_tail(messages, user))
                messages += [
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": user},
                ]
        except ContextOverflow as exc:
            if state.generated == 0:
                # Nothing was produced: the input itself does not fit the session.
                raise WorkerFailed(
                    f"subtask {subtask.id}: the message does not fit the session's context "
                    f"budget ({exc}); send a shorter message or raise --session-budget"
                ) from exc
            return state.result(state.last_text.strip(), "max_tokens", context_overflow=str(exc))
        except ChatFormatError as exc:
            raise WorkerFailed(f"subtask {subtask.id}: chat format {chat.name}: {exc}") from exc
        except EngineError as exc:
            raise WorkerFailed(f"subtask {subtask.id} failed on turn {state.turns}: {exc}") from exc
        return state.result(state.last_text.strip(), "max_turns")

    def _final(self, result: WorkerResult) -> WorkerResult:
        """The answer a user may read: no turn markup, no loop, none of the template's own
        sentences (:mod:`mesh.worker.text`); what was removed is counted in ``data``."""
        syntax = self._template.manifest.tool_calls
        tags = (syntax.open, syntax.close, syntax.answer_open, syntax.answer_close)
        text = clean(result.answer, tags)
        echoes = len(echoed(text, self._sentences))
        if echoes:
            text = without_echo(text, self._sentences)
        if text == result.answer and not echoes:
            return result
        return replace(result, answer=text, data={**result.data, "echoed_sentences": echoes,
                                                  "cleaned": True})

    def _grammar(self, budget: int, *, answer_only: bool = False,
                 call_only: bool = False) -> str | None:
        """The turn's GBNF grammar (no tools with ``answer_only``; no answer with
        ``call_only``), or None when the template turns it off."""
        if not self._template.manifest.turns.grammar:
            return None
        tools = () if answer_only else self._tool_names
        return turn_grammar(self._template.manifest.tool_calls, tools, budget, self._paths,
                            call_only=call_only and not answer_only)

    async def _call(self, call: ToolCall, emit: Emit, turn: int) -> tuple[str, bool]:
        data = {"name": call.name, "arguments": dict(call.arguments)}
        await emit(WorkerEvent(EventKind.TOOL_CALL, call.display(), turn, data))
        fn = self._tools.get(call.name)
        is_error = True
        if fn is None:
            output = f"unknown tool {call.name!r}; available: {', '.join(sorted(self._tools))}"
        else:
            try:
                output = await fn(call.arguments)
                is_error = False
            except ToolError as exc:
                output = str(exc)
            except OSError as exc:  # the project changed under us: report, don't fail
                output = f"{call.name} failed: {exc}"
        output, _ = truncate(output, self.limits.max_tool_output_tokens, self._engine.count_tokens)
        await emit(WorkerEvent(EventKind.TOOL_RESULT, output, turn, {"error": is_error}))
        return output, is_error
