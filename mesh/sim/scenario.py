"""The simulated workload: K packages, each one A2A task running S scenario steps.

The schedule is a pure function of the template's ``[scenario]`` table, the seed and the
overrides: every package gets a seed drawn from one ``random.Random(seed)``, and its steps
(tokens to generate, tool, latency, output size) come from the worker's own planner
(:func:`mesh.worker.simulated.plan_schedule`), so what the report says a package did is
exactly what the worker does with the same ``params``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from mesh.template.manifest import ScenarioSpec
from mesh.worker.simulated import ScenarioParams, StepPlan, plan_schedule

__all__ = ["PackagePlan", "Scenario", "plan_scenario"]

# Two parts (";"): a planned package fans out to two workers and a synthesis turn (a plan
# of one subtask answers with its worker alone).
_INSTRUCTIONS = (
    "Package {index}: check the courier code paths this delivery touches; then report "
    "what to change."
)


@dataclass(frozen=True)
class PackagePlan:
    """One package: the subtask ``params`` sent to the coordinator and the steps they imply."""

    index: int  # 0-based
    seed: int
    params: Mapping[str, Any]
    steps: tuple[StepPlan, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.tokens for s in self.steps)

    def message_text(self) -> str:
        """The package as plain text: what a planned package sends (the coordinator plans
        it; ``params`` do not travel, the planned workers run real turns)."""
        return _INSTRUCTIONS.format(index=self.index)

    def message_data(self) -> dict[str, Any]:
        """The data part of this package's A2A message (the coordinator's fan-out format)."""
        return {
            "subtasks": [
                {
                    "id": f"p{self.index}",
                    "instructions": _INSTRUCTIONS.format(index=self.index),
                    "params": dict(self.params),
                }
            ]
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "seed": self.seed,
            "params": dict(self.params),
            "steps": [{**asdict(s), "arguments": dict(s.arguments)} for s in self.steps],
        }


@dataclass(frozen=True)
class Scenario:
    """Every package of one run, in submission order."""

    seed: int
    steps: int
    tokens_per_step: int
    packages: tuple[PackagePlan, ...]
    plan: bool = False  # packages go as plain text, so the coordinator plans each

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.packages)

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "steps": self.steps,
            "tokens_per_step": self.tokens_per_step,
            "plan": self.plan,
            "packages": [p.to_json() for p in self.packages],
        }


def plan_scenario(
    spec: ScenarioSpec,
    seed: int,
    *,
    packages: int | None = None,
    steps: int | None = None,
    tokens_per_step: int | None = None,
    plan: bool | None = None,
    tool_latency_s: Mapping[str, Any] | None = None,
) -> Scenario:
    """The packages of a run; ``None`` overrides take the template's defaults.

    ``tool_latency_s``: a distribution table (as in the manifest) for every step's tool
    call instead of the template's, e.g. the long idle gaps of ``--scenario idle-agents``.

    Raises ``ValueError`` for a count below 1. Pure: same arguments, same scenario.
    """
    num_packages = spec.packages if packages is None else packages
    num_steps = spec.steps if steps is None else steps
    num_tokens = spec.tokens_per_step if tokens_per_step is None else tokens_per_step
    for name, value in (
        ("packages", num_packages),
        ("steps", num_steps),
        ("tokens_per_step", num_tokens),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    rng = random.Random(seed)
    defaults = spec.model_dump()
    defaults.pop("packages")
    planned = bool(defaults.pop("plan")) if plan is None else plan
    plans: list[PackagePlan] = []
    for i in range(num_packages):
        package_seed = rng.getrandbits(31)
        params: dict[str, Any] = {
            "scenario": True,
            "steps": num_steps,
            "tokens_per_step": num_tokens,
            "seed": package_seed,
            "package": i,
            # The distributions travel too, so the schedule does not depend on which
            # template the server loaded.
            "tools": list(spec.tools),
            "tool_latency_s": dict(tool_latency_s) if tool_latency_s is not None
            else defaults["tool_latency_s"],
            "tool_output_tokens": defaults["tool_output_tokens"],
        }
        knobs = ScenarioParams.model_validate({**defaults, **params})
        plans.append(PackagePlan(i, package_seed, params, plan_schedule(knobs)))
    return Scenario(seed, num_steps, num_tokens, tuple(plans), planned)
