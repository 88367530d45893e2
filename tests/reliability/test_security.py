"""Who may call what: loopback by default, a bearer token on every route but the card,
tools confined to the project, push URLs that cannot reach internal hosts, and callers
kept apart from each other's tasks."""

from __future__ import annotations

import argparse
import hmac
import os
import string
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh.cli import serve as serve_cli
from mesh.worker.tools import ProjectTools, ToolError
from tests.reliability.fake_stack import fake_stack
from tests.reliability.serve_proc import message

TOKEN_A = "alpha-token-0123456789"
TOKEN_B = "bravo-token-9876543210"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def rpc(method: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}


# --------------------------------------------------------------------------- binding


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mesh")
    serve_cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_default_bind_is_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESH_AUTH_TOKEN", raising=False)
    args = serve_args()
    assert args.host == "127.0.0.1"
    assert args.auth_token is None


@pytest.mark.parametrize(
    ("host", "token", "warned"),
    [
        ("0.0.0.0", None, True),
        ("192.168.1.5", None, True),
        ("0.0.0.0", TOKEN_A, False),
        ("127.0.0.1", None, False),
    ],
)
def test_binding_elsewhere_without_a_token_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    host: str, token: str | None, warned: bool,
) -> None:
    monkeypatch.delenv("MESH_AUTH_TOKEN", raising=False)
    # A missing project stops the start right after the bind check: nothing is served.
    argv = ["--host", host, "--project", str(tmp_path / "missing"), "--model", "tiny",
            "--data-dir", str(tmp_path / "data")]
    if token:
        argv += ["--auth-token", token]
    assert serve_cli.run(serve_args(*argv)) == 2
    err = capsys.readouterr().err
    assert ("without --auth-token" in err) is warned, err
    assert "project directory not found" in err


# --------------------------------------------------------------------------- token


ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/", rpc("GetTask", {"id": "x"})),
    ("POST", "/", rpc("SendMessage", {"message": message("hi")})),
    ("POST", "/", rpc("ListTasks", {})),
    ("POST", "/a2a/message:send", {"message": message("hi")}),
    ("GET", "/a2a/tasks", None),
    ("GET", "/a2a/tasks/x", None),
    ("POST", "/a2a/v1/message:send", {"message": message("hi")}),
    ("GET", "/capacity", None),
    ("GET", "/metrics", None),
    ("POST", "/v1/sessions", {}),
    ("GET", "/v1/sessions", None),
    ("GET", "/v1/sessions/s1", None),
    ("DELETE", "/v1/sessions/s1", None),
    ("POST", "/v1/sessions/s1/turns", {"text": "x"}),
    ("GET", "/nowhere", None),
    ("GET", "/healthz/", None),
    ("GET", "/.well-known/agent-card.json/x", None),
]
BAD_HEADERS: list[dict[str, str]] = [
    {},
    {"Authorization": ""},
    {"Authorization": "Bearer"},
    {"Authorization": "Bearer "},
    {"Authorization": f"Basic {TOKEN_A}"},
    {"Authorization": f"Bearer {TOKEN_A[:-1]}"},
    {"Authorization": f"Bearer {TOKEN_A}x"},
    {"Authorization": f"Bearer {TOKEN_A},{TOKEN_B}"},
    {"Authorization": f"{TOKEN_A}"},
    {"Authorization": "Bearer " + TOKEN_A.upper()},
]


@pytest.mark.anyio
async def test_every_route_but_the_card_needs_the_token(tmp_path: Path) -> None:
    async with fake_stack(tmp_path, auth_token=f"{TOKEN_A},{TOKEN_B}") as stack:
        c = stack.client
        for method, path, body in ROUTES:
            for headers in BAD_HEADERS:
                r = await c.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert r.headers["www-authenticate"].startswith("Bearer")
            for token in (TOKEN_A, TOKEN_B):
                r = await c.request(method, path, json=body, headers=bearer(token))
                assert r.status_code != 401, (method, path, r.text)
        card = await c.get("/.well-known/agent-card.json")
        health = await c.get("/healthz")
    assert card.status_code == 200 and health.status_code == 200
    doc = card.json()
    assert doc["securitySchemes"]["bearer"]["httpAuthSecurityScheme"]["scheme"] == "Bearer"
    assert doc["securityRequirements"] == [{"schemes": {"bearer": {}}}]


@pytest.mark.anyio
async def test_tokens_are_compared_in_constant_time_every_one_every_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def compare(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", compare)  # auth calls hmac.compare_digest
    async with fake_stack(tmp_path, auth_token=f"{TOKEN_A},{TOKEN_B}") as stack:
        for presented in (TOKEN_A, TOKEN_B, "wrong-token-xyz"):
            seen.clear()
            r = await stack.client.get("/capacity", headers=bearer(presented))
            assert r.status_code == (401 if presented.startswith("wrong") else 200)
            # Both configured tokens compared, even when the first one matched.
            assert sorted(b for _, b in seen) == sorted([TOKEN_A.encode(), TOKEN_B.encode()])
            assert {a for a, _ in seen} == {presented.encode()}


# --------------------------------------------------------------------------- isolation


@pytest.mark.anyio
async def test_a_caller_cannot_touch_another_callers_task(tmp_path: Path) -> None:
    async with fake_stack(tmp_path, auth_token=f"{TOKEN_A},{TOKEN_B}",
                          allow_private_push=True) as stack:
        c = stack.client
        stack.probe.unblock.clear()
        sent = await c.post("/", headers=bearer(TOKEN_A), json=rpc(
            "SendMessage", {"message": message("block for a"),
                            "configuration": {"returnImmediately": True}}))
        task_id = sent.json()["result"]["task"]["id"]
        hook = "http://127.0.0.1:9/stolen"
        attempts = [
            rpc("GetTask", {"id": task_id}),
            rpc("CancelTask", {"id": task_id}),
            rpc("SubscribeToTask", {"id": task_id}),
            rpc("CreateTaskPushNotificationConfig", {"taskId": task_id, "url": hook}),
            rpc("ListTaskPushNotificationConfigs", {"taskId": task_id}),
            rpc("GetTaskPushNotificationConfig", {"taskId": task_id, "id": "c"}),
            rpc("DeleteTaskPushNotificationConfig", {"taskId": task_id, "id": "c"}),
            rpc("SendMessage", {"message": {**message("hijack"), "taskId": task_id}}),
        ]
        for body in attempts:
            r = await c.post("/", json=body, headers=bearer(TOKEN_B))
            assert r.status_code == 200, r.text
            assert r.json().get("error", {}).get("code") == -32001, (body["method"], r.text)
        for method, path, rest_body in [
            ("GET", f"/a2a/tasks/{task_id}", None),
            ("POST", f"/a2a/tasks/{task_id}:cancel", {}),
            ("POST", f"/a2a/tasks/{task_id}/pushNotificationConfigs", {"url": hook}),
            ("GET", f"/a2a/tasks/{task_id}/pushNotificationConfigs", None),
        ]:
            r = await c.request(method, path, json=rest_body, headers=bearer(TOKEN_B))
            assert r.status_code == 404, (method, path, r.status_code, r.text)
        listed = await c.post("/", json=rpc("ListTasks", {}), headers=bearer(TOKEN_B))
        assert listed.json()["result"].get("tasks", []) == []
        # The owner still sees its task untouched, with no foreign push config on it.
        own = await c.post("/", json=rpc("GetTask", {"id": task_id}), headers=bearer(TOKEN_A))
        assert own.json()["result"]["status"]["state"] == "TASK_STATE_WORKING"
        configs = await c.post("/", headers=bearer(TOKEN_A), json=rpc(
            "ListTaskPushNotificationConfigs", {"taskId": task_id}))
        assert configs.json()["result"].get("configs", []) == []
        stack.probe.unblock.set()


# --------------------------------------------------------------------------- push URLs


PRIVATE_URLS = [
    "http://127.0.0.1:9/hook",
    "http://localhost/hook",
    "http://127.1/hook",
    "http://2130706433/hook",  # 127.0.0.1 as one number
    "http://0x7f000001/hook",
    "http://0177.0.0.1/hook",
    "http://[::1]/hook",
    "http://[::ffff:127.0.0.1]/hook",
    "http://0.0.0.0/hook",
    "http://10.0.0.1/hook",
    "http://172.16.5.4/hook",
    "http://192.168.0.1/hook",
    "http://169.254.169.254/latest/meta-data",
    "http://[fd00::1]/hook",
    "http://100.64.0.1/hook",
    "file:///etc/passwd",
    "gopher://127.0.0.1:25/",
    "http:///hook",
    "http://user@127.0.0.1/hook",
    "http://127.0.0.1:99999/hook",
]


@pytest.mark.anyio
async def test_push_urls_to_internal_hosts_are_refused(tmp_path: Path) -> None:
    async with fake_stack(tmp_path) as stack:
        c = stack.client
        stack.probe.unblock.clear()
        sent = await c.post("/", json=rpc("SendMessage", {
            "message": message("block"), "configuration": {"returnImmediately": True}}))
        task_id = sent.json()["result"]["task"]["id"]
        for url in PRIVATE_URLS:
            create = await c.post("/", json=rpc(
                "CreateTaskPushNotificationConfig", {"taskId": task_id, "url": url}))
            assert create.json()["error"]["code"] == -32602, (url, create.text)
            rest = await c.post(f"/a2a/tasks/{task_id}/pushNotificationConfigs",
                                json={"url": url})
            assert rest.status_code in (400, 422), (url, rest.status_code, rest.text)
            inline = await c.post("/", json=rpc("SendMessage", {
                "message": message("x"),
                "configuration": {"taskPushNotificationConfig": {"url": url}}}))
            assert inline.json()["error"]["code"] == -32602, (url, inline.text)
        configs = await c.post("/", json=rpc("ListTaskPushNotificationConfigs",
                                             {"taskId": task_id}))
        assert configs.json()["result"].get("configs", []) == []
        stack.probe.unblock.set()


# --------------------------------------------------------------------------- tools


SECRET = "TOP-SECRET-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def jail(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("jail")
    outside = base / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET + "\n")
    (base / "sibling.txt").write_text(SECRET + "\n")
    root = base / "project"
    (root / "sub" / "deep").mkdir(parents=True)
    (root / "README.md").write_text("readme\n")
    (root / "sub" / "a.py").write_text("x = 1\n")
    (root / ".env").write_text(SECRET + "\n")
    os.symlink(outside, root / "out_dir")
    os.symlink(outside / "secret.txt", root / "out_file")
    os.symlink("../../outside/secret.txt", root / "sub" / "rel_out")
    os.symlink(root / ".env", root / "env_link")
    os.symlink(root / "sub", root / "sub_link")  # inside: allowed
    return root, outside


SEGMENTS = [
    "..", ".", "", "sub", "deep", "a.py", "README.md", "out_dir", "out_file", "rel_out",
    "env_link", "sub_link", ".env", "secret.txt", "outside", "project", "~", "C:",
    "%2e%2e", "..\\..", "...", " ", "\x00", "sibling.txt",
]


@st.composite
def hostile_paths(draw: st.DrawFn) -> str:
    segments = draw(st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=6))
    sep = draw(st.sampled_from(["/", "\\", "//"]))
    lead = draw(st.sampled_from(["", "/", "./", "~/", "\\\\", "/etc/../"]))
    return lead + sep.join(segments)


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.one_of(hostile_paths(), st.text(string.printable, max_size=40)),
    tool=st.sampled_from(["read_file", "list_files", "grep"]),
)
def test_tools_never_leave_the_project(jail: tuple[Path, Path], path: str, tool: str) -> None:
    root, outside = jail
    tools = ProjectTools(root)
    args: dict[str, Any] = {"path": path}
    if tool == "grep":
        args["text"] = "SECRET"
    if tool == "list_files":
        args["depth"] = 6
    try:
        out = getattr(tools, tool)(args)
    except ToolError:
        return
    assert SECRET not in out, (tool, path)
    assert "secret.txt" not in out and ".env" not in out, (tool, path)
    resolved = tools.resolve(path)  # accepted: it must resolve inside the root
    assert resolved.is_relative_to(root.resolve())
    assert not resolved.is_relative_to(outside.resolve())
