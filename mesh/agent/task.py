"""The coordinator as an agent: plan on the pool, delegate through the gate, synthesize.

Life of a planned task (a message without an explicit ``subtasks`` list, ``plan`` not
``never``)::

    working "planning" ─▶ stream-plan chunks ─▶ working event=plan + the ``plan`` artifact
      ├─ action answer   ─▶ completed with the ``answer`` artifact (no worker)
      ├─ action ask      ─▶ input-required with the question (the reply resumes the task)
      └─ action delegate ─▶ every subtask p1..pN through the gate like an explicit one
                            (one failing does not cancel the others)
                         ─▶ synthesis turn (stream-synthesis) ─▶ completed with ``answer``
                            (what failed is said) │ failed when every worker failed

The planning and synthesis turns are pool sessions admitted by the gate like workers (keys
``<task>/plan`` and ``<task>/synthesis``), so they share the prefix and keep the floor.
Queue places: the door counted one for the planning turn; a plan's N subtasks enter the
gate's queue only once all N fit its free places and the caller's share (the task waits
outside the queue until then), so a plan never takes the queue past its bound.
In ``auto`` mode a plan that does not parse (or a planning turn that fails) falls back to
the message as one subtask, answered as the dispatcher did; in ``always`` mode it fails the
task. The events go through a :class:`TaskEvents` writer (the executor's run).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from a2a.types import a2a_pb2 as pb

from mesh.agent.history import Conversations
from mesh.agent.plans import (
    ACTIONS,
    Plan,
    PlanError,
    fallback_plan,
    max_plan_chars,
    parse_plan,
    plan_prompt,
    plan_schema,
    schema_to_gbnf,
)
from mesh.agent.request_parts import request_parts
from mesh.agent.synthesis import (
    Outcome,
    direct_answer,
    joined_answers,
    missing_note,
    needs_synthesis,
    summary,
    synthesis_answer,
    synthesis_prompt,
)
from mesh.engine.types import Engine, EngineError, SamplingParams, TurnResult
from mesh.gate.types import Admission
from mesh.worker.loop import WorkerFailed, release, stream_turn
from mesh.worker.text import prose_params
from mesh.worker.types import EventKind, Subtask, WorkerEvent, WorkerResult

__all__ = [
    "PLAN_ARTIFACT",
    "PLAN_MODES",
    "PLAN_STYLES",
    "Agent",
    "AgentConfig",
    "AgentTask",
    "plain_turn",
]

logger = logging.getLogger(__name__)

PLAN_MODES = ("auto", "always", "never")
# free: the model writes each subtask's instructions; guided: each subtask is one part of
# the request (mesh.agent.request_parts) and the model adds files, tools and detail.
PLAN_STYLES = ("free", "guided")
PLAN_ARTIFACT = "plan"
ANSWER_ARTIFACT = "answer"
S = pb.TaskState


def plain_turn(prompt: str) -> str:
    """How a coordinator turn's prompt is written into its session (plain text for now;
    the model's chat format replaces this once it is available)."""
    return prompt


@dataclass(frozen=True)
class AgentConfig:
    """How the coordinator plans. ``history_tokens`` bounds what a follow-up's plan sees
    of the earlier conversation; ``text_max`` bounds each string of a plan (characters);
    ``style`` is one of :data:`PLAN_STYLES`; ``files`` (the project's, as the prefix names
    them) are the only file names a plan may give, when there are any."""

    plan: str = "auto"
    style: str = "free"
    files: tuple[str, ...] = ()
    max_subtasks: int = 4
    text_max: int = 240
    history_tokens: int = 512
    temperature: float = 0.0
    synthesis_max_tokens: int = 256
    actions: tuple[str, ...] = ACTIONS
    tools: tuple[str, ...] = ()
    # The instruction texts of the shared prefix (a template's own text, not the
    # project's): a synthesis or direct answer that reproduces a sentence of them is an echo.
    instructions: tuple[str, ...] = ()

    def validate(self) -> None:
        if self.plan not in PLAN_MODES:
            raise ValueError(f"plan must be one of {PLAN_MODES}, got {self.plan!r}")
        if self.style not in PLAN_STYLES:
            raise ValueError(f"style must be one of {PLAN_STYLES}, got {self.style!r}")
        if self.max_subtasks < 1:
            raise ValueError(f"max_subtasks must be >= 1, got {self.max_subtasks}")
        if self.history_tokens < 0:
            raise ValueError(f"history_tokens must be >= 0, got {self.history_tokens}")
        if self.synthesis_max_tokens < 1:
            raise ValueError("synthesis_max_tokens must be >= 1")
        plan_schema(self.max_subtasks, self.tools, self.actions, self.text_max,
                    files=self.files)  # checks

    def schema(self, message: str) -> dict[str, Any]:
        """The plan schema for ``message``: guided plans follow the request's parts."""
        parts = request_parts(message, self.max_subtasks) if self.style == "guided" else ()
        return plan_schema(self.max_subtasks, self.tools, self.actions, self.text_max,
                           files=self.files, parts=parts)


class TextSink(Protocol):
    async def add(self, text: str) -> None: ...

    async def flush(self, now: float | None = None, *, last: bool = False) -> None: ...


class TaskEvents(Protocol):
    """The executor's event writer, as the agent uses it."""

    async def status(
        self, state: pb.TaskState, text: str, metadata: dict[str, Any] | None = None
    ) -> None: ...

    async def progress(self, text: str, metadata: dict[str, Any]) -> None: ...

    async def artifact(self, parts: list[pb.Part], **kwargs: Any) -> None: ...

    async def finish(self, state: pb.TaskState, text: str) -> None: ...


class Agent:
    """The coordinator's own turns on the pool, and the conversations it remembers."""

    def __init__(
        self,
        engine: Engine,
        config: AgentConfig,
        *,
        render: Callable[[str], str] = plain_turn,
    ) -> None:
        config.validate()
        self.engine = engine
        self.config = config
        self.render = render
        self.conversations = Conversations(engine.count_tokens)

    def plan_params(self, message: str = "") -> SamplingParams:
        """Sampling for the planning turn of ``message``: under the plan's grammar, within
        the longest plan it admits."""
        schema = self.config.schema(message)
        # Repetition control inside the plan's prose strings only, never on its JSON keys.
        return prose_params(SamplingParams(max_tokens=max_plan_chars(schema),
                                           temperature=self.config.temperature,
                                           grammar=schema_to_gbnf(schema)),
                            opens=('"answer":"', '"question":"', '"instructions":"'),
                            close='"')

    def synthesis_params(self) -> SamplingParams:
        """Free text with repetition control (and, in :func:`stream_turn`, a loop stop)."""
        return prose_params(SamplingParams(max_tokens=self.config.synthesis_max_tokens,
                                           temperature=self.config.temperature))

    async def turn(self, prompt: str, params: SamplingParams, sink: TextSink) -> TurnResult:
        """One turn on a fresh session: attach, write ``prompt``, generate, detach."""
        session = await self.engine.attach()
        try:
            session.append(self.render(prompt))
            # free text (the synthesis) stops at a loop; a plan's JSON is never cut
            result = await stream_turn(session, params, _sink_emit(sink), 1,
                                       loop_stop=params.grammar is None)
            await sink.flush(last=True)
            return result
        except WorkerFailed as e:
            raise EngineError(str(e)) from e
        finally:
            await release(session)


def _sink_emit(sink: TextSink) -> Callable[[WorkerEvent], Awaitable[None]]:
    async def emit(event: WorkerEvent) -> None:
        if event.kind is EventKind.TEXT:
            await sink.add(event.text)

    return emit


RunOne = Callable[[Subtask], Awaitable[WorkerResult]]
MakeSink = Callable[[str, str], TextSink]


@dataclass
class AgentTask:
    """One planned task run (see the module docstring). ``run_one`` is the executor's
    gate-and-worker path for one subtask; ``make_sink(artifact_id, name)`` streams text."""

    agent: Agent
    events: TaskEvents
    admission: Admission
    task_id: str
    conversation: str  # the owner-scoped context key
    message: str
    run_one: RunOne
    make_sink: MakeSink
    caller: str = ""  # whose share of the gate's queue this task's turns take

    # how often a plan waiting for room in the queue asks again (at most)
    room_poll_s: float = 1.0

    async def run(self) -> None:
        cfg = self.agent.config
        window = self.agent.conversations.window(self.conversation, cfg.history_tokens)
        history = window.render()
        if window.entries or window.dropped:
            dropped = f"; {window.dropped} older dropped to fit" if window.dropped else ""
            await self.events.status(
                S.TASK_STATE_WORKING,
                f"conversation: {len(window.entries)} earlier message(s), {window.tokens} "
                f"tokens (budget {cfg.history_tokens}){dropped}",
                {"event": "context", "entries": len(window.entries), "dropped": window.dropped},
            )
        self.agent.conversations.add(self.conversation, "user", self.message)
        plan = await self._plan(history)
        if plan is None:
            return
        await self._publish(plan)
        if plan.action == "answer":
            await self._complete(plan, direct_answer(plan.answer, cfg.tools, cfg.max_subtasks,
                                                     cfg.instructions), [])
        elif plan.action == "ask":
            self.agent.conversations.add(self.conversation, "question", plan.question)
            await self.events.finish(S.TASK_STATE_INPUT_REQUIRED, plan.question)
        else:
            await self._delegate(plan, history)

    async def _admitted_turn(self, key: str, prompt: str, params: SamplingParams) -> TurnResult:
        async def on_position(position: int) -> None:
            if position > 0:
                await self.events.progress(f"[{key}] queued for the gate at position {position}",
                                           {"subtask": key, "event": "queued",
                                            "queue_position": position})

        ticket = await self.admission.admit(f"{self.task_id}/{key}", on_position, accepted=True,
                                            caller=self.caller)
        try:
            await self.events.status(S.TASK_STATE_WORKING, f"[{key}] admitted; {key} turn",
                                     {"subtask": key, "event": "admitted"})
            sink = self.make_sink(f"stream-{key}", f"{key} output")
            return await self.agent.turn(prompt, params, sink)
        finally:
            await ticket.release()

    async def _plan(self, history: str) -> Plan | None:
        cfg = self.agent.config
        parts = request_parts(self.message, cfg.max_subtasks) if cfg.style == "guided" else ()
        prompt = plan_prompt(self.message, history, cfg.tools, cfg.max_subtasks, parts)
        try:
            turn = await self._admitted_turn("plan", prompt, self.agent.plan_params(self.message))
            return parse_plan(turn.text, cfg.max_subtasks)
        except (PlanError, EngineError) as e:
            if cfg.plan == "always":
                await self.events.finish(S.TASK_STATE_FAILED, f"planning failed: {e}")
                return None
            await self.events.status(S.TASK_STATE_WORKING,
                                     f"planning failed ({e}); running the message as one subtask",
                                     {"event": "plan_fallback"})
            return fallback_plan(self.message)

    async def _publish(self, plan: Plan) -> None:
        data = plan.to_dict()
        if plan.action == "delegate":
            text = f"plan: {len(plan.subtasks)} subtask(s): " + "; ".join(
                f"[p{i + 1}] {s.instructions[:80]}" for i, s in enumerate(plan.subtasks))
        else:
            text = f"plan: {plan.action}"
        await self.events.status(S.TASK_STATE_WORKING, text, {"event": "plan", "plan": data})
        part = pb.Part()
        part.data.struct_value.update(data)
        await self.events.artifact([part], artifact_id=PLAN_ARTIFACT, name=PLAN_ARTIFACT,
                                   last_chunk=True)

    async def _delegate(self, plan: Plan, history: str) -> None:
        subtasks = [
            Subtask(id=f"{self.task_id}/p{i + 1}",
                    instructions=s.worker_instructions(self.message, history))
            for i, s in enumerate(plan.subtasks)
        ]
        await self._wait_for_room(len(subtasks))
        outcomes = list(await asyncio.gather(*(self._settle(s) for s in subtasks)))
        outcomes = [
            Outcome(o.id, p.instructions, o.result, o.error)
            for o, p in zip(outcomes, plan.subtasks, strict=True)
        ]
        if not any(o.ok for o in outcomes):
            reasons = "; ".join(f"[{o.id}] {o.error}" for o in outcomes)
            await self.events.finish(S.TASK_STATE_FAILED,
                                     f"all {len(outcomes)} subtask(s) failed: {reasons}")
            return
        answer = await self._synthesize(plan, outcomes, history)
        note = missing_note(outcomes)
        if note:
            answer = f"{answer}\n\n{note}" if answer else note
        await self._complete(plan, answer, outcomes)

    async def _wait_for_room(self, places: int) -> None:
        """Return once the gate's queue can take ``places`` more of this caller's subtasks
        (the door promised the planning turn one place, not its plan's subtasks)."""
        said = False
        while True:
            check = self.admission.check_queue(places=places, caller=self.caller)
            if check.ok:
                return
            if not said:
                said = True
                await self.events.progress(
                    f"waiting for room in the gate's queue for {places} subtask(s): "
                    f"{check.reason}", {"event": "waiting_for_room", "places": places})
            await anyio.sleep(min(max(check.retry_after_s, 0.05), self.room_poll_s))

    async def _settle(self, subtask: Subtask) -> Outcome:
        sid = subtask.id.rsplit("/", 1)[-1]
        try:
            return Outcome(sid, subtask.instructions, result=await self.run_one(subtask))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a failed worker is an outcome; its siblings go on
            return Outcome(sid, subtask.instructions, error=str(e) or type(e).__name__)

    async def _synthesize(self, plan: Plan, outcomes: list[Outcome], history: str) -> str:
        # One subtask (that answered): its worker's answer is the answer, no synthesis turn.
        if plan.source == "fallback" or not needs_synthesis(outcomes):
            return joined_answers(outcomes)
        prompt = synthesis_prompt(self.message, plan, outcomes, history)
        try:
            turn = await self._admitted_turn("synthesis", prompt, self.agent.synthesis_params())
        except EngineError as e:
            logger.info("synthesis of %s failed: %s", self.task_id, e)
            await self.events.status(S.TASK_STATE_WORKING,
                                     f"synthesis failed ({e}); answering with the reports",
                                     {"event": "synthesis_fallback"})
            return joined_answers(outcomes)
        answer, replaced = synthesis_answer(turn.text, plan, outcomes,
                                            self.agent.config.instructions)
        if replaced:
            await self.events.status(S.TASK_STATE_WORKING, f"{replaced}; answering with the "
                                     "workers' reports", {"event": "synthesis_replaced"})
        return answer

    async def _complete(self, plan: Plan, answer: str, outcomes: list[Outcome]) -> None:
        self.agent.conversations.add(self.conversation, "answer", answer)
        data = pb.Part()
        data.data.struct_value.update({"plan": plan.to_dict(), "subtasks": summary(outcomes)})
        await self.events.artifact([pb.Part(text=answer), data], artifact_id=ANSWER_ARTIFACT,
                                   name=ANSWER_ARTIFACT, last_chunk=True)
        done = sum(1 for o in outcomes if o.ok)
        text = (f"completed: {done} of {len(outcomes)} subtask(s) answered" if outcomes
                else "completed: answered without workers")
        await self.events.finish(S.TASK_STATE_COMPLETED, text)
