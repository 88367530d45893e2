"""Scenario params are a load generator: off unless the operator turns simulation on, and
bounded when it is, with -32602 naming the bound (issue 12, point 1)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from mesh.sim.fake import FakeEngine
from mesh.template.loader import load_template
from mesh.worker.dispatch import DispatchWorker
from mesh.worker.loop import WorkerFailed
from mesh.worker.simulated import SCENARIO_BOUNDS, ScenarioParams, check_scenario_bounds
from mesh.worker.types import Subtask, WorkerEvent
from tests.reliability.fake_stack import fake_stack

pytestmark = pytest.mark.anyio


def send(params: dict[str, Any]) -> dict[str, Any]:
    data = {"subtasks": [{"instructions": "deliver", "params": {"scenario": True, **params}}]}
    msg = {"messageId": uuid.uuid4().hex, "role": "ROLE_USER", "parts": [{"data": data}]}
    return {"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {"message": msg}}


async def rpc_error(tmp: Path, params: dict[str, Any], **coord: Any) -> dict[str, Any]:
    async with fake_stack(tmp, **coord) as stack:
        r = await stack.client.post("/", json=send(params))
        assert r.status_code == 200
        body = r.json()
        assert "error" in body, body
        return dict(body["error"])


async def test_scenario_params_are_refused_without_simulation(tmp_path: Path) -> None:
    err = await rpc_error(tmp_path, {"steps": 1})
    assert err["code"] == -32602
    assert "--simulation" in err["message"]


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"tool_latency_s": {"dist": "fixed", "value": 100_000}}, "tool_latency_s.value"),
        ({"tool_output_tokens": {"dist": "uniform", "min": 1, "max": 10**9}},
         "tool_output_tokens.max"),
        ({"steps": 10**6}, "steps"),
        ({"tokens_per_step": 10**6}, "tokens_per_step"),
    ],
)
async def test_scenario_params_over_a_bound_name_it(
    tmp_path: Path, params: dict[str, Any], named: str
) -> None:
    err = await rpc_error(tmp_path, params, simulation=True)
    assert err["code"] == -32602
    assert named in err["message"] and "bound" in err["message"], err["message"]


async def test_bounded_scenario_params_pass_the_door_with_simulation(tmp_path: Path) -> None:
    async with fake_stack(tmp_path, simulation=True) as stack:
        r = await stack.client.post("/", json=send({"steps": 2}))
        assert "error" not in r.json()


def test_bounds_hold_on_the_worker_side_too() -> None:
    template = load_template("light")
    with pytest.raises(ValueError, match=r"tool_output_tokens\.value is 1e\+09; the bound"):
        ScenarioParams.from_subtask(
            {"tool_output_tokens": {"dist": "fixed", "value": 10**9}}, template
        )
    big = SCENARIO_BOUNDS["tool_latency_s"] + 1
    with pytest.raises(ValueError, match="bound"):
        check_scenario_bounds({"tool_latency_s": {"dist": "lognormal", "median": 1,
                                                  "sigma": 1, "min": 0, "max": big}})


async def test_worker_refuses_scenarios_without_simulation() -> None:
    async def emit(event: WorkerEvent) -> None:
        pass

    worker = DispatchWorker(FakeEngine(), load_template("light"), tools={})
    subtask = Subtask(id="t/s1", instructions="go", params={"scenario": True, "steps": 1})
    with pytest.raises(WorkerFailed, match="--simulation"):
        await worker.run(subtask, emit)


def test_largest_allowed_output_is_quick() -> None:
    """The event loop builds at most the bound of output tokens: that stays well under 1 s."""
    from mesh.worker.simulated import StepPlan, simulated_output

    step = StepPlan(1, 1, "grep", {}, 0.0, int(SCENARIO_BOUNDS["tool_output_tokens"]), 7)
    t0 = time.perf_counter()
    out = simulated_output(step, lambda s: len(s.split()))
    assert time.perf_counter() - t0 < 1.0 and out
