"""Bad input gets a clear error and loses nothing; size and capacity limits answer early."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.support.coord_helpers import FakeAdmission

pytestmark = pytest.mark.anyio

GOOD_MESSAGE = {"messageId": "m1", "role": "ROLE_USER", "parts": [{"text": "hello"}]}


def rpc(method: str, params: Any, rid: Any = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}


async def post_raw(client: httpx.AsyncClient, path: str, body: bytes, **headers: str) -> Any:
    return await client.post(
        path, content=body, headers={"content-type": "application/json", **headers}
    )


async def rpc_error(client: httpx.AsyncClient, body: Any) -> dict[str, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = await post_raw(client, "/", raw)
    assert response.status_code == 200, response.text
    doc = response.json()
    assert "result" not in doc, doc
    error: dict[str, Any] = doc["error"]
    return error


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", -32700),
        (b"\xff\xfe{}", -32700),
        (b"", -32700),
        (b"[" * 10_000 + b"]" * 10_000, -32700),
        (b'{"a":' * 5000 + b"1" + b"}" * 5000, -32700),
        (b"[]", -32600),
        (json.dumps([rpc("GetTask", {"id": "x"})]).encode(), -32600),
        (b'"just a string"', -32600),
        (json.dumps({"jsonrpc": "1.0", "id": 1, "method": "GetTask"}).encode(), -32600),
        (json.dumps({"jsonrpc": "2.0", "id": True, "method": "GetTask"}).encode(), -32600),
        (json.dumps({"jsonrpc": "2.0", "id": 1}).encode(), -32600),
        (json.dumps(rpc("NoSuchMethod", {})).encode(), -32601),
        (json.dumps(rpc("tasks/nope", {})).encode(), -32601),
    ],
    ids=[
        "bad-json", "not-utf8", "empty", "deep-10000-list", "deep-5000-object", "empty-batch",
        "batch", "string", "wrong-version", "bool-id", "no-method", "unknown", "unknown-0.3",
    ],
)
async def test_malformed_jsonrpc_gets_the_protocol_code(asgi: Any, body: bytes, code: int) -> None:
    async with asgi() as (client, _app):
        error = await rpc_error(client, body)
    assert error["code"] == code
    assert error["message"]


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ("a string", "params must be an object"),
        ({}, "params.message is required"),
        ({"message": "hello"}, "params.message must be an object"),
        ({"message": {**GOOD_MESSAGE, "role": True}}, "role"),
        ({"message": {**GOOD_MESSAGE, "parts": ["x"]}}, "parts[0] must be an object"),
        ({"message": {**GOOD_MESSAGE, "parts": []}}, "non-empty list"),
        ({"message": {**GOOD_MESSAGE, "parts": [{"text": 5}]}}, "parts[0].text must be a string"),
        ({"message": {**GOOD_MESSAGE, "parts": [{"text": "a", "url": "b"}]}}, "exactly one"),
        ({"message": {**GOOD_MESSAGE, "messageId": 7}}, "messageId must be a string"),
        ({"message": {k: v for k, v in GOOD_MESSAGE.items() if k != "messageId"}}, "messageId"),
        ({"message": {**GOOD_MESSAGE, "parts": [{"text": "   "}]}}, "no text and no subtasks"),
        (
            {"message": {**GOOD_MESSAGE, "parts": [{"data": {"subtasks": [{"params": {}}]}}]}},
            "instructions must be a non-empty string",
        ),
        (
            {"message": {**GOOD_MESSAGE, "parts": [{"data": {"subtasks": "do it"}}]}},
            "subtasks must be a list",
        ),
        ({"message": GOOD_MESSAGE, "configuration": []}, "configuration must be an object"),
        (
            {"message": GOOD_MESSAGE, "configuration": {"historyLength": "3"}},
            "historyLength must be an integer",
        ),
        (
            {"message": GOOD_MESSAGE, "configuration": {"taskPushNotificationConfig": {}}},
            "url is required",
        ),
    ],
)
async def test_lenient_bodies_are_refused_with_invalid_params(
    asgi: Any, params: Any, needle: str
) -> None:
    async with asgi() as (client, _app):
        error = await rpc_error(client, rpc("SendMessage", params))
        listed = await client.post("/", json=rpc("ListTasks", {}))
    assert error["code"] == -32602
    assert needle in error["message"]
    assert listed.json()["result"].get("tasks", []) == []  # nothing was created


async def test_too_many_parts_and_chars_are_invalid_params(asgi: Any) -> None:
    async with asgi(max_parts=2, max_message_chars=10) as (client, _app):
        parts = {"message": {**GOOD_MESSAGE, "parts": [{"text": "a"}] * 3}}
        chars = {"message": {**GOOD_MESSAGE, "parts": [{"text": "x" * 11}]}}
        assert (await rpc_error(client, rpc("SendMessage", parts)))["code"] == -32602
        assert (await rpc_error(client, rpc("SendMessage", chars)))["code"] == -32602


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("GetTask", {}),
        ("GetTask", {"id": 5}),
        ("GetTask", {"id": "x", "historyLength": -1}),
        ("ListTasks", {"pageSize": 0}),
        ("ListTasks", {"pageSize": "ten"}),
        ("ListTasks", {"status": "DONE"}),
        ("ListTasks", {"includeArtifacts": "yes"}),
        ("CancelTask", {"id": ""}),
        ("CreateTaskPushNotificationConfig", {"taskId": "t"}),
        ("GetTaskPushNotificationConfig", {"taskId": "t"}),
    ],
)
async def test_other_methods_check_params(asgi: Any, method: str, params: Any) -> None:
    async with asgi() as (client, _app):
        assert (await rpc_error(client, rpc(method, params)))["code"] == -32602


async def test_unknown_task_is_task_not_found(asgi: Any) -> None:
    async with asgi() as (client, _app):
        for method in ("GetTask", "CancelTask"):
            error = await rpc_error(client, rpc(method, {"id": "no-such-task"}))
            assert error["code"] == -32001, error


async def test_good_request_passes_through_untouched(asgi: Any) -> None:
    async with asgi() as (client, _app):
        response = await client.post("/", json=rpc("SendMessage", {"message": GOOD_MESSAGE}))
    task = response.json()["result"]["task"]
    assert task["status"]["state"] == "TASK_STATE_COMPLETED"


# --------------------------------------------------------------------------- HTTP+JSON


@pytest.mark.parametrize(
    ("body", "ctype", "status"),
    [
        (b"\xff\xfe\xfd", "application/json", 400),
        (b"{oops", "application/json", 400),
        (b"[1, 2]", "application/json", 400),
        (b"[" * 10_000 + b"]" * 10_000, "application/json", 400),
        (json.dumps({"message": GOOD_MESSAGE}).encode(), "text/plain", 415),
        (json.dumps({"message": {**GOOD_MESSAGE, "parts": ["x"]}}).encode(), "application/json",
         422),
        (json.dumps({"message": {**GOOD_MESSAGE, "role": True}}).encode(), "application/json", 422),
        (json.dumps({"message": "hi"}).encode(), "application/json", 422),
    ],
    ids=["not-utf8", "bad-json", "array", "deep", "wrong-type", "parts-strings", "role-bool",
         "message-string"],
)
async def test_rest_bad_bodies(asgi: Any, body: bytes, ctype: str, status: int) -> None:
    async with asgi() as (client, _app):
        response = await client.post(
            "/a2a/message:send", content=body, headers={"content-type": ctype}
        )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"]


async def test_rest_unknown_task_and_route_are_json_404(asgi: Any) -> None:
    async with asgi() as (client, _app):
        task = await client.get("/a2a/tasks/no-such-task")
        route = await client.get("/a2a/nothing/here")
        bad_query = await client.get("/a2a/tasks?pageSize=abc")
    assert task.status_code == 404 and task.json()["error"]["message"]
    assert route.status_code == 404 and "HTTP+JSON under /a2a" in route.json()["error"]["message"]
    assert bad_query.status_code == 400, bad_query.text


async def test_rest_good_send(asgi: Any) -> None:
    async with asgi() as (client, _app):
        response = await client.post("/a2a/message:send", json={"message": GOOD_MESSAGE})
    assert response.status_code == 200, response.text
    assert response.json()["task"]["status"]["state"] == "TASK_STATE_COMPLETED"


# --------------------------------------------------------------------------- 413 / 429


async def test_oversized_body_is_413_before_it_is_read(asgi: Any) -> None:
    async with asgi(max_body_bytes=2048) as (client, _app):
        big = json.dumps(rpc("SendMessage", {"message": {**GOOD_MESSAGE,
                                                         "parts": [{"text": "x" * 5000}]}}))
        declared = await post_raw(client, "/", big.encode())

        async def chunks() -> Any:  # no Content-Length: counted while read
            for _ in range(10):
                yield b" " * 1000

        chunked = await client.post("/a2a/message:send", content=chunks(),
                                    headers={"content-type": "application/json"})
    assert declared.status_code == 413
    assert declared.json()["error"]["code"] == -32600
    assert "2048 bytes" in declared.json()["error"]["message"]
    assert chunked.status_code == 413
    assert chunked.json()["error"]["code"] == 413


async def test_full_queue_is_429_with_retry_after(asgi: Any) -> None:
    admission = FakeAdmission(slots=0, max_queue=0, retry_after_s=2.5)
    async with asgi(admission=admission) as (client, _app):
        jsonrpc = await client.post("/", json=rpc("SendMessage", {"message": GOOD_MESSAGE}))
        rest = await client.post("/a2a/message:stream", json={"message": GOOD_MESSAGE})
        listed = await client.post("/", json=rpc("ListTasks", {}))
    for response in (jsonrpc, rest):
        assert response.status_code == 429
        assert response.headers["retry-after"] == "3"
        assert "retry after 3 s" in response.text
    assert listed.status_code == 200  # reads are never refused
