"""Push delivery: bounded retries with backoff, the checked address pinned for the send,
one push per state change or closed artifact (issue 12, point 6)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest
from a2a.server.tasks import InMemoryPushNotificationConfigStore
from a2a.types import a2a_pb2 as pb

from mesh.a2a.push import BackgroundPushSender, make_push_url_validator

pytestmark = pytest.mark.anyio


def sender(handler: Any, *, allow_private: bool = True) -> tuple[BackgroundPushSender, list[Any]]:
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        response: httpx.Response = handler(request, len(seen))
        return response

    client = httpx.AsyncClient(transport=httpx.MockTransport(record))
    store = InMemoryPushNotificationConfigStore()
    push = BackgroundPushSender(client, store, make_push_url_validator(True),
                                allow_private=allow_private, backoff_s=0.0)
    return push, seen


def event() -> pb.TaskStatusUpdateEvent:
    return pb.TaskStatusUpdateEvent(
        task_id="t1", status=pb.TaskStatus(state=pb.TaskState.TASK_STATE_WORKING)
    )


def config(url: str) -> pb.TaskPushNotificationConfig:
    return pb.TaskPushNotificationConfig(task_id="t1", url=url, token="tok")


async def test_5xx_is_retried_with_backoff_then_delivered() -> None:
    push, seen = sender(lambda r, n: httpx.Response(503 if n < 3 else 200))
    assert await push._dispatch_notification(event(), config("http://127.0.0.1:9/hook"), "t1")
    assert len(seen) == 3 and push.num_sent == 1


async def test_retries_are_bounded_and_4xx_is_not_retried() -> None:
    push, seen = sender(lambda r, n: httpx.Response(502))
    assert not await push._dispatch_notification(event(), config("http://127.0.0.1:9/h"), "t1")
    assert len(seen) == push.retries + 1
    push, seen = sender(lambda r, n: httpx.Response(404))
    assert not await push._dispatch_notification(event(), config("http://127.0.0.1:9/h"), "t1")
    assert len(seen) == 1


async def test_the_checked_address_is_the_one_connected(monkeypatch: pytest.MonkeyPatch) -> None:
    """DNS answers a public address for the check, then loopback: the send still goes to
    the address that was checked (no rebinding window)."""
    answers = iter(["93.184.216.34", "127.0.0.1", "127.0.0.1"])
    loop = asyncio.get_running_loop()

    async def getaddrinfo(host: str, port: int, **kw: Any) -> list[Any]:
        ip = next(answers)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))]

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    push, seen = sender(lambda r, n: httpx.Response(200), allow_private=False)
    assert await push._dispatch_notification(event(), config("http://hooks.example/in"), "t1")
    assert seen[0].url.host == "93.184.216.34"
    assert seen[0].headers["host"] == "hooks.example"
    assert seen[0].headers["x-a2a-notification-token"] == "tok"


async def test_a_private_resolution_is_refused_without_a_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()

    async def getaddrinfo(host: str, port: int, **kw: Any) -> list[Any]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", port))]

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    push, seen = sender(lambda r, n: httpx.Response(200), allow_private=False)
    assert not await push._dispatch_notification(event(), config("http://in.example/"), "t1")
    assert seen == []


def test_one_push_per_state_change_and_closed_artifact() -> None:
    push, _ = sender(lambda r, n: httpx.Response(200))
    state = pb.TaskState
    events: list[Any] = [
        pb.Task(id="t1", status=pb.TaskStatus(state=state.TASK_STATE_SUBMITTED)),
        *[pb.TaskStatusUpdateEvent(task_id="t1", status=pb.TaskStatus(
            state=state.TASK_STATE_WORKING)) for _ in range(3)],
        pb.TaskArtifactUpdateEvent(task_id="t1", append=False),  # the first chunk
        *[pb.TaskArtifactUpdateEvent(task_id="t1", append=True) for _ in range(20)],
        pb.TaskArtifactUpdateEvent(task_id="t1", append=True, last_chunk=True),
        pb.TaskStatusUpdateEvent(task_id="t1", status=pb.TaskStatus(
            state=state.TASK_STATE_COMPLETED)),
    ]
    pushed = [e for e in events if push._worth_pushing("t1", e)]
    assert len(pushed) == 5, "task, working, first chunk, last chunk, completed"
