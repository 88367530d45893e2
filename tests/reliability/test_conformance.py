"""A2A 1.0 conformance holes (issue 12, point 7): a 1.0-schema card, camelCase data-part
keys, ContentTypeNotSupportedError for parts of a media type the agent does not take, and
0.3 clients still served (their card and ``message/send``)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.fake_stack import fake_stack

pytestmark = pytest.mark.anyio

V03_ONLY = {"url", "protocolVersion", "preferredTransport", "additionalInterfaces"}


def send(parts: list[dict[str, Any]]) -> dict[str, Any]:
    msg = {"messageId": uuid.uuid4().hex, "role": "ROLE_USER", "parts": parts}
    return {"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {"message": msg}}


async def test_the_card_is_a_1_0_card(tmp_path: Path) -> None:
    async with fake_stack(tmp_path) as stack:
        r = await stack.client.get("/.well-known/agent-card.json")
        card = r.json()
        assert r.status_code == 200 and card["supportedInterfaces"]
        assert not V03_ONLY & set(card), sorted(V03_ONLY & set(card))
        again = await stack.client.get(
            "/.well-known/agent-card.json", headers={"If-None-Match": r.headers["etag"]}
        )
        assert again.status_code == 304


async def test_0_3_clients_get_the_0_3_card_and_message_send(tmp_path: Path) -> None:
    async with fake_stack(tmp_path) as stack:
        for r in (
            await stack.client.get("/.well-known/agent.json"),
            await stack.client.get("/.well-known/agent-card.json",
                                   headers={"A2A-Version": "0.3"}),
        ):
            card = r.json()
            assert card["url"].startswith("http") and card["protocolVersion"].startswith("0.3")
            assert card["preferredTransport"] == "JSONRPC"
        msg = {"kind": "message", "messageId": uuid.uuid4().hex, "role": "user",
               "parts": [{"kind": "text", "text": "hello from 0.3"}]}
        r = await stack.client.post(
            "/", json={"jsonrpc": "2.0", "id": 7, "method": "message/send",
                       "params": {"message": msg}},
            headers={"A2A-Version": "0.3"},
        )
        body = r.json()
        assert "result" in body, body
        assert body["result"]["kind"] == "task"
        assert body["result"]["status"]["state"] == "completed"


async def test_answer_data_part_keys_are_camel_case(tmp_path: Path) -> None:
    async with fake_stack(tmp_path) as stack:
        r = await stack.client.post("/", json=send([{"text": "hi"}]))
        task = r.json()["result"]["task"]
        answer = next(a for a in task["artifacts"] if a["artifactId"] == "answer")
        data = next(p["data"] for p in answer["parts"] if "data" in p)
        sub = data["subtasks"][0]
        assert {"turns", "tokens", "toolCalls", "finishReason"} <= set(sub)
        assert not [k for k in sub if "_" in k]


async def test_an_unsupported_media_type_is_content_type_not_supported(tmp_path: Path) -> None:
    async with fake_stack(tmp_path) as stack:
        r = await stack.client.post(
            "/", json=send([{"text": "look"}, {"raw": "iVBORw0K", "mediaType": "image/png"}])
        )
        err = r.json()["error"]
        assert err["code"] == -32005 and "image/png" in err["message"]
        msg = send([{"raw": "iVBORw0K", "mediaType": "image/png"}])["params"]
        r = await stack.client.post("/a2a/message:send", json=msg)
        assert r.status_code == 415
        ok = await stack.client.post(
            "/", json=send([{"text": "notes", "mediaType": "text/markdown"}])
        )
        assert "result" in ok.json()


async def test_a_jsonrpc_body_sent_as_text_plain_is_content_type_not_supported(
    tmp_path: Path,
) -> None:
    # Checked before the body is read: even a body that is not JSON gets -32005, not -32700.
    async with fake_stack(tmp_path) as stack:
        for content in (b"{'jsonrpc': '2.0'}", json.dumps(send([{"text": "hi"}])).encode()):
            r = await stack.client.post(
                "/", content=content,
                headers={"content-type": "text/plain", "A2A-Version": "1.0"},
            )
            assert r.status_code == 200
            err = r.json()["error"]
            assert err["code"] == -32005 and "application/json" in err["message"], err
        ok = await stack.client.post(
            "/", content=json.dumps(send([{"text": "hi"}])).encode(),
            headers={"content-type": "application/json; charset=utf-8", "A2A-Version": "1.0"},
        )
        assert "result" in ok.json()
