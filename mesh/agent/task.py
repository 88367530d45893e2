"""A task's life: the coordinator's configuration, the event writer's seam, the fan-out to
workers, and the one task path.

**Events.** The A2A executor (:mod:`mesh.a2a.executor`) implements :class:`TaskEvents`
over the SDK's event queue; the agent only calls it. The artifact names are the task's
public surface.

**The fan-out.** :func:`run_subtask` is one subtask's life: queue for the gate (its queue
position said as progress), admitted, the worker runs (its text streamed as
``stream-<id>``, its other events as status lines), the admission released in a
``finally``. :func:`fan_out` runs a task's subtasks at once: a worker that raises fails
only its own subtask (:class:`SubtaskFailed`); anything else (the gate breaking, a write
failing, a full queue) cancels the rest and is raised, so the task fails with it.

**The task.** Every task runs :meth:`AgentTask.run`, whatever its message::

    explicit subtasks, or planning off ─▶ the explicit plan (no planning turn)
    otherwise: working "planning" ─▶ the plan forming as status lines ─▶ working
      event=plan (the plan in the task's metadata, ``plan``)
      ├─ action answer   ─▶ completed with the ``answer`` artifact (no worker)
      ├─ action ask      ─▶ input-required with the question (the reply resumes the task)
      └─ action delegate ─▶ every subtask through the gate at once ─▶ a synthesis turn
         (stream-synthesis) for a model's plan of two or more ─▶ completed with
         ``answer`` (what failed is said) │ failed when every worker failed

The planning and synthesis turns are pool sessions admitted by the gate like workers (keys
``<task>/plan`` and ``<task>/synthesis``), so they share the prefix and keep the floor.
Queue places: the door counted one per explicit subtask, else one for the planning turn; a
plan's N subtasks enter the gate's queue only once all N fit its free places and the
caller's share, so a plan never takes the queue past its bound. In ``auto`` mode a plan
that does not parse (or a planning turn that fails) falls back to the message as one
subtask; in ``always`` mode it fails the task. Planned tasks (not explicit ones) remember
their context's conversation.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import anyio
from a2a.types import a2a_pb2 as pb

from mesh.agent.history import Conversations
from mesh.agent.plans import (
    ACTIONS,
    Plan,
    PlanError,
    SubtaskSpec,
    explicit_plan,
    fallback_plan,
    local_id,
    max_plan_chars,
    parse_plan,
    plan_prompt,
    plan_schema,
    request_parts,
    schema_to_gbnf,
)
from mesh.agent.synthesis import (
    Outcome,
    answer_parts,
    direct_answer,
    evidence,
    joined_answers,
    missing_note,
    needs_synthesis,
    synthesis_answer,
    synthesis_prompt,
)
from mesh.engine.config import SamplingParams
from mesh.engine.interface import Engine, EngineError, Session, TurnResult
from mesh.gate.queue import Admission, Hold, QueueFull, admitted
from mesh.worker.loop import WorkerFailed, release, stream_turn
from mesh.worker.text import fragment, prose_params
from mesh.worker.types import NO_HOPS, EventKind, Hops, Subtask, Worker, WorkerEvent, WorkerResult

__all__ = [
    "ANSWER_ARTIFACT", "PLAN_METADATA", "PLAN_MODES", "PLAN_STYLES", "Agent", "AgentConfig",
    "AgentTask", "SubtaskFailed", "TaskEvents", "TextSink", "WorkerFactory", "fan_out",
    "plain_turn", "run_subtask"
]


# -------------------- configuration -------------------------------------------

PLAN_MODES = ("auto", "always", "never")
# free: the model writes each subtask's instructions; guided: each subtask is one part of
# the request (mesh.agent.plans) and the model adds files, tools and detail.
PLAN_STYLES = ("free", "guided")


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
        if self.history_tokens < 0:
            raise ValueError(f"history_tokens must be >= 0, got {self.history_tokens}")
        if self.synthesis_max_tokens < 1:
            raise ValueError("synthesis_max_tokens must be >= 1")
        # checks max_subtasks, text_max, actions and files
        plan_schema(self.max_subtasks, self.tools, self.actions, self.text_max, files=self.files)

    def parts(self, message: str) -> tuple[str, ...]:
        """The request's parts a guided plan follows (none for a free plan)."""
        return request_parts(message, self.max_subtasks) if self.style == "guided" else ()

    def schema(self, message: str) -> dict[str, Any]:
        """The plan schema for ``message``."""
        return plan_schema(self.max_subtasks, self.tools, self.actions, self.text_max,
                           files=self.files, parts=self.parts(message))

# -------------------- events --------------------------------------------------

#: The artifact holding a task's answer: its text, then a data part ``{"plan": ...,
#: "subtasks": [...]}`` (:func:`mesh.agent.synthesis.summary`). Peers and nodes read it.
#: It is always the task's last artifact, and the only one that is not a ``stream-<id>``
#: of generated text: a client that shows the last artifact (or the only one, for a task
#: the plan answered) shows the answer. The plan is never an artifact (issue 41).
ANSWER_ARTIFACT = "answer"
#: The key of a planned task's metadata that holds its plan (:meth:`Plan.to_dict`); the
#: plan's status line (``event: plan``) carries it too, and the answer's data part.
PLAN_METADATA = "plan"


class TextSink(Protocol):
    """Generated text streamed as chunks of one artifact."""

    async def add(self, text: str) -> None: ...

    async def flush(self, now: float | None = None, *, last: bool = False) -> None: ...


class TaskEvents(Protocol):
    """The executor's event writer, as the agent uses it. Once the task reached a
    terminal state (``finish``, or a cancel) every call is a no-op."""

    async def status(
        self, state: pb.TaskState, text: str, metadata: dict[str, Any] | None = None,
        *, task_metadata: dict[str, Any] | None = None,
    ) -> None:
        """A status line; ``metadata`` rides on its message, ``task_metadata`` is merged
        into the task's own metadata."""

    async def progress(self, text: str, metadata: dict[str, Any]) -> None:
        """A status line in the task's current state (submitted while nothing ran yet)."""

    async def artifact(self, parts: list[pb.Part], **kwargs: Any) -> None: ...

    async def finish(self, state: pb.TaskState, text: str) -> None: ...

    def stream(self, artifact_id: str, name: str) -> TextSink:
        """A sink streaming text as chunks of the artifact ``artifact_id``."""
        ...

    def notes(self, key: str) -> TextSink:
        """A sink streaming text as working status lines (``subtask`` ``key``, ``event``
        ``text``): progress that is not an output (the plan forming)."""
        ...

    async def worker_event(self, sink: TextSink, sid: str, event: WorkerEvent) -> None:
        """What subtask ``sid``'s worker reported: text to ``sink``, the rest as status."""

# -------------------- the fan-out ---------------------------------------------

logger = logging.getLogger(__name__)

WorkerFactory = Callable[[], Worker]


class SubtaskFailed(Exception):
    """A worker raised; the message is the reason the client sees."""


@contextlib.asynccontextmanager
async def _admitted(events: TaskEvents, admission: Admission, key: str, sid: str, what: str,
                    caller: str) -> AsyncIterator[Hold]:
    """The gate's hold of ``key`` (``sid`` as the client names it): its queue position
    said as progress, then ``[sid] admitted; <what>``."""
    async def on_position(position: int) -> None:
        if position > 0:
            await events.progress(f"[{sid}] queued for the gate at position {position}",
                                  {"subtask": sid, "event": "queued", "queue_position": position})

    async with admitted(admission, key, on_position=on_position, accepted=True,
                        caller=caller) as hold:
        await events.status(pb.TaskState.TASK_STATE_WORKING, f"[{sid}] admitted; {what}",
                            {"subtask": sid, "event": "admitted"})
        yield hold


async def run_subtask(events: TaskEvents, admission: Admission, workers: WorkerFactory,
                      subtask: Subtask, caller: str = "") -> WorkerResult:
    """Run ``subtask`` on a fresh worker once the gate admits it (see the module doc);
    ``caller``: whose share of the gate's queue it takes. Raises :class:`SubtaskFailed`
    when the worker raised."""
    sid = local_id(subtask)
    # The request passed check_queue at the door for all its places (or its plan waited
    # for room): it queues, it is never rejected here. The worker attaches its own session;
    # the ticket is released (shielded) whatever the exit.
    async with _admitted(events, admission, subtask.id, sid, "worker started", caller):
        sink = events.stream(f"stream-{sid}", f"{sid} output")

        async def emit(event: WorkerEvent) -> None:
            await events.worker_event(sink, sid, event)

        try:
            result = await workers().run(subtask, emit)
        except (asyncio.CancelledError, QueueFull):
            raise
        except Exception as e:
            logger.info("subtask %s failed: %s", subtask.id, e, exc_info=True)
            raise SubtaskFailed(f"subtask {sid} failed: {str(e) or type(e).__name__}") from e
        await sink.flush(last=True)
        return result


async def fan_out(subtasks: Sequence[Subtask],
                  run_one: Callable[[Subtask], Awaitable[WorkerResult]],
                  ) -> list[WorkerResult | SubtaskFailed]:
    """Every subtask's result, or how its worker failed, in order (see the module doc)."""

    async def one(s: Subtask) -> WorkerResult | SubtaskFailed:
        try:
            return await run_one(s)
        except SubtaskFailed as e:
            return e

    if len(subtasks) == 1:
        return [await one(subtasks[0])]
    try:
        async with asyncio.TaskGroup() as group:
            jobs = [group.create_task(one(s)) for s in subtasks]
    except BaseExceptionGroup as eg:
        for exc in eg.exceptions:
            if isinstance(exc, QueueFull):
                raise exc from None
        raise
    return [job.result() for job in jobs]

# -------------------- the task ------------------------------------------------


S = pb.TaskState


def plain_turn(prompt: str) -> str:
    """How a coordinator turn's prompt is written into its session (plain text for now;
    the model's chat format replaces this once it is available)."""
    return prompt


class Agent:
    """The coordinator's own turns on the pool, and the conversations it remembers."""

    def __init__(self, engine: Engine, config: AgentConfig, *,
                 render: Callable[[str], str] = plain_turn) -> None:
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
        """One turn on a fresh session of its own (attached, then detached), outside the
        gate; a task's turns run on their admitted hold's session (:meth:`turn_on`)."""
        session = await self.engine.attach()
        try:
            return await self.turn_on(session, prompt, params, sink)
        finally:
            await release(session)

    async def turn_on(self, session: Session, prompt: str, params: SamplingParams,
                      sink: TextSink) -> TurnResult:
        """Write ``prompt`` into the fresh ``session`` and generate one turn; an engine
        failure is :class:`EngineError`. The caller detaches the session."""
        async def emit(event: WorkerEvent) -> None:
            if event.kind is EventKind.TEXT:
                await sink.add(event.text)

        try:
            session.append(self.render(prompt))
            # free text (the synthesis) stops at a loop; a plan's JSON is never cut
            result = await stream_turn(session, params, emit, 1, loop_stop=params.grammar is None)
            await sink.flush(last=True)
            return result
        except WorkerFailed as e:
            raise EngineError(str(e)) from e


@dataclass
class AgentTask:
    """One task's run (see the module docstring). ``agent`` plans and synthesizes (None:
    every message runs as its explicit plan); ``message`` is the request's text as the
    door read it; ``subtasks`` its explicit subtask list (None: plan the message);
    ``workers`` makes one worker per admitted subtask; ``hops`` travel on with every
    subtask (to any peer or node its worker asks)."""

    agent: Agent | None
    events: TaskEvents
    admission: Admission
    task_id: str
    conversation: str  # the owner-scoped context key
    message: str
    workers: WorkerFactory
    subtasks: Sequence[SubtaskSpec] | None = None
    caller: str = ""  # whose share of the gate's queue this task's turns take
    hops: Hops = NO_HOPS

    # how often a plan waiting for room in the queue asks again (at most)
    room_poll_s: float = 1.0
    # Completion order: every turn of this task (plan, workers, synthesis) asks the decode
    # gate with this priority, its start time, so turns of tasks already running go
    # before a new task's first turn (SamplingParams.priority).
    priority: float = field(default_factory=time.monotonic)

    async def run(self) -> None:
        agent = self.agent
        if self.subtasks is not None or agent is None or agent.config.plan == "never":
            await self._delegate(explicit_plan(self.subtasks, self.message), "")
            return
        cfg = agent.config
        window = agent.conversations.window(self.conversation, cfg.history_tokens)
        history = window.render()
        if window.entries or window.dropped:
            dropped = f"; {window.dropped} older dropped to fit" if window.dropped else ""
            await self.events.status(
                S.TASK_STATE_WORKING,
                f"conversation: {len(window.entries)} earlier message(s), {window.tokens} "
                f"tokens (budget {cfg.history_tokens}){dropped}",
                {"event": "context", "entries": len(window.entries), "dropped": window.dropped},
            )
        agent.conversations.add(self.conversation, "user", self.message)
        plan = await self._plan(agent, history)
        if plan is None:
            return
        await self._publish(plan)
        if plan.action == "answer":
            answer = direct_answer(plan.answer, cfg.tools, cfg.max_subtasks, cfg.instructions)
            if why := fragment(answer):  # never a fragment: a worker answers instead
                await self.events.status(
                    S.TASK_STATE_WORKING, f"the plan's answer is not whole ({why}); running "
                    "the message as one subtask", {"event": "answer_fragment"})
                await self._delegate(fallback_plan(self.message), history)
            else:
                await self._complete(plan, answer, [])
        elif plan.action == "ask":
            agent.conversations.add(self.conversation, "question", plan.question)
            await self.events.finish(S.TASK_STATE_INPUT_REQUIRED, plan.question)
        else:
            await self._delegate(plan, history)

    async def _admitted_turn(self, agent: Agent, key: str, prompt: str,
                             params: SamplingParams, *, notes: bool = False) -> TurnResult:
        """One coordinator turn through the gate; its text streams as ``stream-<key>``,
        or as status lines when ``notes`` (the plan: never an artifact)."""
        # the hold detaches the turn's session, then releases the ticket, whatever the exit
        async with _admitted(self.events, self.admission, f"{self.task_id}/{key}", key,
                             f"{key} turn", self.caller) as hold:
            sink = (self.events.notes(key) if notes
                    else self.events.stream(f"stream-{key}", f"{key} output"))
            session = await hold.attach(agent.engine)
            return await agent.turn_on(session, prompt, params, sink)

    async def _plan(self, agent: Agent, history: str) -> Plan | None:
        cfg = agent.config
        prompt = plan_prompt(self.message, history, cfg.tools, cfg.max_subtasks,
                             cfg.parts(self.message))
        try:
            turn = await self._admitted_turn(
                agent, "plan", prompt,
                replace(agent.plan_params(self.message), priority=self.priority), notes=True)
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
        # Metadata, never an artifact: a client that shows a task's first (or only)
        # artifact must not show the plan's JSON instead of the answer.
        await self.events.status(S.TASK_STATE_WORKING, text, {"event": "plan", "plan": data},
                                 task_metadata={PLAN_METADATA: data})

    def _worker_subtasks(self, plan: Plan, history: str) -> list[Subtask]:
        """The plan's subtasks as workers get them: an explicit one as the client wrote
        it, a planned one with the request (and the conversation) it belongs to."""
        explicit = plan.source == "explicit"
        return [
            Subtask(id=f"{self.task_id}/{sid}",
                    instructions=s.instructions if explicit
                    else s.worker_instructions(self.message, history),
                    params=s.params, hops=self.hops, priority=self.priority)
            for sid, s in zip(plan.subtask_ids(), plan.subtasks, strict=True)
        ]

    async def _delegate(self, plan: Plan, history: str) -> None:
        subtasks = self._worker_subtasks(plan, history)
        if plan.source != "explicit":  # the door counted the planning turn's place only
            await self._wait_for_room(len(subtasks))
        results = await fan_out(subtasks, functools.partial(
            run_subtask, self.events, self.admission, self.workers, caller=self.caller))
        outcomes = [
            Outcome(sid, p.instructions, error=str(r)) if isinstance(r, SubtaskFailed)
            else Outcome(sid, p.instructions, result=r)
            for sid, p, r in zip(plan.subtask_ids(), plan.subtasks, results, strict=True)
        ]
        failed = [o for o in outcomes if not o.ok]
        if len(failed) == len(outcomes):
            reason = str(failed[0].error) if len(failed) == 1 else (
                f"all {len(failed)} subtask(s) failed: "
                + "; ".join(f"[{o.id}] {o.error}" for o in failed))
            await self.events.finish(S.TASK_STATE_FAILED, reason)
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

    async def _synthesize(self, plan: Plan, outcomes: list[Outcome], history: str) -> str:
        # A plan the model did not write, or one subtask that answered: the workers'
        # answers are the answer, no synthesis turn.
        agent = self.agent
        if agent is None or plan.source != "model" or not needs_synthesis(outcomes):
            return joined_answers(outcomes)
        prompt = synthesis_prompt(self.message, plan, outcomes, history)
        try:
            params = replace(agent.synthesis_params(), priority=self.priority)
            turn = await self._admitted_turn(agent, "synthesis", prompt, params)
        except EngineError as e:
            logger.info("synthesis of %s failed: %s", self.task_id, e)
            await self.events.status(S.TASK_STATE_WORKING,
                                     f"synthesis failed ({e}); answering with the reports",
                                     {"event": "synthesis_fallback"})
            return joined_answers(outcomes)
        answer, replaced = synthesis_answer(turn.text, plan, outcomes, agent.config.instructions)
        if replaced:
            await self.events.status(S.TASK_STATE_WORKING, f"{replaced}; answering with the "
                                     "workers' reports", {"event": "synthesis_replaced"})
        return answer

    async def _complete(self, plan: Plan, answer: str, outcomes: list[Outcome]) -> None:
        if self.agent is not None and plan.source != "explicit":
            self.agent.conversations.add(self.conversation, "answer", answer)
        files = self.agent.config.files if self.agent is not None else ()
        # The task's last artifact, named "answer": the text, the evidence line, the data.
        parts = answer_parts(answer, plan, outcomes, evidence(answer, outcomes, files))
        await self.events.artifact(parts, artifact_id=ANSWER_ARTIFACT,
                                   name=ANSWER_ARTIFACT, last_chunk=True)
        done = sum(1 for o in outcomes if o.ok)
        failed = len(outcomes) - done
        text = ("completed: answered without workers" if not outcomes
                else f"completed {done} of {len(outcomes)} subtask(s); {failed} failed" if failed
                else f"completed {done} subtask(s)")
        await self.events.finish(S.TASK_STATE_COMPLETED, text)
