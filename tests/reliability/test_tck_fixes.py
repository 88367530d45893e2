"""What the A2A TCK's MUST failures (issue 42 item 5, ``docs/conformance.md``) come down to,
pinned over real HTTP (the whole app of ``mesh serve`` through ``httpx.ASGITransport``, and
the official SDK client over a real uvicorn):

* HTTP_JSON-SVC-001 (fixed): an HTTP+JSON answer is labelled ``application/json`` (A2A
  1.0.0 section 11.1) unless the client named ``application/a2a+json``;
* CORE-SEND-003 (suite defect): the suite's own input gets ContentTypeNotSupportedError,
  which is what the requirement demands;
* DM-ART-001 / DM-MSG-001 (the suite's scripted subject): for the suite's message ids mesh
  answers with artifacts that carry ``artifactId`` and ``parts`` and messages with
  ``role``, ``parts`` and ``messageId`` (what the requirements say); only the canned
  contents the suite's own SUT writes differ.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from a2a.types import a2a_pb2 as pb

from tests.reliability.fake_stack import fake_stack
from tests.support.coord_helpers import request, sdk, send_all, serve

pytestmark = pytest.mark.anyio

REST = "/a2a"


def tck_message(prefix: str, parts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A message as the suite sends it (``tck_id(prefix)``: ``tck-PREFIX-SESSION``)."""
    return {"role": "ROLE_USER", "parts": parts or [{"text": "TCK artifact test"}],
            "messageId": f"tck-{prefix}-{uuid.uuid4().hex[:8]}"}


def media(r: Any) -> str:
    return str(r.headers.get("content-type", "")).split(";")[0].strip()


# ------------------------------------------------------------------ HTTP_JSON-SVC-001


async def test_rest_answers_are_application_json_for_a_client_that_sends_json(
    tmp_path: Path,
) -> None:
    # The suite's check, verbatim: `if "application/json" not in ct: errors.append(...)`,
    # on the answer to a message:send sent with Content-Type: application/json.
    async with fake_stack(tmp_path) as stack:
        c = stack.client
        r = await c.post(f"{REST}/message:send", json={"message": tck_message("rest-ct")},
                         headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        assert "application/json" in r.headers["content-type"], r.headers
        task_id = r.json()["task"]["id"]
        # GET / list / push configs without an Accept preference: the same label.
        got = await c.get(f"{REST}/tasks/{task_id}")
        listed = await c.get(f"{REST}/tasks")
        missing = await c.get(f"{REST}/tasks/no-such-task")
        assert got.status_code == 200 and media(got) == "application/json"
        assert listed.status_code == 200 and media(listed) == "application/json"
        assert missing.status_code == 404 and media(missing) == "application/json"
        # The body is the same JSON it always was.
        assert got.json()["id"] == task_id


async def test_rest_answers_keep_a2a_json_for_a_client_that_names_it(tmp_path: Path) -> None:
    async with fake_stack(tmp_path) as stack:
        c = stack.client
        body = json.dumps({"message": tck_message("rest-a2a-ct")}).encode()
        r = await c.post(f"{REST}/message:send", content=body,
                         headers={"content-type": "application/a2a+json"})
        assert r.status_code == 200 and media(r) == "application/a2a+json", r.headers
        task_id = r.json()["task"]["id"]
        got = await c.get(f"{REST}/tasks/{task_id}",
                          headers={"accept": "application/a2a+json, application/json"})
        assert got.status_code == 200 and media(got) == "application/a2a+json"
        # A stream stays an event stream either way; JSON-RPC stays application/json.
        async with c.stream("POST", f"{REST}/message:stream",
                            json={"message": tck_message("rest-stream")}) as s:
            assert s.status_code == 200 and media(s) == "text/event-stream"
            await s.aread()
        rpc = await c.post("/", json={"jsonrpc": "2.0", "id": 1, "method": "GetTask",
                                      "params": {"id": task_id}})
        assert media(rpc) == "application/json" and rpc.json()["result"]["id"] == task_id


async def test_the_official_sdk_rest_client_still_reads_every_answer(tmp_path: Path) -> None:
    # The a2a-sdk client posts with httpx's json= (application/json), so it now gets
    # application/json answers: a send, a stream and a get over a real uvicorn.
    with serve(tmp_path / "d") as served:
        for streaming in (False, True):
            async with sdk(served.url, rest=True, streaming=streaming) as client:
                events = await send_all(client, request("hello over HTTP+JSON"))
                ids = {e.task.id for e in events if e.HasField("task")} | {
                    e.status_update.task_id for e in events if e.HasField("status_update")}
                assert len(ids) == 1, events
                task_id = ids.pop()
                got = await client.get_task(pb.GetTaskRequest(id=task_id))
                assert got.id == task_id


# ------------------------------------------------------------------ CORE-SEND-003


async def test_the_suites_unsupported_media_input_is_content_type_not_supported(
    tmp_path: Path,
) -> None:
    # The requirement's sample_input, verbatim; its description: "A Media Type provided in
    # the request's message parts that is not supported by the agent MUST result in
    # ContentTypeNotSupportedError." (-32005 on JSON-RPC, 415 on HTTP+JSON.)
    parts = [{"raw": "dGNr", "mediaType": "application/x-unsupported-tck-type"}]
    async with fake_stack(tmp_path) as stack:
        c = stack.client
        rpc = await c.post("/", json={"jsonrpc": "2.0", "id": 1, "method": "SendMessage",
                                      "params": {"message": tck_message("send-003", parts)}})
        err = rpc.json()["error"]
        assert err["code"] == -32005, err
        assert "application/x-unsupported-tck-type" in err["message"]
        rest = await c.post(f"{REST}/message:send",
                            json={"message": tck_message("send-003", parts)})
        assert rest.status_code == 415, rest.text
        assert media(rest) == "application/json"


# ------------------------------------------------------------------ DM-ART-001 / DM-MSG-001


@pytest.mark.parametrize("prefix", ["artifact-text", "artifact-file", "artifact-file-url",
                                    "artifact-data", "message-response"])
async def test_the_suites_scripted_ids_get_well_formed_artifacts_and_messages(
    tmp_path: Path, prefix: str
) -> None:
    # DM-ART-001: "An Artifact object MUST contain required fields: artifactId and parts";
    # DM-MSG-001: "A Message object MUST contain required fields: role, parts, and
    # messageId"; DM-PART-001: exactly one of text, raw, url, data per part. mesh meets
    # these for the suite's message ids; the canned contents ("Generated text content",
    # output.txt, {"key": "value", "count": 42}, a Message reply) are what the suite's own
    # scripted SUT writes for those ids (scenarios/core_operations.feature).
    async with fake_stack(tmp_path) as stack:
        r = await stack.client.post("/", json={
            "jsonrpc": "2.0", "id": 1, "method": "SendMessage",
            "params": {"message": tck_message(prefix)}})
        task = r.json()["result"]["task"]
        assert task["status"]["state"] == "TASK_STATE_COMPLETED", task["status"]
        assert task["artifacts"]
        for art in task["artifacts"]:
            assert art["artifactId"] and art["parts"], art
            for part in art["parts"]:
                assert len({"text", "raw", "url", "data"} & set(part)) == 1, part
        messages = [*task.get("history", []), task["status"].get("message")]
        for msg in filter(None, messages):
            assert msg["role"] in ("ROLE_USER", "ROLE_AGENT") and msg["parts"], msg
            assert msg["messageId"], msg
