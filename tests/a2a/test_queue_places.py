"""The A2A door counts queue places per subtask and per caller (issue 27, hole 5): one
message with 32 subtasks took the queue to 95 of its 64 places, and one caller filling the
queue got every other caller 429 for minutes. Over the real FloorGate and the app."""

from __future__ import annotations

import uuid
from functools import partial
from typing import Any

import anyio
import pytest

from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from mesh.sim.fake import FakeEngine
from tests.support.coord_helpers import TOKEN_A, TOKEN_B, await_for

pytestmark = pytest.mark.anyio


def gate(max_queue: int = 8) -> FloorGate:
    """One worker at a time, so every other subtask waits in the queue."""
    return FloorGate(FakeEngine(),
                     GateConfig.create(policy="none", max_workers=1, max_queue=max_queue))


def send(n: int) -> dict[str, Any]:
    """A non-blocking SendMessage of ``n`` subtasks that each hold their worker."""
    subtasks = [{"id": f"s{i}", "instructions": f"block {i}"} for i in range(n)]
    message = {"messageId": uuid.uuid4().hex, "role": "ROLE_USER",
               "parts": [{"data": {"subtasks": subtasks}}]}
    return {"jsonrpc": "2.0", "id": 1, "method": "SendMessage",
            "params": {"message": message, "configuration": {"returnImmediately": True}}}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_a_task_whose_subtasks_do_not_fit_is_refused_at_the_door(asgi: Any) -> None:
    admission = gate(max_queue=8)
    async with asgi(admission=admission) as (client, _app):
        first = await client.post("/", json=send(6))
        assert first.status_code == 200 and "error" not in first.json(), first.text
        await await_for(lambda: admission.queue_len == 5, what="5 subtasks queued")
        # 5 waiting + 6 more > 8: refused whole, before any task exists
        second = await client.post("/", json=send(6))
        assert second.status_code == 429, second.text
        assert int(second.headers["retry-after"]) >= 1
        rest = await client.post("/a2a/message:send", json=send(6)["params"])
        assert rest.status_code == 429, rest.text
        assert admission.queue_len == 5  # never past its bound
        # what fits is taken: 5 + 3 = 8
        third = await client.post("/", json=send(3))
        assert third.status_code == 200 and "error" not in third.json(), third.text
        await await_for(lambda: admission.queue_len == 8, what="8 subtasks queued")


async def test_one_caller_filling_its_share_leaves_the_queue_to_the_others(asgi: Any) -> None:
    admission = gate(max_queue=8)  # each caller's share: 4 places
    async with asgi(admission=admission, auth_token=f"{TOKEN_A},{TOKEN_B}") as (client, _):
        a = await client.post("/", json=send(5), headers=bearer(TOKEN_A))
        assert a.status_code == 200 and "error" not in a.json(), a.text
        await await_for(lambda: admission.queue_len == 4, what="A's 4 subtasks queued")
        refused = await client.post("/", json=send(1), headers=bearer(TOKEN_A))
        assert refused.status_code == 429
        assert "max_queue_per_caller" in refused.json()["error"]["message"]
        # B is not refused although A has queued as much as it may
        b = await client.post("/", json=send(4), headers=bearer(TOKEN_B))
        assert b.status_code == 200 and "error" not in b.json(), b.text
        await await_for(lambda: admission.queue_len == 8, what="B's 4 subtasks queued")


async def test_a_plans_subtasks_wait_outside_the_queue_until_they_fit() -> None:
    """The door promised a planned task one place (its planning turn); its plan's subtasks
    enter the queue only once all of them fit the caller's share, never past it."""
    from mesh.agent.task import AgentTask

    admission = gate(max_queue=4)  # share: 2 places per caller
    holder = await admission.admit("holder")
    said: list[dict[str, Any]] = []

    class Events:
        async def progress(self, text: str, metadata: dict[str, Any]) -> None:
            said.append(metadata)

    task = AgentTask(None, Events(), admission, "t1", "", "", None, None,  # type: ignore[arg-type]
                     caller="caller-a", room_poll_s=0.01)
    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(partial(admission.admit, f"a{i}", caller="caller-a"))
        await await_for(lambda: admission.queued_by("caller-a") == 2, what="A's share full")
        waited = anyio.Event()

        async def delegate() -> None:
            await task._wait_for_room(2)
            waited.set()

        tg.start_soon(delegate)
        await await_for(lambda: bool(said), what="the task says it waits for room")
        assert said[0]["event"] == "waiting_for_room" and not waited.is_set()
        assert admission.queue_len == 2  # the plan took no place while it waits
        await holder.release()  # a0 is admitted: one place of A's frees...
        await anyio.sleep(0.05)
        assert not waited.is_set()  # ...but the plan needs two
        (ticket,) = admission._tickets
        await ticket.release()  # a1 is admitted: both free
        await await_for(waited.is_set, what="room for the plan")
        tg.cancel_scope.cancel()
