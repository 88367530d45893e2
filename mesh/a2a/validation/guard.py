"""Request checks that run before the SDK sees a body, as a pure ASGI middleware.

Why: the SDK parses bodies with protobuf's lenient JSON parser (a string where an object
belongs, ``role: true`` and ``parts: ["x"]`` are silently reinterpreted), answers 500 to a
non-UTF-8 body on the HTTP+JSON routes and -32603 to JSON nested 10,000 deep, and enforces
no body size. This guard turns every client mistake into a clear 4xx / JSON-RPC error and
lets only well-formed requests through, untouched (the body is replayed as read).

Order of checks for a request with a body:

1. ``Content-Length`` above the limit: 413 before anything is read; otherwise the body is
   read up to the limit and 413 answered as soon as it would go past it.
2. JSON-RPC (``POST /``, :mod:`.jsonrpc`): UTF-8 and JSON (-32700, also for nesting past
   ``max_json_depth``), request object (-32600), known method (-32601), params shape
   (-32602, :mod:`.shapes`).
3. HTTP+JSON (under ``rest_prefix``, :mod:`.rest`): content type (415), UTF-8 / JSON (400),
   shape (422), query parameters (400).
4. Sending a message whose places (one per listed subtask, else one) do not all fit the
   gate's queue, or the caller's share of it: 429 with ``Retry-After``.

HTTP+JSON answers are labelled ``application/json`` (A2A 1.0.0 section 11.1) unless the
client named ``application/a2a+json`` in its Content-Type or Accept header: then they keep
the SDK's ``application/a2a+json`` (see :func:`.asgi.relabel_a2a_json`).

A message that passes is left on the scope as it was checked (:mod:`.checked`: its
subtask list, text and hops), for the executor: nothing is parsed twice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from mesh.a2a.config import CoordinatorConfig
from mesh.a2a.validation.asgi import (
    names_a2a_json,
    read_body,
    relabel_a2a_json,
    replay_body,
    send_json,
)
from mesh.a2a.validation.checked import put_checked
from mesh.a2a.validation.jsonrpc import RpcRefused, check_jsonrpc, rpc_error
from mesh.a2a.validation.rest import RestInvalid, check_rest, rest_error
from mesh.a2a.validation.shapes import SEND_METHODS, Shapes
from mesh.gate.queue import QueueCheck

__all__ = ["RequestGuard"]


class RequestGuard:
    """See the module docstring. ``check_queue`` is the gate's pure queue check
    (:meth:`~mesh.gate.queue.Admission.check_queue`), asked for the request's places and
    its caller (``scope["user"]``, set by the auth middleware in front of this one)."""

    def __init__(
        self,
        app: ASGIApp,
        config: CoordinatorConfig,
        check_queue: Callable[..., QueueCheck] | None = None,
        jsonrpc_path: str = "/",
    ) -> None:
        self.app = app
        self.config = config
        self.check_queue = check_queue
        self.jsonrpc_path = jsonrpc_path
        self.shapes = Shapes(config)
        prefix = re.escape(config.rest_prefix)
        # Optional tenant segment before the prefix, as the SDK mounts it.
        self._rest = re.compile(rf"^(?:/[^/]+)?{prefix}(?P<rest>/.*)$")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        path: str = scope["path"]
        method: str = scope["method"]
        is_jsonrpc = path == self.jsonrpc_path and method == "POST"
        rest_match = self._rest.match(path)
        surface = "jsonrpc" if is_jsonrpc else ("rest" if rest_match else "other")

        limit = self.config.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None:
            try:
                too_big = int(declared) > limit
            except ValueError:
                bad = rest_error(400, "INVALID_ARGUMENT", "Content-Length is not a number")
                await send_json(send, 400, bad)
                return
            if too_big:
                await self._too_large(send, surface)
                return
        has_body = (declared not in (None, "0")) or "chunked" in headers.get(
            "transfer-encoding", ""
        )
        body = b""
        if has_body:
            read = await read_body(receive, limit)
            if read is None:
                await self._too_large(send, surface)
                return
            body = read

        try:
            if surface == "jsonrpc":
                rpc_method, request_id, checked = check_jsonrpc(
                    body, version=headers.get("a2a-version", ""),
                    content_type=headers.get("content-type", ""), shapes=self.shapes,
                    max_depth=self.config.max_json_depth)
                if rpc_method in SEND_METHODS and checked is not None:
                    self._check_capacity(request_id, checked.places, scope)
                    put_checked(scope, checked)
            elif rest_match is not None:
                checked = check_rest(method, rest_match.group("rest"), headers, body, scope,
                                     self.shapes, self.config.max_json_depth)
                if checked is not None:
                    self._check_capacity(None, checked.places, scope)
                    put_checked(scope, checked)
        except RpcRefused as e:
            await send_json(send, 200, e.payload)
            return
        except RestInvalid as e:
            await send_json(send, e.status, rest_error(e.status, e.grpc_status, str(e)))
            return
        except _Busy as e:
            await self._busy(send, surface, e.check, e.request_id)
            return

        if surface == "rest" and not names_a2a_json(headers):
            send = relabel_a2a_json(send)  # A2A 1.0.0 section 11.1: application/json
        await self.app(scope, replay_body(body, receive) if has_body else receive, send)

    # ---- capacity / size answers

    def _check_capacity(self, request_id: Any, places: int, scope: Scope) -> None:
        if self.check_queue is None:
            return
        user = scope.get("user")
        caller = str(getattr(user, "username", "") or "")
        check = self.check_queue(places=places, caller=caller)
        if not check.ok:
            raise _Busy(check, request_id)

    async def _busy(self, send: Send, surface: str, check: QueueCheck, request_id: Any) -> None:
        retry = max(1, math.ceil(check.retry_after_s))
        text = (
            f"over capacity: the gate's queue cannot take this request ({check.queue_len} "
            "waiting" + (f"; {check.reason}" if check.reason else "")
            + f"); retry after {retry} s"
        )
        if surface == "jsonrpc":
            payload = rpc_error(request_id, -32000, text, {"retryAfter": retry})
        else:
            payload = rest_error(429, "RESOURCE_EXHAUSTED", text)
        await send_json(send, 429, payload, [(b"retry-after", str(retry).encode("ascii"))])

    async def _too_large(self, send: Send, surface: str) -> None:
        text = (
            f"request body exceeds {self.config.max_body_bytes} bytes; "
            "send less (split the work into subtasks), or start the server with a larger "
            "`mesh serve --max-body-bytes N`"
        )
        if surface == "jsonrpc":
            payload = rpc_error(None, -32600, text)
        else:
            payload = rest_error(413, "INVALID_ARGUMENT", text)
        await send_json(send, 413, payload, [(b"connection", b"close")])


class _Busy(Exception):
    """The gate's queue is full: answered 429 on the request's surface."""

    def __init__(self, check: QueueCheck, request_id: Any) -> None:
        super().__init__(check.reason)
        self.check = check
        self.request_id = request_id
