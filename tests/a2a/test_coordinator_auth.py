"""Bearer auth: 401 without the token, the card stays public and declares the scheme,
and each caller sees only its own tasks."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.support.coord_helpers import TOKEN_A, TOKEN_B

pytestmark = pytest.mark.anyio

MESSAGE = {"messageId": "m1", "role": "ROLE_USER", "parts": [{"text": "mine"}]}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def capacity(request: Request) -> Response:
    return JSONResponse({"slots": 1})


def rpc(method: str, params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}


@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [
        ("POST", "/", {}),
        ("POST", "/", {"Authorization": "Bearer wrong-token-000"}),
        ("POST", "/", {"Authorization": f"Basic {TOKEN_A}"}),
        ("POST", "/a2a/message:send", {}),
        ("GET", "/a2a/tasks", {}),
        ("GET", "/capacity", {}),
        ("GET", "/nowhere", {}),
    ],
)
async def test_calls_without_the_token_get_401(
    asgi: Any, method: str, path: str, headers: dict[str, str]
) -> None:
    async with asgi(auth_token=TOKEN_A, extra_routes=[Route("/capacity", capacity)]) as (c, _):
        response = await c.request(method, path, json=rpc("SendMessage", {"message": MESSAGE}),
                                   headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert "MESH_TOKEN" in response.json()["error"]["message"]


async def test_card_and_health_stay_public_and_declare_the_scheme(asgi: Any) -> None:
    async with asgi(auth_token=TOKEN_A, extra_routes=[Route("/capacity", capacity)]) as (c, _):
        card = await c.get("/.well-known/agent-card.json")
        health = await c.get("/healthz")
        extra = await c.get("/capacity", headers=bearer(TOKEN_A))
    assert card.status_code == 200 and health.status_code == 200
    assert extra.json() == {"slots": 1}
    doc = card.json()
    assert doc["securitySchemes"]["bearer"]["httpAuthSecurityScheme"]["scheme"] == "Bearer"
    assert doc["securityRequirements"] == [{"schemes": {"bearer": {}}}]


async def test_each_caller_sees_only_its_own_tasks(asgi: Any) -> None:
    async with asgi(auth_token=f"{TOKEN_A},{TOKEN_B}") as (c, _):
        sent = await c.post("/", json=rpc("SendMessage", {"message": MESSAGE}),
                            headers=bearer(TOKEN_A))
        task_id = sent.json()["result"]["task"]["id"]
        own = await c.post("/", json=rpc("GetTask", {"id": task_id}), headers=bearer(TOKEN_A))
        other = await c.post("/", json=rpc("GetTask", {"id": task_id}), headers=bearer(TOKEN_B))
        other_rest = await c.get(f"/a2a/tasks/{task_id}", headers=bearer(TOKEN_B))
        other_cancel = await c.post("/", json=rpc("CancelTask", {"id": task_id}),
                                    headers=bearer(TOKEN_B))
        list_a = await c.post("/", json=rpc("ListTasks", {}), headers=bearer(TOKEN_A))
        list_b = await c.post("/", json=rpc("ListTasks", {}), headers=bearer(TOKEN_B))
        follow_up = await c.post(
            "/",
            json=rpc("SendMessage", {"message": {**MESSAGE, "messageId": "m2", "taskId": task_id}}),
            headers=bearer(TOKEN_B),
        )
    assert own.json()["result"]["id"] == task_id
    assert other.json()["error"]["code"] == -32001
    assert other_rest.status_code == 404
    assert other_cancel.json()["error"]["code"] == -32001
    assert [t["id"] for t in list_a.json()["result"]["tasks"]] == [task_id]
    assert list_b.json()["result"].get("tasks", []) == []
    assert follow_up.json()["error"]["code"] == -32001
