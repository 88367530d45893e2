"""Scenario mode: real generation, scripted tool calls with seeded latency and output.

A scenario subtask runs S steps; each step generates exactly N tokens on the session (EOS
does not end it early), then makes the step's scripted tool call: it appends the call in
the template's syntax (as if the model had written it), sleeps the step's latency, and
appends a seeded output of the step's token size. The model is never asked to emit a
well-formed call, so a base model such as Gemma 3 270M drives the scenario as well as any.

The schedule is a pure function of the parameters (:func:`plan_schedule`): same seed, same
steps, latencies, tools and outputs. Recognised ``Subtask.params`` keys: ``steps``,
``tokens_per_step``, ``seed``, ``tools`` (list of names), ``tool_latency_s`` and
``tool_output_tokens`` (distribution tables as in the manifest); the rest of the defaults
come from the template's ``[scenario]`` table. Other keys are left to the harness.

Scenario params are a load generator, so they are bounded (:data:`SCENARIO_BOUNDS`): a
client can never hold a worker slot for longer than ``steps x tool_latency_s`` of the
bounds, nor make :func:`simulated_output` build more than ``tool_output_tokens`` tokens; it runs
in a worker thread, never on the event loop. :func:`check_scenario_bounds` is the door check; the
coordinator runs it only when the operator turned simulation on (``--simulation``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mesh.engine.config import SamplingParams
from mesh.engine.interface import ContextOverflow, Engine, EngineError, Session
from mesh.template.loader import Distribution, FixedDist, LogNormalDist, Template, UniformDist
from mesh.worker.grammar import ToolCall
from mesh.worker.loop import WorkerFailed, attached, stream_turn
from mesh.worker.types import Emit, EventKind, Subtask, WorkerEvent, WorkerResult

__all__ = ["SCENARIO_BOUNDS", "ScenarioParams", "ScenarioWorker", "StepPlan",
           "check_scenario_bounds", "plan_schedule", "sample", "simulated_output"]

# Vocabulary of simulated tool output (a string split once; ruff would explode a literal).
_VOCABULARY = """
parcel route courier depot stop weight plan dispatch grid distance tour capacity assign
deliver check config error result value index cache queue worker session token prefix
batch step limit budget retry timeout status report update path
"""
_WORDS = tuple(_VOCABULARY.split())
M = TypeVar("M", bound=BaseModel)

#: The most a scenario subtask may ask for (the built-in templates use a fraction of it).
SCENARIO_BOUNDS: Mapping[str, float] = {"steps": 64, "tokens_per_step": 2048, "tools": 16,
                                        "tool_latency_s": 60.0, "tool_output_tokens": 4096}


def _check_bounds(knobs: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the first knob over :data:`SCENARIO_BOUNDS`."""
    for key in ("steps", "tokens_per_step"):
        value = knobs.get(key)
        if isinstance(value, int | float) and value > SCENARIO_BOUNDS[key]:
            raise ValueError(f"scenario params: {key} is {value}; "
                             f"the bound is {SCENARIO_BOUNDS[key]:g}")
    tools = knobs.get("tools")
    if isinstance(tools, list | tuple) and len(tools) > SCENARIO_BOUNDS["tools"]:
        raise ValueError(f"scenario params: tools lists {len(tools)} names; the bound is "
                         f"{SCENARIO_BOUNDS['tools']:g}")
    for key in ("tool_latency_s", "tool_output_tokens"):
        dist = knobs.get(key)
        if isinstance(dist, FixedDist | UniformDist | LogNormalDist):
            # the largest value the distribution can draw
            field, top = ("value", dist.value) if isinstance(dist, FixedDist) else ("max", dist.max)
            if top > SCENARIO_BOUNDS[key]:
                raise ValueError(f"scenario params: {key}.{field} is {top:g}; the bound is "
                                 f"{SCENARIO_BOUNDS[key]:g} (lower it)")


class ScenarioParams(BaseModel):
    """One scenario subtask's knobs, after defaults from the template."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    steps: int = Field(ge=1)
    tokens_per_step: int = Field(ge=1)
    seed: int = 0
    tools: tuple[str, ...] = Field(min_length=1)
    tool_latency_s: Distribution
    tool_output_tokens: Distribution

    @model_validator(mode="after")
    def _bounded(self) -> ScenarioParams:
        _check_bounds(dict(self))
        return self

    @classmethod
    def from_subtask(cls, params: Mapping[str, Any], template: Template) -> ScenarioParams:
        defaults = template.manifest.scenario.model_dump()
        defaults.pop("packages")
        return _validated(cls, {**defaults, **params})


def _validated(model: type[M], value: Mapping[str, Any]) -> M:
    """``model`` of ``value``; ValueError naming the first bad knob."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        if not loc:  # a model-level check: its message names the knob already
            raise ValueError(str(first["ctx"]["error"])) from exc
        raise ValueError(f"scenario params: {loc}: {first['msg']}") from exc


def check_scenario_bounds(params: Mapping[str, Any]) -> None:
    """The door check of a subtask's scenario params (no template needed): raise
    ``ValueError`` naming the knob and its bound when one is malformed or over the bound."""
    knobs = _validated(_Overrides, dict(params))
    _check_bounds({k: v for k, v in dict(knobs).items() if v is not None})


class _Overrides(BaseModel):
    """The scenario knobs a subtask may override, each optional (for the door check)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    steps: int | None = Field(None, ge=1)
    tokens_per_step: int | None = Field(None, ge=1)
    seed: int | None = None
    tools: tuple[str, ...] | None = Field(None, min_length=1)
    tool_latency_s: Distribution | None = None
    tool_output_tokens: Distribution | None = None


@dataclass(frozen=True)
class StepPlan:
    index: int  # 1-based
    tokens: int  # tokens to generate before the call
    tool: str
    arguments: Mapping[str, Any]
    latency_s: float
    output_tokens: int
    output_seed: int


def sample(dist: FixedDist | UniformDist | LogNormalDist, rng: random.Random) -> float:
    """One draw of a manifest distribution (log-normal draws are clipped to [min, max])."""
    if isinstance(dist, FixedDist):
        return dist.value
    if isinstance(dist, UniformDist):
        return rng.uniform(dist.min, dist.max)
    value = rng.lognormvariate(math.log(dist.median), dist.sigma)
    return float(min(max(value, dist.min), dist.max))


def plan_schedule(params: ScenarioParams) -> tuple[StepPlan, ...]:
    """The steps of one scenario subtask; a pure function of ``params``."""
    rng = random.Random(params.seed)
    steps: list[StepPlan] = []
    for i in range(params.steps):
        tool = params.tools[(params.seed + i) % len(params.tools)]
        target = f"src/module_{rng.randrange(100):02d}.py"
        arguments = {"path": target} if tool != "grep" else {"text": rng.choice(_WORDS)}
        latency = round(sample(params.tool_latency_s, rng), 4)
        size = max(1, round(sample(params.tool_output_tokens, rng)))
        steps.append(StepPlan(i + 1, params.tokens_per_step, tool, arguments, latency, size,
                              rng.getrandbits(32)))
    return tuple(steps)


def simulated_output(step: StepPlan, count_tokens: Callable[[str], int]) -> str:
    """Seeded tool-shaped text of about ``step.output_tokens`` tokens (one line over, at most)."""
    rng = random.Random(step.output_seed)
    lines: list[str] = []
    used = 0
    while used < step.output_tokens:
        n = len(lines) + 1
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 9)))
        if step.tool == "grep":
            line = f"src/module_{rng.randrange(100):02d}.py:{rng.randint(1, 400)}: {words}"
        elif step.tool == "run_tests":
            verdict = "PASSED" if rng.random() > 0.1 else "FAILED"
            line = f"tests/test_{rng.choice(_WORDS)}.py::test_{words.replace(' ', '_')} {verdict}"
        else:
            line = f"{n}\t{words}"
        lines.append(line)
        used += max(1, count_tokens(line + "\n"))
    return "\n".join(lines)


class ScenarioWorker:
    """A :class:`~mesh.worker.types.Worker` for scenario subtasks (see the module doc).

    ``sleep`` is how a latency is waited (``anyio.sleep``; tests pass a recorder).
    """

    def __init__(self, engine: Engine, template: Template, *,
                 sleep: Callable[[float], Awaitable[None]] = anyio.sleep) -> None:
        self._engine = engine
        self._template = template
        self._sleep = sleep

    async def run(self, subtask: Subtask, emit: Emit) -> WorkerResult:
        params = ScenarioParams.from_subtask(subtask.params, self._template)
        schedule = plan_schedule(params)
        generated = 0
        done = 0
        last = ""
        finish = "answer"
        async with attached(self._engine, subtask) as session:
            data: dict[str, Any] = {"session_id": session.id, "seed": params.seed}
            try:
                session.append(self._template.instructions(subtask.id, subtask.instructions))
                for step in schedule:
                    await emit(WorkerEvent(EventKind.TURN_STARTED, f"turn {step.index}",
                                           step.index))
                    sampling = SamplingParams(
                        max_tokens=step.tokens, seed=params.seed + step.index,
                        temperature=self._template.manifest.turns.temperature,
                        stop_at_eos=False, priority=subtask.priority)
                    result = await stream_turn(session, sampling, emit, step.index,
                                               place=partial(self._engine.turn_place, session.id))
                    generated += result.num_generated
                    last = result.text
                    await self._call(session, step, result.wait_s, emit)
                    done += 1
            except ContextOverflow as exc:
                finish = "max_tokens"
                data["context_overflow"] = str(exc)
            except EngineError as exc:
                raise WorkerFailed(f"subtask {subtask.id} failed on step {done + 1}: "
                                   f"{exc}") from exc
        return WorkerResult(answer=last.strip(), num_turns=done, num_generated=generated,
                            num_tool_calls=done, finish_reason=finish, data=data)

    async def _call(self, session: Session, step: StepPlan, wait_s: float, emit: Emit) -> None:
        """The step's scripted call, its latency and its seeded output (see the module doc)."""
        shown = ToolCall(step.tool, step.arguments).display()
        await emit(WorkerEvent(EventKind.TOOL_CALL, shown, step.index,
                               {"latency_s": step.latency_s, "simulated": True,
                                "wait_s": round(wait_s, 4)}))
        session.append(self._template.manifest.tool_calls.format(step.tool, dict(step.arguments)))
        await self._sleep(step.latency_s)
        output = await anyio.to_thread.run_sync(simulated_output, step, self._engine.count_tokens)
        await emit(WorkerEvent(EventKind.TOOL_RESULT, output, step.index,
                               {"output_tokens": step.output_tokens}))
        session.append(self._template.tool_result(call=shown, output=output, is_error=False,
                                                  turn=step.index))
