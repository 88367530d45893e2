"""The one task path: plan (or take the client's plan), fan out through the gate, answer.

Every task runs here, whatever its message (the executor only writes its events)::

    explicit subtasks, or planning off ─▶ the explicit plan (no planning turn)
    otherwise: working "planning" ─▶ stream-plan chunks ─▶ working event=plan + ``plan``
      ├─ action answer   ─▶ completed with the ``answer`` artifact (no worker)
      ├─ action ask      ─▶ input-required with the question (the reply resumes the task)
      └─ action delegate ─▶
    delegate: every subtask through the gate to a worker at once (:mod:`.fanout`; one
      failing does not cancel the others) ─▶ a synthesis turn (stream-synthesis) for a
      model's plan of two or more ─▶ completed with ``answer`` (what failed is said) │
      failed when every worker failed

The planning and synthesis turns are pool sessions admitted by the gate like workers (keys
``<task>/plan`` and ``<task>/synthesis``), so they share the prefix and keep the floor.
Queue places: the door counted one per explicit subtask, else one for the planning turn; a
plan's N subtasks enter the gate's queue only once all N fit its free places and the
caller's share (the task waits outside the queue until then), so a plan never takes the
queue past its bound. In ``auto`` mode a plan that does not parse (or a planning turn that
fails) falls back to the message as one subtask; in ``always`` mode it fails the task.
Planned tasks (not explicit ones) remember their context's conversation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

import anyio
from a2a.types import a2a_pb2 as pb

from mesh.agent.config import PLAN_MODES, PLAN_STYLES, AgentConfig
from mesh.agent.events import ANSWER_ARTIFACT, PLAN_ARTIFACT, TaskEvents, TextSink
from mesh.agent.fanout import SubtaskFailed, WorkerFactory, fan_out, run_subtask
from mesh.agent.history import Conversations
from mesh.agent.plan_grammar import max_plan_chars, schema_to_gbnf
from mesh.agent.plans import Plan, PlanError, explicit_plan, fallback_plan, parse_plan, plan_prompt
from mesh.agent.request_parts import request_parts
from mesh.agent.subtasks import SubtaskSpec
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
from mesh.gate.queue import Admission, admitted
from mesh.worker.stream import WorkerFailed, release, stream_turn
from mesh.worker.text import fragment, prose_params
from mesh.worker.types import NO_HOPS, EventKind, Hops, Subtask, WorkerEvent, WorkerResult

__all__ = [
    "ANSWER_ARTIFACT",
    "PLAN_ARTIFACT",
    "PLAN_MODES",
    "PLAN_STYLES",
    "Agent",
    "AgentConfig",
    "AgentTask",
    "plain_turn",
]

logger = logging.getLogger(__name__)

S = pb.TaskState


def plain_turn(prompt: str) -> str:
    """How a coordinator turn's prompt is written into its session (plain text for now;
    the model's chat format replaces this once it is available)."""
    return prompt


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
        try:
            session.append(self.render(prompt))
            # free text (the synthesis) stops at a loop; a plan's JSON is never cut
            result = await stream_turn(session, params, _sink_emit(sink), 1,
                                       loop_stop=params.grammar is None)
            await sink.flush(last=True)
            return result
        except WorkerFailed as e:
            raise EngineError(str(e)) from e


def _sink_emit(sink: TextSink) -> Callable[[WorkerEvent], Awaitable[None]]:
    async def emit(event: WorkerEvent) -> None:
        if event.kind is EventKind.TEXT:
            await sink.add(event.text)

    return emit


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
                             params: SamplingParams) -> TurnResult:
        async def on_position(position: int) -> None:
            if position > 0:
                await self.events.progress(f"[{key}] queued for the gate at position {position}",
                                           {"subtask": key, "event": "queued",
                                            "queue_position": position})

        # the hold detaches the turn's session, then releases the ticket, whatever the exit
        async with admitted(self.admission, f"{self.task_id}/{key}", on_position=on_position,
                            accepted=True, caller=self.caller) as hold:
            await self.events.status(S.TASK_STATE_WORKING, f"[{key}] admitted; {key} turn",
                                     {"subtask": key, "event": "admitted"})
            sink = self.events.stream(f"stream-{key}", f"{key} output")
            session = await hold.attach(agent.engine)
            return await agent.turn_on(session, prompt, params, sink)

    async def _plan(self, agent: Agent, history: str) -> Plan | None:
        cfg = agent.config
        parts = request_parts(self.message, cfg.max_subtasks) if cfg.style == "guided" else ()
        prompt = plan_prompt(self.message, history, cfg.tools, cfg.max_subtasks, parts)
        try:
            turn = await self._admitted_turn(
                agent, "plan", prompt,
                replace(agent.plan_params(self.message), priority=self.priority))
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

        async def run_one(subtask: Subtask) -> WorkerResult:
            return await run_subtask(self.events, self.admission, self.workers, subtask,
                                     self.caller)

        results = await fan_out(subtasks, run_one)
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
        explicit = plan.source == "explicit"
        if self.agent is not None and not explicit:
            self.agent.conversations.add(self.conversation, "answer", answer)
        files = self.agent.config.files if self.agent is not None else ()
        # The task's last artifact, named "answer": the text, the evidence line, the data.
        # Explicit tasks' rows keep their old key names for one release (Outcome.record).
        parts = answer_parts(answer, plan, outcomes, evidence(answer, outcomes, files),
                             legacy=explicit)
        await self.events.artifact(parts, artifact_id=ANSWER_ARTIFACT,
                                   name=ANSWER_ARTIFACT, last_chunk=True)
        done = sum(1 for o in outcomes if o.ok)
        failed = len(outcomes) - done
        text = ("completed: answered without workers" if not outcomes
                else f"completed {done} of {len(outcomes)} subtask(s); {failed} failed" if failed
                else f"completed {done} subtask(s)")
        await self.events.finish(S.TASK_STATE_COMPLETED, text)
