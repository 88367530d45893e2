"""ASGI plumbing of the guard: read a body up to a limit, replay it, answer with JSON, and
label HTTP+JSON answers with the media type the client speaks."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Message, Receive, Send

__all__ = ["A2A_JSON", "names_a2a_json", "read_body", "relabel_a2a_json", "replay_body",
           "send_json"]

A2A_JSON = "application/a2a+json"


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None as soon as it passes ``limit`` bytes (rest left unread)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay_body(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls wait for the disconnect, as usual

    return replay


async def send_json(
    send: Send,
    status: int,
    payload: dict[str, Any],
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = json.dumps(payload).encode("utf-8")
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode("ascii")),
        *(extra_headers or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def names_a2a_json(headers: dict[str, str]) -> bool:
    """Whether the client named ``application/a2a+json`` (its request's Content-Type, or
    its Accept header)."""
    return any(A2A_JSON in headers.get(name, "").lower() for name in ("content-type", "accept"))


def relabel_a2a_json(send: Send) -> Send:
    """``send`` with an ``application/a2a+json`` response Content-Type written as
    ``application/json`` (the body is untouched: the same JSON either way).

    Why: the SDK labels every HTTP+JSON answer ``application/a2a+json`` (what A2A 1.0.1
    recommends, a SHOULD), while A2A 1.0.0 section 11.1 reads "Content-Type:
    application/json for requests and responses". The guard uses this for clients that did
    not name ``application/a2a+json`` (:func:`names_a2a_json`), so each client gets the
    type it speaks; SSE streams (``text/event-stream``) and other types pass as they are.
    """

    async def relabelled(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [
                (k, b"application/json" if k.lower() == b"content-type"
                 and v.split(b";")[0].strip().lower() == A2A_JSON.encode() else v)
                for k, v in message.get("headers", [])
            ]
            message = {**message, "headers": headers}
        await send(message)

    return relabelled
