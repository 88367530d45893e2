"""The agent worker: one streamed turn (shared with the scenario worker and the agent's
planning and synthesis turns), a subtask's bookkeeping, then the multi-turn loop on one
pool session.

Turn loop (formats come from the template):

1. attach a session; append the rendered instructions as the first user message, in the
   model's chat format (:class:`~mesh.template.chat.ChatFormat`);
2. generate up to ``max_tokens_per_turn`` tokens (stopping at the tool-call or answer close
   tag) under the turn grammar (:mod:`mesh.worker.grammar`; off with ``turns.grammar =
   false``), streaming every piece as a ``TEXT`` event;
3. parse the turn: a finished turn (``stop``/``eos``) with an answer (inside the answer tags,
   or with no tool call at all) ends the subtask, and the answer is the turn's text as a
   whole (the tags removed); each tool call is run, its (token-capped) output rendered with
   the template's ``tool_result`` file and sent as the next user message; unreadable calls
   are answered with errors. A turn cut by ``length`` is never an answer (the model is told
   it was cut); ``context_full`` ends the subtask as such;
4. repeat until an answer, ``max_turns`` (the last turn's calls are not run: nobody would
   read their results) or ``max_total_tokens``; a session that outgrows its context budget
   ends with ``max_tokens`` too.

An answer is never a fragment. When the final text is not whole
(:func:`mesh.worker.text.fragment`) or names a file the project does not have
(:func:`mesh.worker.evidence.unknown_files`), one more turn is asked for under the sentence
grammar (:func:`mesh.worker.grammar.sentence_grammar`); if that is not whole either, the
answer says so (``data["fragment"]`` keeps the fragment). Every answer names its evidence
in ``data["evidence"]`` (:mod:`mesh.worker.evidence`).

With ``first_call`` the first turn's grammar offers only tool calls (small models
otherwise answer from the prompt without looking). Under the grammar the last turn offers
only the answer, and so does the turn after a call that repeats an earlier one word for
word: that call is not run again and the model is told to answer (small models otherwise
loop on one call until ``max_turns``).

The session is detached in every case, shielded from cancellation. Engine failures become
:class:`WorkerFailed` naming the subtask and turn; tool refusals (:class:`ToolError`) are
reported to the model, not raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio

from mesh.engine.config import SamplingParams
from mesh.engine.interface import ContextOverflow, Engine, EngineError, Session
from mesh.engine.interface import TurnResult as EngineTurn
from mesh.template.chat import ChatFormat, ChatFormatError, Message
from mesh.template.loader import Template, matching
from mesh.template.prefix import truncate
from mesh.worker.evidence import (
    Evidence,
    cited,
    defined_lines,
    evidence_of,
    named_files,
    outline_lines,
    unknown_files,
)
from mesh.worker.grammar import (
    ParsedTurn,
    ProjectPaths,
    ToolCall,
    parse_turn,
    sentence_grammar,
    turn_grammar,
)
from mesh.worker.text import (
    NO_ANSWER,
    LoopGuard,
    clean,
    echoed,
    fragment,
    instruction_sentences,
    prose_params,
    template_sentences,
    without_echo,
)
from mesh.worker.tools import ToolError, ToolFn
from mesh.worker.types import Emit, EventKind, Subtask, WorkerEvent, WorkerResult

__all__ = [
    "PLACE_EVERY_S", "PLACE_POLL_S", "SESSION_SYSTEM", "AgentWorker", "Tally", "WorkerFailed",
    "WorkerLimits", "attached", "closed_text", "place_text", "release", "stream_turn"
]


# -------------------- one streamed turn ---------------------------------------

logger = logging.getLogger(__name__)


class WorkerFailed(Exception):
    """The subtask failed; the message is the reason shown to the client."""


# A turn the decode gate holds: its place in line is read this often (a dict read on the
# engine, Engine.turn_place) and said as a status event when it changed, at most once per
# PLACE_EVERY_S.
PLACE_POLL_S = 0.25
PLACE_EVERY_S = 1.0


def place_text(place: int) -> str:
    """The status line of a turn the decode gate holds at ``place``."""
    return f"waiting for a decode turn (#{place} in line)"


async def _say_places(place: Callable[[], int | None], emit: Emit, turn: int,
                      stop: asyncio.Event) -> None:
    """Until ``stop``: a status event each time ``place()`` (None while the turn runs)
    changes to a place, at most every :data:`PLACE_EVERY_S`. A failing read or write ends
    the watch, never the turn."""
    said: int | None = None
    said_at = -PLACE_EVERY_S
    try:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(PLACE_POLL_S):
                    await stop.wait()
            if stop.is_set():
                return
            now = place()
            if now is None:
                said = None  # running (again): a later wait is said anew
                continue
            if now == said or time.monotonic() - said_at < PLACE_EVERY_S:
                continue
            said, said_at = now, time.monotonic()
            await emit(WorkerEvent(EventKind.STATUS, place_text(now), turn,
                                   {"turn_place": now}))
    except Exception:
        logger.debug("turn %d: its place in line is no longer said", turn, exc_info=True)


@contextlib.asynccontextmanager
async def _places_said(place: Callable[[], int | None] | None, emit: Emit,
                       turn: int) -> AsyncIterator[Emit]:
    """``emit``, with ``place`` made one write at a time beside a :func:`_say_places` watch
    that ends with the block, at its next look (never cut mid-write)."""
    if place is None:
        yield emit
        return
    lock = asyncio.Lock()
    stop = asyncio.Event()

    async def say(event: WorkerEvent) -> None:
        async with lock:
            await emit(event)

    watch = asyncio.create_task(_say_places(place, say, turn, stop))
    try:
        yield say
    finally:
        stop.set()
        with anyio.CancelScope(shield=True):
            await watch


async def stream_turn(
    session: Session, params: SamplingParams, emit: Emit, turn: int, *,
    loop_stop: bool = False, place: Callable[[], int | None] | None = None,
) -> EngineTurn:
    """Generate one turn, emitting each piece; on any early exit, stop the generation.

    With ``loop_stop`` (answers and syntheses; never a scenario's turn, whose length is
    the load it simulates) a turn that repeats a phrase
    (:class:`~mesh.worker.text.LoopGuard`) is stopped there: its result is the text before
    the repeat, with finish reason ``loop`` (a finished turn).

    With ``place`` (a worker's turns: ``partial(engine.turn_place, session.id)``) a turn
    the decode gate holds says its place in line while it waits (:func:`place_text`,
    ``data["turn_place"]``), when it changed, at most about once a second; its events and
    the turn's own go out one at a time.
    """
    generation = session.generate(params)
    pieces = generation.__aiter__()
    guard = LoopGuard() if loop_stop else None
    generated = 0
    finished = False
    try:
        async with _places_said(place, emit, turn) as say:
            async for piece in pieces:
                generated += piece.token >= 0
                if piece.paused_s:  # the decode gate paused the turn: waiting, not decoding
                    await say(WorkerEvent(
                        EventKind.STATUS,
                        f"paused {piece.paused_s:.2f} s by the decode gate to keep the floor",
                        turn, {"paused_s": round(piece.paused_s, 4)}))
                if piece.text:
                    await say(WorkerEvent(EventKind.TEXT, piece.text, turn))
                    if guard is not None and guard.feed(piece.text) is not None:
                        break
            else:
                finished = True
    finally:
        if not finished:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await generation.aclose()
                close = getattr(pieces, "aclose", None)
                if close is not None:
                    await close()
    if guard is not None and guard.cut is not None:
        return EngineTurn(text=guard.text[:guard.cut].rstrip(), num_prompt_tokens=0,
                          num_generated=generated, finish_reason="loop", decode_s=0.0)
    if generation.result is None:
        raise WorkerFailed(f"the engine ended turn {turn} without a result")
    return generation.result


async def release(session: Session) -> None:
    """Detach ``session`` even while the caller is being cancelled."""
    with anyio.CancelScope(shield=True):
        await session.detach()


@contextlib.asynccontextmanager
async def attached(engine: Engine, subtask: Subtask) -> AsyncIterator[Session]:
    """A fresh session for ``subtask``, released (:func:`release`) whatever the exit; an
    engine that cannot attach one fails the subtask (:class:`WorkerFailed`)."""
    try:
        session = await engine.attach()
    except EngineError as exc:
        raise WorkerFailed(f"subtask {subtask.id}: no session: {exc}") from exc
    try:
        yield session
    finally:
        await release(session)


def closed_text(result: EngineTurn, stops: tuple[str, ...]) -> str:
    """The turn's text with its matched stop string, as the session's context holds it
    (an engine that names no stop may have left its first pieces in: completed here)."""
    if result.stop is not None:
        return result.text + result.stop
    if result.finish_reason == "stop":
        for stop in stops:
            for k in range(len(stop), 0, -1):
                if result.text.endswith(stop[:k]):
                    return result.text[: len(result.text) - k] + stop
    return result.text


@dataclass
class Tally:
    """One subtask's run on its session: the conversation so far, what the tools showed
    and what its turns produced; :meth:`result` is the worker's result."""

    session: Session
    subtask: Subtask
    emit: Emit
    messages: list[Message]
    hinted: bool = False  # the first message showed outline lines that match the request
    seen: dict[str, int] = field(default_factory=dict)  # each call made -> its turn
    shown: list[Evidence] = field(default_factory=list)  # what the tools showed, in order
    answer_now: bool = False  # the next turn offers only the answer
    turns: int = 0
    generated: int = 0
    tool_calls: int = 0
    parse_errors: int = 0
    repeated_calls: int = 0
    compactions: int = 0
    last_text: str = ""
    finishes: list[str] = field(default_factory=list)

    def result(self, answer: str, finish: str, **extra: Any) -> WorkerResult:
        return WorkerResult(
            answer=answer, num_turns=self.turns, num_generated=self.generated,
            num_tool_calls=self.tool_calls, finish_reason=finish,
            data={"session_id": self.session.id, "parse_errors": self.parse_errors,
                  "repeated_calls": self.repeated_calls, "compactions": self.compactions,
                  "turn_finishes": list(self.finishes), **extra})

# -------------------- the loop ------------------------------------------------

# A session renders its turns without the shared system text (ChatFormat.check makes sure
# the continuation does not depend on it); this stands in for it.
SESSION_SYSTEM = "(the shared prefix)"
# The one repair turn a fragment gets: room for a sentence naming a path.
REPAIR_TOKENS = 160
# A session whose suffix would pass this share of its budget with the next tool results
# and a turn compacts first (the prefix is shared and never compacted).
COMPACT_AT = 0.8
_HINT_NAMES = 6  # names an outline line repeated in the first message shows
_REPAIR = ("Your answer is not whole or not grounded ({why}): {answer}. Write the whole "
           "answer again as one complete sentence, naming the project file it comes from if "
           "there is one (its path, as the outline writes it), between {open} and {close}.")
_REPAIR_SENTENCES = tuple(instruction_sentences(
    [_REPAIR.format(why="\n", answer="\n", open="\n", close="\n")], min_words=4))


@dataclass(frozen=True)
class WorkerLimits:
    max_turns: int = 8
    max_tokens_per_turn: int = 256
    max_total_tokens: int = 2048
    max_tool_output_tokens: int = 512

    @classmethod
    def from_template(cls, template: Template) -> WorkerLimits:
        m = template.manifest
        return cls(max_turns=m.turns.max_turns, max_tokens_per_turn=m.turns.max_tokens_per_turn,
                   max_total_tokens=m.turns.max_total_tokens,
                   max_tool_output_tokens=m.tools.max_output_tokens)

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

    def __init__(self, engine: Engine, template: Template, tools: Mapping[str, ToolFn], *,
                 limits: WorkerLimits | None = None, chat: ChatFormat | None = None,
                 paths: ProjectPaths | None = None, first_call: bool = False) -> None:
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
        async with attached(self._engine, subtask) as session:
            await emit(WorkerEvent(EventKind.STATUS, f"session {session.id} attached"))
            return await self._turns(self._start(session, subtask, emit))

    def _start(self, session: Session, subtask: Subtask, emit: Emit) -> Tally:
        """The run, its first message written: the instructions and the outline's lines
        that match the request, repeated next to it (a small model copies what is near its
        question far better than what is 5K tokens back)."""
        lines = [e.line(_HINT_NAMES) for e in matching(subtask.instructions,
                                                        self._template.outline)]
        first = self._template.instructions(subtask.id, subtask.instructions,
                                            lines).strip("\n")
        return Tally(session, subtask, emit, [{"role": "user", "content": first}],
                     hinted=bool(lines))

    async def _turns(self, run: Tally) -> WorkerResult:
        syntax = self._template.manifest.tool_calls
        lim = self.limits
        try:
            run.session.append(self._chat.continuation(SESSION_SYSTEM, run.messages))
            for turn in range(1, lim.max_turns + 1):
                result, reply = await self._generate(run, turn)
                if result.finish_reason == "context_full":
                    return await self._whole(run, result.text, "context_full")
                cut = result.finish_reason not in ("stop", "eos", "loop")
                parsed = parse_turn(reply, syntax)
                run.parse_errors += len(parsed.errors)
                if not cut and (parsed.answer is not None
                                or (not parsed.calls and not parsed.errors)):
                    # The turn's text as a whole, not the tail after the answer tag.
                    return await self._answer(run, reply, "answer")
                if turn == lim.max_turns:
                    break
                if run.generated >= lim.max_total_tokens:
                    return await self._answer(run, reply, "max_tokens")
                await self._follow(run, reply, await self._results(run, turn, result, parsed,
                                                                   cut))
        except ContextOverflow as exc:
            if run.generated == 0:
                # Nothing was produced: the input itself does not fit the session.
                raise WorkerFailed(
                    f"subtask {run.subtask.id}: the message does not fit the session's "
                    f"context budget ({exc}); send a shorter message or raise --session-budget"
                ) from exc
            # No room for a repair turn: the text as it stands, if whole.
            return await self._whole(run, run.last_text, "max_tokens",
                                     context_overflow=str(exc))
        except ChatFormatError as exc:
            raise WorkerFailed(f"subtask {run.subtask.id}: chat format {self._chat.name}: "
                               f"{exc}") from exc
        except EngineError as exc:
            raise WorkerFailed(f"subtask {run.subtask.id} failed on turn {run.turns}: "
                               f"{exc}") from exc
        return await self._answer(run, run.last_text, "max_turns")

    async def _generate(self, run: Tally, turn: int) -> tuple[EngineTurn, str]:
        """Turn ``turn`` under its grammar: its result, and its text as the session holds
        it (:func:`closed_text`)."""
        syntax = self._template.manifest.tool_calls
        lim = self.limits
        run.turns = turn
        budget = min(lim.max_tokens_per_turn, lim.max_total_tokens - run.generated)
        await run.emit(WorkerEvent(EventKind.TURN_STARTED, f"turn {turn}", turn))
        grammar = self._grammar(budget, answer_only=run.answer_now or turn == lim.max_turns,
                                call_only=self._first_call and turn == 1)
        params = self._params(budget, run.subtask.priority, (syntax.close, syntax.answer_close),
                              grammar, first=True)
        result = await self._stream(run.session, params, run.emit, turn)
        run.generated += result.num_generated
        run.last_text = result.text
        run.finishes.append(result.finish_reason)
        return result, closed_text(result, params.stop)

    async def _results(self, run: Tally, turn: int, result: EngineTurn, parsed: ParsedTurn,
                       cut: bool) -> str:
        """The next user message: a cut turn is told so (its calls are not run); else each
        call's result (a call made before is not run again, and the next turn may only
        answer), then each unreadable call's error."""
        syntax = self._template.manifest.tool_calls
        report = partial(self._template.tool_result, turn=turn)
        if cut:
            return report(
                call="(turn cut)", is_error=True,
                output=f"your turn was cut after {result.num_generated} tokens "
                f"({result.finish_reason}); write one short tool call or the "
                f"answer between {syntax.answer_open} and {syntax.answer_close}").strip("\n")
        results: list[str] = []
        for call in parsed.calls:
            key = call.display()
            if key in run.seen:
                run.answer_now = True
                run.repeated_calls += 1
                output, is_error = (f"you already called {key} on turn {run.seen[key]}; its "
                                    f"result is above. Do not call it again: write the answer "
                                    f"now between {syntax.answer_open} and "
                                    f"{syntax.answer_close}"), True
                await run.emit(WorkerEvent(EventKind.TOOL_RESULT, output, turn,
                                           {"error": True, "repeated": True}))
            else:
                run.seen[key] = turn
                output, is_error = await self._call(call, run.emit, turn)
                run.tool_calls += 1
                if not is_error:
                    run.shown.extend(evidence_of(call.name, output))
            results.append(report(call=key, output=output, is_error=is_error))
        for error in parsed.errors:
            await run.emit(WorkerEvent(EventKind.TOOL_RESULT, error, turn, {"error": True}))
            results.append(report(call="(unreadable call)", output=error, is_error=True))
        return "\n\n".join(r.strip("\n") for r in results)

    async def _follow(self, run: Tally, reply: str, user: str) -> None:
        """Append ``reply``'s closing and ``user`` as the next message; near the budget
        (:meth:`_near_budget`) compact the turns into :meth:`_summary` instead, if it fits."""
        tail = self._chat.reply_tail(run.messages, user)
        if self._near_budget(run.session, tail):
            compacted: list[Message] = [{"role": "user", "content": self._summary(run, user)}]
            text = self._chat.continuation(SESSION_SYSTEM, compacted)
            freed = run.session.context_len - self._engine.info.prefix_tokens
            try:
                is_compacted = await run.session.compact(text)
            except ContextOverflow:  # not even the summary fits: as before
                is_compacted = False
            if is_compacted:
                run.compactions += 1
                run.messages[:] = compacted
                await run.emit(WorkerEvent(
                    EventKind.STATUS, f"compacted {freed} tokens of turns into a summary",
                    run.turns, {"compaction": run.compactions}))
                return
        run.session.append(tail)
        run.messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": user}]

    def _params(self, budget: int, priority: float | None, stop: tuple[str, ...],
                grammar: str | None, *, first: bool = False) -> SamplingParams:
        """A worker turn's sampling: repetition control on the prose (reasoning, then the
        answer after its open tag), never on a call's syntax."""
        return prose_params(SamplingParams(
            max_tokens=budget, priority=priority, stop=stop, grammar=grammar,
            temperature=self._template.manifest.turns.temperature,
        ), opens=(self._template.manifest.tool_calls.answer_open,), close="<", first=first)

    async def _stream(self, session: Session, params: SamplingParams, emit: Emit,
                      turn: int) -> EngineTurn:
        """One worker turn: a loop ends it, a wait in the decode gate's line is said."""
        return await stream_turn(session, params, emit, turn, loop_stop=True,
                                 place=partial(self._engine.turn_place, session.id))

    def _near_budget(self, session: Session, tail: str) -> bool:
        """Whether appending ``tail`` and one more turn would take the session's suffix past
        :data:`COMPACT_AT` of its budget."""
        info = self._engine.info
        need = self._engine.count_tokens(tail) + self.limits.max_tokens_per_turn
        return session.context_len - info.prefix_tokens + need > COMPACT_AT * info.session_budget

    def _summary(self, run: Tally, latest: str) -> str:
        """The turns so far as one message: the task, the calls made, the evidence found
        (not its text), the latest tool results whole, and the open question. Built, not
        generated: a small model's summary loses exactly what matters."""
        syntax = self._template.manifest.tool_calls
        calls = ", ".join(f"{key} (turn {turn})" for key, turn in run.seen.items()) or "none"
        found = "; ".join(dict.fromkeys(e.label() for e in run.shown)) or "nothing yet"
        return (f"{run.subtask.instructions}\n\n"
                f"(Earlier turns, compacted.) Calls made: {calls}. Evidence found: {found}.\n\n"
                f"The latest results:\n{latest.strip()}\n\n"
                f"The open question is the request above: answer it between "
                f"{syntax.answer_open} and {syntax.answer_close}, or make one new tool call.")

    def _readable(self, text: str) -> tuple[str, int]:
        """What a user may read of ``text``: no turn markup, no loop, none of the
        template's own sentences (:mod:`mesh.worker.text`); and how many were removed."""
        syntax = self._template.manifest.tool_calls
        tags = (syntax.open, syntax.close, syntax.answer_open, syntax.answer_close)
        text = clean(text, tags)
        echoes = len(echoed(text, self._sentences))
        return (without_echo(text, self._sentences) if echoes else text), echoes

    async def _whole(self, run: Tally, text: str, finish: str, **extra: object) -> WorkerResult:
        """The result for ``text`` with no repair turn left: the text if it is whole,
        else a line saying that no whole answer was written."""
        answer, echoes = self._readable(text)
        why = "" if answer == NO_ANSWER else fragment(answer)
        data: dict[str, object] = {"echoed_sentences": echoes} if echoes else {}
        if why:  # never passed on: the answer says so, the fragment stays in the data
            data["fragment"] = answer
            answer = f"No complete answer: the model's text was {why}."
        evidence = await self._evidence(answer, run.shown)
        return run.result(answer, finish, evidence=evidence, **data, **extra)

    async def _answer(self, run: Tally, text: str, finish: str, **extra: object) -> WorkerResult:
        """The subtask's result for the final ``text``: whole, or repaired by one more turn
        under the sentence grammar (see the module doc)."""
        answer, _ = self._readable(text)
        why = fragment(answer)
        files = self._paths.files if self._paths is not None else ()
        made_up = unknown_files(answer, files)
        named = named_files(answer, files)
        if made_up and not why:  # a file the project does not have
            why = f"it names {', '.join(made_up[:3])}, which the project does not have"
        if run.hinted and not why and files and not named:
            # The request matched the outline (its lines were shown): an answer grounded
            # in the project names one of its files.
            why = "it names none of the project's files, though the request is about them"
        if not why or answer == NO_ANSWER:  # NO_ANSWER: says itself what went wrong
            return await self._whole(run, text, finish, **extra)
        syntax = self._template.manifest.tool_calls
        await run.emit(WorkerEvent(EventKind.STATUS, f"the answer is not whole ({why}); asking "
                                   "for one complete sentence", run.turns, {"fragment": why}))
        ask = _REPAIR.format(why=why, answer=repr(answer[:200]), open=syntax.answer_open,
                             close=syntax.answer_close)
        # An answer that meant to name a file, or a request the outline matched (its
        # lines were shown): the repair names one of the project's files.
        grammar = sentence_grammar(syntax, REPAIR_TOKENS, self._paths,
                                   name_path=bool(made_up or named or run.hinted))
        params = self._params(REPAIR_TOKENS, run.subtask.priority, (syntax.answer_close,),
                              grammar)
        try:
            run.session.append(self._chat.reply_tail(run.messages, ask))
            run.messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": ask}]
            run.turns += 1
            await run.emit(WorkerEvent(EventKind.TURN_STARTED, f"turn {run.turns}", run.turns))
            result = await self._stream(run.session, params, run.emit, run.turns)
        except (ContextOverflow, EngineError, WorkerFailed):
            return await self._whole(run, text, finish, **extra)  # no room to repair
        run.generated += result.num_generated
        run.finishes.append(result.finish_reason)
        # The request read back is no answer: the first text stands.
        repaired = text if echoed(result.text, _REPAIR_SENTENCES) else result.text
        return await self._whole(run, repaired, finish, repaired=why, **extra)

    async def _evidence(self, answer: str, shown: list[Evidence]) -> list[dict[str, object]]:
        """The evidence ``answer`` names (:func:`mesh.worker.evidence.cited`); a named
        file no tool showed gets the lines its outline entry gives (source ``outline``),
        else the lines the worker's own ``read_file`` shows of what the answer speaks of."""
        files = self._paths.files if self._paths is not None else ()
        outline = {entry.path: entry for entry in self._template.outline}
        out: list[dict[str, object]] = []
        read = self._tools.get("read_file")
        for e in cited(answer, shown, files or tuple(outline)):
            if e.source == "named" and e.path in outline:
                e = Evidence(e.path, outline_lines(answer, outline[e.path]), "outline")
            elif e.source == "named" and read is not None:
                try:
                    lines = defined_lines(answer, await read({"path": e.path, "lines": 2000}))
                except (ToolError, OSError):
                    lines = ""
                e = Evidence(e.path, lines, "named")
            out.append(e.to_dict())
        return out

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
