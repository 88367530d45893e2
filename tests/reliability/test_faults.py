"""Faults inside a run: a worker that raises, a failed llama_decode, a client that goes
away mid-stream, push receivers that are down or slow. Each fault hits one task; the pool,
the server and every other task go on."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mesh.engine.llama import Batch
from tests.reliability.real_stack import real_stack
from tests.reliability.serve_proc import TERMINAL, free_port, message, text_of
from tests.support.coord_helpers import (
    Served,
    await_for,
    free_socket,
    serve,
    serve_asgi,
)

pytestmark = pytest.mark.anyio

H = {"A2A-Version": "1.0"}


def rpc(method: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": uuid.uuid4().hex, "method": method, "params": params}


def send_params(text: str, *, immediately: bool = False, **conf: Any) -> dict[str, Any]:
    return {"message": message(text), "configuration": {"returnImmediately": immediately, **conf}}


async def call(client: httpx.AsyncClient, method: str, params: dict[str, Any]) -> Any:
    r = await client.post("/", json=rpc(method, params), headers=H)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert "result" in doc, doc
    return doc["result"]


async def wait_task(client: httpx.AsyncClient, task_id: str, timeout: float = 30) -> Any:
    """GetTask until terminal (bounded by ``timeout`` seconds of polling)."""
    for _ in range(int(timeout / 0.02)):
        task = await call(client, "GetTask", {"id": task_id})
        if task["status"]["state"] in TERMINAL:
            return task
        await asyncio.sleep(0.02)
    raise AssertionError(f"task {task_id} never finished: {task['status']}")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Served]:
    with serve(tmp_path / "data") as served:
        yield served


# --------------------------------------------------------------------------- worker raises


async def test_worker_raising_fails_only_its_task(server: Served) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        blocked = [
            (await call(client, "SendMessage", send_params(f"block {i}", immediately=True)))
            ["task"]["id"] for i in range(3)
        ]
        await await_for(lambda: len(server.probe.started) == 3, what="3 workers running")
        failed = (await call(client, "SendMessage", send_params("fail now")))["task"]
        assert failed["status"]["state"] == "TASK_STATE_FAILED"
        assert "tool exploded" in text_of(failed["status"]["message"]["parts"])
        # The others were not disturbed and finish normally; a new task still works.
        for task_id in blocked:
            task = await call(client, "GetTask", {"id": task_id})
            assert task["status"]["state"] == "TASK_STATE_WORKING"
        server.probe.unblock.set()
        for task_id in blocked:
            task = await wait_task(client, task_id)
            assert task["status"]["state"] == "TASK_STATE_COMPLETED"
        after = (await call(client, "SendMessage", send_params("still alive")))["task"]
        assert after["status"]["state"] == "TASK_STATE_COMPLETED"
    # Every ticket came back, including the failed worker's.
    assert sorted(server.admission.admitted) == sorted(server.admission.released)
    assert not server.admission.active


# --------------------------------------------------------------------------- llama_decode


async def test_failed_decode_fails_the_task_and_the_pool_goes_on(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The Python step calls ctx.decode (tests/engine/test_native.py fails the native one).
    async with real_stack(tiny_model_path, tmp_path, native=False) as stack:
        pool = stack.pool
        ctx = pool.parts.built.ctx
        assert ctx is not None
        real = ctx.decode
        failures = {"left": 1}

        def decode(batch: Batch) -> int:
            if failures["left"]:
                failures["left"] -= 1
                return 1  # llama.cpp: no KV slot for the batch
            return real(batch)

        monkeypatch.setattr(ctx, "decode", decode)
        results = await asyncio.gather(
            *(call(stack.client, "SendMessage", send_params(f"task {i}")) for i in range(3))
        )
        tasks = [r["task"] for r in results]
        failed = [t for t in tasks if t["status"]["state"] == "TASK_STATE_FAILED"]
        assert failed, [t["status"] for t in tasks]
        for task in failed:
            reason = text_of(task["status"]["message"]["parts"])
            assert "llama_decode returned 1 (no KV slot" in reason, reason
        for task in tasks:
            assert task["status"]["state"] in ("TASK_STATE_FAILED", "TASK_STATE_COMPLETED")
        # The engine thread survived and every session's cells came back.
        assert pool._engine.alive
        load = pool.load()
        assert load.sessions == ()
        assert load.cells_used == pool.info.prefix_tokens
        census = await pool.call(pool.parts.cell_census)
        assert census is not None and census.cells == pool.info.prefix_tokens
        assert stack.gate.num_tickets == 0
        again = await call(stack.client, "SendMessage", send_params("after the failure"))
        assert again["task"]["status"]["state"] == "TASK_STATE_COMPLETED"


# --------------------------------------------------------------------------- disconnect


async def test_client_gone_mid_stream_the_task_completes(server: Served) -> None:
    body = rpc("SendStreamingMessage", send_params("block until the client is gone"))
    streaming = httpx.AsyncClient(base_url=server.url, timeout=30)
    async with streaming, streaming.stream("POST", "/", json=body, headers=H) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                task_id = json.loads(line[5:])["result"]["task"]["id"]
                break
    # The streaming client (and its connection) is closed here.
    await await_for(lambda: bool(server.probe.started), what="worker start")
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        task = await call(client, "GetTask", {"id": task_id})
        assert task["status"]["state"] == "TASK_STATE_WORKING"
        assert not server.probe.cancelled, "the disconnect must not cancel the task"
        events: list[dict[str, Any]] = []
        sub = rpc("SubscribeToTask", {"id": task_id})
        async with client.stream("POST", "/", json=sub, headers=H) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                events.append(json.loads(line[5:])["result"])
                server.probe.unblock.set()
        final = await wait_task(client, task_id)
    assert final["status"]["state"] == "TASK_STATE_COMPLETED"
    answer = [a for a in final["artifacts"] if a["name"] == "answer"]
    assert answer and text_of(answer[0]["parts"]) == "unblocked"
    assert events[-1]["statusUpdate"]["status"]["state"] == "TASK_STATE_COMPLETED"
    assert any(e.get("artifactUpdate", {}).get("artifact", {}).get("name") == "answer"
               for e in events)


# --------------------------------------------------------------------------- push


class SlowReceiver:
    """Holds every POST until released (at most ``hold_s``), counting them."""

    def __init__(self, hold_s: float = 20.0) -> None:
        self.release = threading.Event()
        self.hold_s = hold_s
        self.num_posts = 0

    async def hook(self, request: Request) -> Response:
        self.num_posts += 1
        for _ in range(int(self.hold_s / 0.01)):
            if self.release.is_set():
                break
            await asyncio.sleep(0.01)
        return Response(status_code=204)


async def test_push_receivers_down_or_slow_block_neither_task_nor_server(
    tmp_path: Path,
) -> None:
    slow = SlowReceiver()
    receiver_app = Starlette(routes=[Route("/hook", slow.hook, methods=["POST"])])
    dead_url = f"http://127.0.0.1:{free_port()}/hook"  # nothing listens there
    try:
        with serve_asgi(receiver_app, free_socket()) as receiver, serve(tmp_path / "d") as srv:
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
                tasks = []
                for url in (receiver + "/hook", dead_url):
                    params = send_params("push")
                    params["configuration"]["taskPushNotificationConfig"] = {"url": url}
                    result = await call(client, "SendMessage", params)
                    tasks.append(result["task"])
                # Both tasks are complete while the slow receiver still holds its first POST.
                assert [t["status"]["state"] for t in tasks] == ["TASK_STATE_COMPLETED"] * 2
                assert not slow.release.is_set()
                await await_for(lambda: slow.num_posts >= 1, what="a push to the receiver")
                health = await client.get("/healthz")
                assert health.status_code == 200
                other = await call(client, "SendMessage", send_params("no push"))
                assert other["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
                slow.release.set()
                await await_for(lambda: slow.num_posts >= 3, what="later pushes")
    finally:
        slow.release.set()
