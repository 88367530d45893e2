"""Push notifications are really sent, to URLs that pass the policy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from a2a.types import a2a_pb2 as pb
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.support.coord_helpers import (
    Served,
    await_for,
    request,
    sdk,
    send_all,
    serve,
    serve_asgi,
    wait_terminal,
)

pytestmark = pytest.mark.anyio


class Receiver:
    def __init__(self) -> None:
        self.posts: list[tuple[dict[str, Any], dict[str, str]]] = []

    async def hook(self, request: Request) -> Response:
        self.posts.append((json.loads(await request.body()), dict(request.headers)))
        return Response(status_code=204)

    def states(self) -> list[str]:
        return [p["statusUpdate"]["status"]["state"] for p, _ in self.posts if "statusUpdate" in p]


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    recv = Receiver()
    app = Starlette(routes=[Route("/hook", recv.hook, methods=["POST"])])
    with serve_asgi(app) as url:
        yield recv, url + "/hook"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Served]:
    with serve(tmp_path / "data") as served:
        yield served


async def test_push_is_delivered_for_every_event(
    server: Served, receiver: tuple[Receiver, str]
) -> None:
    recv, hook = receiver
    req = request("push me")
    req.configuration.task_push_notification_config.CopyFrom(
        pb.TaskPushNotificationConfig(url=hook, token="sekrit")
    )
    async with sdk(server.url, streaming=False) as client:
        (response,) = await send_all(client, req)
    assert response.task.status.state == pb.TaskState.TASK_STATE_COMPLETED
    await await_for(lambda: "TASK_STATE_COMPLETED" in recv.states(), what="completed push")
    assert "TASK_STATE_WORKING" in recv.states()
    assert all(h.get("x-a2a-notification-token") == "sekrit" for _, h in recv.posts)
    assert any("artifactUpdate" in p for p, _ in recv.posts)


async def test_push_config_crud_on_a_running_task(
    server: Served, receiver: tuple[Receiver, str]
) -> None:
    recv, hook = receiver
    async with sdk(server.url, streaming=False) as client:
        task = (await send_all(client, request("block a while", immediately=True)))[0].task
        created = await client.create_task_push_notification_config(
            pb.TaskPushNotificationConfig(task_id=task.id, id="cfg1", url=hook)
        )
        assert created.id == "cfg1" and created.url == hook
        got = await client.get_task_push_notification_config(
            pb.GetTaskPushNotificationConfigRequest(task_id=task.id, id="cfg1")
        )
        assert got.url == hook
        listed = await client.list_task_push_notification_configs(
            pb.ListTaskPushNotificationConfigsRequest(task_id=task.id)
        )
        assert [c.id for c in listed.configs] == ["cfg1"]
        server.probe.unblock.set()
        await wait_terminal(client, task.id)
        await await_for(lambda: "TASK_STATE_COMPLETED" in recv.states(), what="push")
        await client.delete_task_push_notification_config(
            pb.DeleteTaskPushNotificationConfigRequest(task_id=task.id, id="cfg1")
        )
        after = await client.list_task_push_notification_configs(
            pb.ListTaskPushNotificationConfigsRequest(task_id=task.id)
        )
    assert list(after.configs) == []


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:9/hook", "http://10.1.2.3/hook", "ftp://example.com/x", "nope"]
)
async def test_private_or_odd_push_urls_are_refused_by_default(tmp_path: Path, url: str) -> None:
    with serve(tmp_path / "data", allow_private_push=False) as served:
        body = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "SendMessage",
            "params": {
                "message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "x"}]},
                "configuration": {"taskPushNotificationConfig": {"url": url}},
            },
        }
        response = httpx.post(served.url + "/", json=body, headers={"A2A-Version": "1.0"})
        listed = httpx.post(
            served.url + "/",
            json={"jsonrpc": "2.0", "id": 2, "method": "ListTasks", "params": {}},
            headers={"A2A-Version": "1.0"},
        )
    assert response.json()["error"]["code"] == -32602, response.text
    assert listed.json()["result"].get("tasks", []) == []


def _rpc(served: Served, method: str, params: dict[str, Any]) -> dict[str, Any]:
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
    answer: dict[str, Any] = httpx.post(
        served.url + "/", json=body, headers={"A2A-Version": "1.0"}
    ).json()
    return answer


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/hook", "http://10.1.2.3/hook",
                                 "http://169.254.169.254/latest"])
async def test_a_private_push_url_refusal_names_the_flag(tmp_path: Path, url: str) -> None:
    """Issue 27 hole 6: the refusal says why and how to allow it (it said only
    "Invalid push notification URL")."""
    with serve(tmp_path / "data", allow_private_push=False) as served:
        inline = _rpc(served, "SendMessage", {
            "message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "x"}]},
            "configuration": {"taskPushNotificationConfig": {"url": url}},
        })
        task = _rpc(served, "SendMessage", {
            "message": {"messageId": "m2", "role": "ROLE_USER", "parts": [{"text": "x"}]},
        })["result"]["task"]
        created = _rpc(served, "CreateTaskPushNotificationConfig",
                       {"taskId": task["id"], "id": "c", "url": url})
    for answer in (inline, created):
        error = answer["error"]
        assert error["code"] == -32602, answer
        assert "--allow-private-push" in error["message"] and url in error["message"], error


@pytest.mark.parametrize("url", ["ftp://example.com/x", "nope"])
async def test_a_malformed_push_url_refusal_says_what_is_wrong(tmp_path: Path, url: str) -> None:
    with serve(tmp_path / "data", allow_private_push=False) as served:
        answer = _rpc(served, "SendMessage", {
            "message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "x"}]},
            "configuration": {"taskPushNotificationConfig": {"url": url}},
        })
    assert answer["error"]["code"] == -32602
    assert "absolute http(s) URL" in answer["error"]["message"], answer
