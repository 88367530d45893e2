"""Hostile bodies against JSON-RPC and HTTP+JSON: never a 5xx, always the protocol's error.

The whole ``mesh serve`` app (fake engine, scripted worker) runs in-process over
``httpx.ASGITransport`` on one event loop kept for the module; hypothesis is derandomized,
so CI sees the same ~1,300 bodies every run.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mesh.a2a.validation import JSONRPC_METHODS
from tests.reliability.fake_stack import FakeStack, fake_stack

# JSON-RPC: the spec's codes, and A2A's -32001..-32099 (task not found, not cancelable,
# unsupported operation, ...) and -32000 (over capacity). Never -32603 (internal error).
RPC_CODES = {-32700, -32600, -32601, -32602}
A2A_CODES = set(range(-32099, -32000 + 1))
def fuzz(num: int) -> settings:
    return settings(
        max_examples=num,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                               HealthCheck.data_too_large],
    )


class App:
    """The app on a private loop; ``post`` is synchronous for hypothesis."""

    def __init__(self, tmp: Path) -> None:
        self.runner = asyncio.Runner()
        self.stack = AsyncExitStack()
        self.fake: FakeStack = self.runner.run(
            self.stack.enter_async_context(fake_stack(tmp, max_queue=1_000))
        )
        self.num_requests = 0
        self.seen: Counter[str] = Counter()  # what the fuzz reached, to prove it is not vacuous

    def post(
        self, path: str, body: bytes, ctype: str = "application/json", version: str = "1.0"
    ) -> httpx.Response:
        self.num_requests += 1
        headers = {"content-type": ctype, "A2A-Version": version}
        return self.runner.run(self.fake.client.post(path, content=body, headers=headers))

    def close(self) -> None:
        self.runner.run(self.stack.aclose())
        self.runner.close()


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    served = App(tmp_path_factory.mktemp("fuzz"))
    yield served
    served.close()


def check_rpc(app: App, response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code in (413, 429):
        app.seen[f"rpc {response.status_code}"] += 1
        return
    assert response.status_code == 200, response.text
    doc = response.json()
    assert doc.get("jsonrpc") == "2.0", doc
    if "error" in doc:
        code = doc["error"]["code"]
        assert code in RPC_CODES | A2A_CODES, doc
        assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]
        app.seen[f"rpc {code}"] += 1
    else:
        assert "result" in doc, doc
        app.seen["rpc result"] += 1


def check_rest(app: App, response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    app.seen[f"rest {response.status_code}"] += 1
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["code"] == response.status_code, error
        assert isinstance(error["message"], str) and error["message"]


# --------------------------------------------------------------------------- strategies

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)
ids = st.one_of(st.none(), st.integers(), st.text(max_size=10), st.booleans(), st.floats(),
                st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3),
                                                                      st.integers(), max_size=2))
methods = st.one_of(st.sampled_from(sorted(JSONRPC_METHODS)), st.text(max_size=20),
                    st.sampled_from(["", "rpc.discover", "SendMessage ", "sendmessage"]))
huge = st.sampled_from([0, 1, 10_000, 300_000, 2_000_000]).map(lambda n: "x" * n)


def deep(depth: int, kind: str) -> Any:
    doc: Any = 1
    for _ in range(depth):
        doc = [doc] if kind == "list" else {"a": doc}
    return doc


deep_values = st.builds(deep, st.sampled_from([5, 60, 70, 400]),
                        st.sampled_from(["list", "dict"]))
parts = st.one_of(
    st.builds(lambda t: {"text": t}, st.one_of(st.text(max_size=50), huge, json_values)),
    st.builds(lambda d: {"data": d}, json_values),
    st.builds(lambda d: {"data": {"subtasks": d}}, json_values),
    st.builds(lambda u: {"url": u}, json_values),
    st.builds(lambda r: {"raw": r}, st.one_of(st.text(max_size=20), json_values)),
    json_values,
)
messages = st.fixed_dictionaries(
    {},
    optional={
        "messageId": st.one_of(st.text(max_size=10), json_values),
        "role": st.one_of(st.sampled_from(["ROLE_USER", "ROLE_AGENT", "user", ""]), json_values),
        "parts": st.one_of(st.lists(parts, max_size=5), json_values,
                           st.integers(65, 80).map(lambda n: [{"text": "p"}] * n)),
        "taskId": st.one_of(st.text(max_size=10), json_values),
        "contextId": json_values,
        "metadata": st.one_of(json_values, deep_values),
        "extensions": json_values,
    },
)
send_params = st.fixed_dictionaries(
    {"message": st.one_of(messages, json_values)},
    optional={
        "configuration": st.one_of(json_values, st.fixed_dictionaries({}, optional={
            "returnImmediately": st.just(True),
            "historyLength": json_values,
            "acceptedOutputModes": json_values,
            "taskPushNotificationConfig": json_values,
        })),
        "metadata": json_values,
        "tenant": json_values,
    },
)
params = st.one_of(json_values, send_params, deep_values,
                   st.fixed_dictionaries({"id": json_values, "historyLength": json_values}),
                   st.fixed_dictionaries({"taskId": json_values, "url": json_values,
                                          "id": json_values}))


@st.composite
def envelopes(draw: st.DrawFn) -> bytes:
    """Mostly well-formed envelopes (so the params checks are reached), some broken ones."""
    doc: dict[str, Any] = {}
    odd = draw(st.integers(0, 9))  # 0: a broken envelope field, else a good one
    doc["jsonrpc"] = draw(st.sampled_from(["1.0", 2.0, None, ""])) if odd == 0 else "2.0"
    doc["id"] = draw(ids) if odd == 1 else draw(st.one_of(st.integers(), st.text(max_size=8)))
    if odd == 2:
        doc["method"] = draw(methods)
    else:
        doc["method"] = draw(st.sampled_from(sorted(JSONRPC_METHODS)))
    if odd != 3:
        doc["params"] = draw(params)
    return json.dumps(doc).encode("utf-8")


raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.binary(max_size=50).map(lambda b: b'{"jsonrpc":"2.0","id":1,"method":"' + b + b'"}'),
    st.sampled_from([b"\xff\xfe\x00", b"\xc3\x28", b'{"a":"\xed\xa0\x80"}', b"\xef\xbb\xbf{}",
                     b"[" * 100_000, b"{\"a\":" * 20_000,
                     b'{"x":"' + b"a" * 1_100_000 + b'"}', b"null", b"0", b"1e999", b"NaN",
                     b'{"jsonrpc":"2.0","id":1,"method":"GetTask","params":{"id":"\\ud800"}}']),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.sampled_from([63, 64, 65, 3_000, 50_000]).map(
        lambda n: b'{"jsonrpc":"2.0","id":1,"method":"SendMessage","params":{"message":'
        + b'{"a":[' * n + b"1" + b"]}" * n + b"}}"
    ),
)


# --------------------------------------------------------------------------- tests


@fuzz(600)
# A well-formed call always runs, so the coverage check below never depends on draw order.
@example(body=b'{"jsonrpc":"2.0","id":1,"method":"ListTasks","params":{}}', version="1.0")
@given(body=envelopes(), version=st.sampled_from(["1.0", "1.0", "0.3", "", "2.0", "x", "0.9"]))
def test_jsonrpc_envelopes(app: App, body: bytes, version: str) -> None:
    check_rpc(app, app.post("/", body, version=version))


@fuzz(250)
@given(body=raw_bodies)
def test_jsonrpc_raw_bytes(app: App, body: bytes) -> None:
    check_rpc(app, app.post("/", body))


REST_POSTS = ["/a2a/message:send", "/a2a/message:stream", "/a2a/tasks/t1:cancel",
              "/a2a/tasks/t1/pushNotificationConfigs", "/a2a/v1/message:send",
              "/a2a/tasks/t1:subscribe", "/a2a/nope"]


@fuzz(450)
@example(path="/a2a/message:send", body=b'{"x":"' + b"a" * 1_100_000 + b'"}',
         ctype="application/json")
@given(
    path=st.sampled_from(REST_POSTS),
    body=st.one_of(raw_bodies, send_params.map(lambda p: json.dumps(p).encode())),
    ctype=st.sampled_from(["application/json", "application/a2a+json", "text/plain", ""]),
)
def test_rest_bodies(app: App, path: str, body: bytes, ctype: str) -> None:
    response = app.post(path, body, ctype)
    check_rest(app, response)


@fuzz(150)
@given(query=st.dictionaries(
    st.sampled_from(["pageSize", "historyLength", "includeArtifacts", "status", "contextId",
                     "pageToken", "statusTimestampAfter", "page_size", "x"]),
    st.one_of(st.text(max_size=12), st.integers().map(str)), max_size=4,
), path=st.sampled_from(["/a2a/tasks", "/a2a/tasks/t1", "/a2a/tasks/t1/pushNotificationConfigs",
                         "/a2a/extendedAgentCard"]))
def test_rest_queries(app: App, query: dict[str, str], path: str) -> None:
    response = app.runner.run(app.fake.client.get(path, params=query))
    check_rest(app, response)


def test_the_server_is_still_healthy_after_the_fuzz(app: App) -> None:
    if app.num_requests >= 1_000:  # the whole module ran: the fuzz reached every answer
        for key in ("rpc -32700", "rpc -32600", "rpc -32601", "rpc -32602", "rpc result",
                    "rpc 413", "rest 400", "rest 404", "rest 413", "rest 415", "rest 422",
                    "rest 200"):
            assert app.seen[key] > 0, (key, app.seen)
    response = app.runner.run(app.fake.client.get("/healthz"))
    assert response.status_code == 200
    ok = app.post("/", json.dumps({"jsonrpc": "2.0", "id": 1, "method": "SendMessage",
                                   "params": {"message": {"messageId": "m", "role": "ROLE_USER",
                                                          "parts": [{"text": "hi"}]}}}).encode())
    assert ok.json()["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
