"""Any failure in the executor ends the task FAILED with a reason at once (issue 12, point
5): each failure point is injected (admit, a flush, an exception group)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from mesh.a2a import executor as executor_mod
from mesh.a2a.app import build_app
from mesh.a2a.config import CoordinatorConfig
from tests.support.coord_helpers import FakeAdmission, Probe, ScriptedWorker

pytestmark = pytest.mark.anyio


class BrokenAdmission(FakeAdmission):
    """Admission whose ``admit`` raises something the executor does not expect."""

    async def admit(self, key: str, on_position: Any = None, *, accepted: bool = False,
                    caller: str = "") -> Any:
        raise RuntimeError(f"gate broke while admitting {key}")


@asynccontextmanager
async def app_client(tmp: Path, admission: FakeAdmission) -> AsyncIterator[httpx.AsyncClient]:
    probe = Probe()
    probe.unblock.set()
    app = build_app(
        CoordinatorConfig(data_dir=str(tmp / "data")),
        worker_factory=lambda: ScriptedWorker(probe),
        admission=admission,
        pool_info=None,
    )
    async with app.router.lifespan_context(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://mesh",
        headers={"A2A-Version": "1.0"},
    ) as client:
        yield client


async def send_and_get(client: httpx.AsyncClient, parts: list[dict[str, Any]]) -> dict[str, Any]:
    msg = {"messageId": uuid.uuid4().hex, "role": "ROLE_USER", "parts": parts}
    r = await client.post("/", json={"jsonrpc": "2.0", "id": 1, "method": "SendMessage",
                                     "params": {"message": msg}})
    body = r.json()
    assert "result" in body, body
    task_id = body["result"]["task"]["id"]
    r = await client.post("/", json={"jsonrpc": "2.0", "id": 2, "method": "GetTask",
                                     "params": {"id": task_id}})
    return dict(r.json()["result"])


def reason(task: dict[str, Any]) -> str:
    return " ".join(p.get("text", "") for p in task["status"]["message"]["parts"])


async def test_an_admit_failure_fails_the_task(tmp_path: Path) -> None:
    async with app_client(tmp_path, BrokenAdmission()) as client:
        task = await send_and_get(client, [{"text": "deliver"}])
    assert task["status"]["state"] == "TASK_STATE_FAILED"
    assert "gate broke while admitting" in reason(task)


async def test_an_exception_group_fails_the_task(tmp_path: Path) -> None:
    subtasks = [{"instructions": "one"}, {"instructions": "two"}]
    async with app_client(tmp_path, BrokenAdmission()) as client:
        task = await send_and_get(client, [{"data": {"subtasks": subtasks}}])
    assert task["status"]["state"] == "TASK_STATE_FAILED"
    assert "RuntimeError: gate broke" in reason(task)


async def test_a_flush_failure_fails_the_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = executor_mod._TextStream.flush

    async def flush(self: Any, now: float | None = None, *, last: bool = False) -> None:
        if last:
            raise OSError("disk full while flushing the stream artifact")
        await original(self, now, last=last)

    monkeypatch.setattr(executor_mod._TextStream, "flush", flush)
    admission = FakeAdmission()
    async with app_client(tmp_path, admission) as client:
        task = await send_and_get(client, [{"text": "deliver"}])
    assert task["status"]["state"] == "TASK_STATE_FAILED"
    assert "OSError: disk full" in reason(task)
    assert admission.released == admission.admitted, "the ticket is released"
