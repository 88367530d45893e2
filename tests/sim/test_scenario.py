"""The scenario schedule is a pure function of (template scenario, seed, overrides)."""

from __future__ import annotations

import pytest

from mesh.agent.plans import check_subtask_list
from mesh.sim.scenario import plan_scenario
from mesh.template.loader import load_template
from mesh.worker.simulated import ScenarioParams, plan_schedule


@pytest.fixture(scope="module", params=["light", "heavy"])
def template_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_same_seed_gives_the_same_schedule(template_name: str) -> None:
    spec = load_template(template_name).manifest.scenario
    a = plan_scenario(spec, 7)
    b = plan_scenario(spec, 7)
    assert a == b
    assert a.to_json() == b.to_json()


def test_a_different_seed_gives_a_different_schedule(template_name: str) -> None:
    spec = load_template(template_name).manifest.scenario
    a, b = plan_scenario(spec, 1), plan_scenario(spec, 2)
    assert [p.seed for p in a.packages] != [p.seed for p in b.packages]
    assert [p.steps for p in a.packages] != [p.steps for p in b.packages]


def test_template_defaults_fill_what_flags_leave_out(template_name: str) -> None:
    spec = load_template(template_name).manifest.scenario
    default = plan_scenario(spec, 0)
    assert len(default.packages) == spec.packages
    assert all(len(p.steps) == spec.steps for p in default.packages)
    assert all(s.tokens == spec.tokens_per_step for p in default.packages for s in p.steps)
    custom = plan_scenario(spec, 0, packages=3, steps=1, tokens_per_step=5)
    assert [len(p.steps) for p in custom.packages] == [1, 1, 1]
    assert custom.num_tokens == 15


def test_packages_differ_within_a_run() -> None:
    spec = load_template("heavy").manifest.scenario
    scenario = plan_scenario(spec, 0)
    latencies = {tuple(s.latency_s for s in p.steps) for p in scenario.packages}
    assert len(latencies) == len(scenario.packages)


def test_counts_below_one_are_refused() -> None:
    spec = load_template("light").manifest.scenario
    with pytest.raises(ValueError, match="packages must be >= 1"):
        plan_scenario(spec, 0, packages=0)


def test_the_worker_plans_the_same_steps_from_the_sent_params() -> None:
    """What the report says a package did is what the worker does with its params."""
    template = load_template("heavy")
    scenario = plan_scenario(template.manifest.scenario, 3, packages=4)
    for package in scenario.packages:
        [entry] = package.message_data()["subtasks"]
        worker_params = ScenarioParams.from_subtask(entry["params"], load_template("light"))
        assert plan_schedule(worker_params) == package.steps  # the template travels too


def test_the_message_is_the_coordinators_fan_out_format() -> None:
    spec = load_template("light").manifest.scenario
    package = plan_scenario(spec, 0, packages=2).packages[1]
    data = package.message_data()
    [checked] = check_subtask_list(data["subtasks"], max_subtasks=32)
    assert checked.params["scenario"] is True
    assert checked.params["package"] == 1
    assert checked.params["seed"] == package.seed


def test_a_scenario_plans_only_when_it_asks() -> None:
    spec = load_template("light").manifest.scenario
    assert spec.plan is False  # the shipped templates bypass planning
    plain = plan_scenario(spec, 0, packages=2)
    assert plain.plan is False and plain.to_json()["plan"] is False
    planned = plan_scenario(spec, 0, packages=2, plan=True)
    assert planned.plan is True
    assert [p.steps for p in planned.packages] == [p.steps for p in plain.packages]
    assert planned.packages[1].message_text().startswith("Package 1:")
    asked = plan_scenario(spec.model_copy(update={"plan": True}), 0, packages=1)
    assert asked.plan is True and plan_scenario(
        spec.model_copy(update={"plan": True}), 0, packages=1, plan=False).plan is False
