"""Request checks that run before the SDK sees a body, as a pure ASGI middleware.

Why: the SDK parses bodies with protobuf's lenient JSON parser (a string where an object
belongs, ``role: true`` and ``parts: ["x"]`` are silently reinterpreted), answers 500 to a
non-UTF-8 body on the HTTP+JSON routes and -32603 to JSON nested 10,000 deep, and enforces
no body size. This guard turns every client mistake into a clear 4xx / JSON-RPC error and
lets only well-formed requests through, untouched (the body is replayed as read).

Order of checks for a request with a body:

1. ``Content-Length`` above the limit: 413 before anything is read; otherwise the body is
   read up to the limit and 413 answered as soon as it would go past it.
2. JSON-RPC (``POST /``): UTF-8 and JSON (-32700, also for nesting past ``max_json_depth``),
   request object (-32600), known method (-32601), params shape (-32602).
3. HTTP+JSON (under ``rest_prefix``): content type (415), UTF-8 / JSON (400), shape (422),
   query parameters (400).
4. Sending a message while the gate's queue is full: 429 with ``Retry-After``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mesh.coordinator.config import CoordinatorConfig
from mesh.coordinator.peers import HOPS_KEY, hops_of
from mesh.coordinator.subtasks import SubtaskSpec, check_subtask_list
from mesh.gate.types import QueueCheck
from mesh.worker.simulated import check_scenario_bounds

__all__ = ["JSONRPC_METHODS", "RequestGuard", "check_json_depth"]

# 1.0 names -> params check; 0.3 names are accepted with a lighter check.
_SEND = ("SendMessage", "SendStreamingMessage", "message/send", "message/stream")
JSONRPC_METHODS: frozenset[str] = frozenset(
    {
        "SendMessage",
        "SendStreamingMessage",
        "GetTask",
        "ListTasks",
        "CancelTask",
        "SubscribeToTask",
        "CreateTaskPushNotificationConfig",
        "GetTaskPushNotificationConfig",
        "ListTaskPushNotificationConfigs",
        "DeleteTaskPushNotificationConfig",
        "GetExtendedAgentCard",
        # A2A 0.3 names (served by the SDK's compatibility adapter).
        "message/send",
        "message/stream",
        "tasks/get",
        "tasks/list",
        "tasks/cancel",
        "tasks/resubscribe",
        "tasks/pushNotificationConfig/set",
        "tasks/pushNotificationConfig/get",
        "tasks/pushNotificationConfig/list",
        "tasks/pushNotificationConfig/delete",
        "agent/getAuthenticatedExtendedCard",
    }
)
_ROLES = frozenset({"ROLE_USER", "ROLE_AGENT"})
_TASK_STATES = frozenset(
    {
        "TASK_STATE_SUBMITTED",
        "TASK_STATE_WORKING",
        "TASK_STATE_INPUT_REQUIRED",
        "TASK_STATE_COMPLETED",
        "TASK_STATE_CANCELED",
        "TASK_STATE_FAILED",
        "TASK_STATE_REJECTED",
        "TASK_STATE_AUTH_REQUIRED",
    }
)
_PART_KINDS = ("text", "raw", "url", "data")
#: The media types a message part may declare (the card's default input modes).
ACCEPTED_MEDIA_TYPES = ("text/plain", "application/json")


def _accepted_media(kind: str, media: str) -> bool:
    base = media.split(";", 1)[0].strip().lower()
    return base in ACCEPTED_MEDIA_TYPES or (kind == "text" and base.startswith("text/"))
_JSON_TYPES = ("application/json", "application/a2a+json")


class Invalid(Exception):
    """A client mistake; ``kind`` picks the error code, the message names the fix."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # parse | request | method | params | version


def check_json_depth(value: Any, max_depth: int) -> None:
    """Raise ``Invalid('parse')`` if ``value`` nests deeper than ``max_depth`` (iterative)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > max_depth:
                raise Invalid("parse", f"JSON nests deeper than {max_depth} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


def _parse_json(body: bytes, max_depth: int) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Invalid("parse", f"body is not valid UTF-8 (byte {e.start})") from None
    if not text.strip():
        raise Invalid("parse", "body is empty; send a JSON object")
    # Cheap pre-scan: brackets bound the nesting depth, so a shallow body skips the walk
    # and a hostile one is refused before json.loads recurses into it.
    if text.count("[") + text.count("{") > max_depth and _bracket_depth(text) > max_depth:
        raise Invalid("parse", f"JSON nests deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except RecursionError:
        raise Invalid("parse", f"JSON nests deeper than {max_depth} levels") from None
    except ValueError as e:
        raise Invalid("parse", f"body is not valid JSON: {e}") from None


def _bracket_depth(text: str) -> int:
    """Max nesting of [ and { outside JSON strings."""
    depth = best = 0
    for ch in _BRACKETS.sub("", _STRINGS.sub("", text)):
        if ch in "[{":
            depth += 1
            best = max(best, depth)
        else:
            depth -= 1
    return best


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[^\[\]{}]+")


# --------------------------------------------------------------------------- shape checks


def _get(obj: dict[str, Any], camel: str) -> Any:
    """A field by its JSON name or its proto name (protobuf accepts both)."""
    if camel in obj:
        return obj[camel]
    snake = re.sub(r"(?<!^)([A-Z])", r"_\1", camel).lower()
    return obj.get(snake)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _str(obj: dict[str, Any], key: str, at: str, *, required: bool = False) -> str | None:
    value = _get(obj, key)
    if value is None:
        if required:
            raise Invalid("params", f"{at}.{key} is required (a string)")
        return None
    if not isinstance(value, str):
        raise Invalid("params", f"{at}.{key} must be a string, got {_type_name(value)}")
    if required and not value:
        raise Invalid("params", f"{at}.{key} must not be empty")
    return value


def _int(obj: dict[str, Any], key: str, at: str, lo: int, hi: int | None = None) -> None:
    value = _get(obj, key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid("params", f"{at}.{key} must be an integer, got {_type_name(value)}")
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise Invalid("params", f"{at}.{key} must be {bound}, got {value}")


def _bool(obj: dict[str, Any], key: str, at: str) -> None:
    value = _get(obj, key)
    if value is not None and not isinstance(value, bool):
        raise Invalid("params", f"{at}.{key} must be true or false, got {_type_name(value)}")


def _obj(
    obj: dict[str, Any], key: str, at: str, *, required: bool = False
) -> dict[str, Any] | None:
    value = _get(obj, key)
    if value is None:
        if required:
            raise Invalid("params", f"{at}.{key} is required (an object)")
        return None
    if not isinstance(value, dict):
        raise Invalid("params", f"{at}.{key} must be an object, got {_type_name(value)}")
    return value


def _str_list(obj: dict[str, Any], key: str, at: str) -> None:
    value = _get(obj, key)
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise Invalid("params", f"{at}.{key} must be a list of strings")


class _Shapes:
    """Checks of A2A 1.0 request params (JSON-RPC params == HTTP+JSON bodies)."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config

    def message(self, msg: dict[str, Any], at: str) -> None:
        _str(msg, "messageId", at, required=True)
        role = _get(msg, "role")
        if not isinstance(role, str) or role not in _ROLES:
            raise Invalid("params", f"{at}.role must be \"ROLE_USER\" (or \"ROLE_AGENT\")")
        for key in ("contextId", "taskId"):
            _str(msg, key, at)
        meta = _obj(msg, "metadata", at)
        if meta is not None:
            hops, chain = hops_of(meta)
            if hops > self.config.max_hops:
                path = " -> ".join([*chain, self.config.name]) or "unknown"
                raise Invalid(
                    "params",
                    f"{at}.metadata.{HOPS_KEY} is {hops}, past this agent's limit of "
                    f"{self.config.max_hops} delegation hops (--max-hops); chain: {path}",
                )
        _str_list(msg, "extensions", at)
        _str_list(msg, "referenceTaskIds", at)
        parts = _get(msg, "parts")
        if not isinstance(parts, list) or not parts:
            raise Invalid("params", f"{at}.parts must be a non-empty list of part objects")
        if len(parts) > self.config.max_parts:
            raise Invalid(
                "params", f"{at}.parts has {len(parts)} parts; at most {self.config.max_parts}"
            )
        num_chars = 0
        has_content = False
        for i, part in enumerate(parts):
            pat = f"{at}.parts[{i}]"
            if not isinstance(part, dict):
                raise Invalid("params", f"{pat} must be an object like {{\"text\": \"...\"}}")
            kinds = [k for k in _PART_KINDS if k in part]
            if len(kinds) != 1:
                raise Invalid("params", f"{pat} must have exactly one of text, raw, url, data")
            kind = kinds[0]
            value = part[kind]
            if kind == "data":
                if isinstance(value, dict) and "subtasks" in value:
                    try:
                        specs = check_subtask_list(
                            value["subtasks"], self.config.max_subtasks, f"{pat}.data.subtasks"
                        )
                    except ValueError as e:
                        raise Invalid("params", str(e)) from None
                    self._scenarios(specs, f"{pat}.data.subtasks")
                    num_chars += sum(len(s.instructions) for s in specs)
                    has_content = True
                elif value is None:
                    raise Invalid("params", f"{pat}.data must not be null")
            elif not isinstance(value, str):
                raise Invalid("params", f"{pat}.{kind} must be a string, got {_type_name(value)}")
            elif kind == "text":
                num_chars += len(value)
                has_content = has_content or bool(value.strip())
            for key in ("filename", "mediaType"):
                _str(part, key, pat)
            media = _get(part, "mediaType")
            if media and not _accepted_media(kind, media):
                raise Invalid(
                    "content_type",
                    f"{pat}.mediaType {media!r} is not accepted; this agent takes "
                    f"{', '.join(ACCEPTED_MEDIA_TYPES)} (and text/* in text parts)",
                )
            _obj(part, "metadata", pat)
        if num_chars > self.config.max_message_chars:
            raise Invalid(
                "params",
                f"{at} carries {num_chars} characters; at most {self.config.max_message_chars}",
            )
        if not has_content:
            raise Invalid("params", f"{at} has no text and no subtasks; send a text part")

    def _scenarios(self, specs: list[SubtaskSpec], at: str) -> None:
        """Scenario params: refused unless simulation is on, and bounded when it is."""
        for i, spec in enumerate(specs):
            if not spec.params.get("scenario"):
                continue
            if not self.config.simulation:
                raise Invalid(
                    "params",
                    f"{at}[{i}].params.scenario: scenario params are off on this server; "
                    "start it with `mesh serve --simulation` (or use `mesh simulate`)",
                )
            try:
                check_scenario_bounds(spec.params)
            except ValueError as e:
                raise Invalid("params", f"{at}[{i}].params: {e}") from None

    def send(self, params: dict[str, Any], at: str = "params") -> None:
        msg = _obj(params, "message", at, required=True)
        assert msg is not None
        self.message(msg, f"{at}.message")
        _obj(params, "metadata", at)
        _str(params, "tenant", at)
        conf = _obj(params, "configuration", at)
        if conf is not None:
            cat = f"{at}.configuration"
            _str_list(conf, "acceptedOutputModes", cat)
            _int(conf, "historyLength", cat, 0)
            _bool(conf, "returnImmediately", cat)
            push = _obj(conf, "taskPushNotificationConfig", cat)
            if push is not None:
                self.push_config(push, f"{cat}.taskPushNotificationConfig", need_task=False)

    def push_config(self, cfg: dict[str, Any], at: str, *, need_task: bool) -> None:
        _str(cfg, "url", at, required=True)
        _str(cfg, "taskId", at, required=need_task)
        for key in ("id", "token", "tenant"):
            _str(cfg, key, at)
        auth = _obj(cfg, "authentication", at)
        if auth is not None:
            _str(auth, "scheme", f"{at}.authentication", required=True)
            _str(auth, "credentials", f"{at}.authentication")

    def list_tasks(self, params: dict[str, Any], at: str) -> None:
        _str(params, "contextId", at)
        _str(params, "pageToken", at)
        _str(params, "tenant", at)
        _str(params, "statusTimestampAfter", at)
        _int(params, "pageSize", at, 1, 100)
        _int(params, "historyLength", at, 0)
        _bool(params, "includeArtifacts", at)
        status = _get(params, "status")
        if status is not None and status not in _TASK_STATES:
            raise Invalid("params", f"{at}.status must be one of {sorted(_TASK_STATES)}")

    def jsonrpc_params(self, method: str, params: dict[str, Any]) -> None:
        at = "params"
        if method in ("SendMessage", "SendStreamingMessage"):
            self.send(params)
        elif method in ("GetTask", "CancelTask", "SubscribeToTask"):
            _str(params, "id", at, required=True)
            _int(params, "historyLength", at, 0)
        elif method == "ListTasks":
            self.list_tasks(params, at)
        elif method == "CreateTaskPushNotificationConfig":
            self.push_config(params, at, need_task=True)
        elif method in ("GetTaskPushNotificationConfig", "DeleteTaskPushNotificationConfig"):
            _str(params, "taskId", at, required=True)
            _str(params, "id", at, required=True)
        elif method == "ListTaskPushNotificationConfigs":
            _str(params, "taskId", at, required=True)
            _int(params, "pageSize", at, 1, 100)
        elif method in ("message/send", "message/stream"):
            msg = _obj(params, "message", at, required=True)
            assert msg is not None
            parts = msg.get("parts")
            if not isinstance(parts, list) or not parts or not all(
                isinstance(p, dict) for p in parts
            ):
                raise Invalid("params", "params.message.parts must be a non-empty list of objects")
            if len(parts) > self.config.max_parts:
                raise Invalid("params", f"params.message.parts: at most {self.config.max_parts}")
        elif method in ("tasks/get", "tasks/cancel", "tasks/resubscribe"):
            _str(params, "id", at, required=True)


# --------------------------------------------------------------------------- middleware


class RequestGuard:
    """See the module docstring. ``check_queue`` is the gate's pure queue check."""

    def __init__(
        self,
        app: ASGIApp,
        config: CoordinatorConfig,
        check_queue: Callable[[], QueueCheck] | None = None,
        jsonrpc_path: str = "/",
    ) -> None:
        self.app = app
        self.config = config
        self.check_queue = check_queue
        self.jsonrpc_path = jsonrpc_path
        self.shapes = _Shapes(config)
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
                bad = _rest_error(400, "INVALID_ARGUMENT", "Content-Length is not a number")
                await _send_json(send, 400, bad)
                return
            if too_big:
                await self._too_large(send, surface)
                return
        has_body = (declared not in (None, "0")) or "chunked" in headers.get(
            "transfer-encoding", ""
        )
        body = b""
        if has_body:
            read = await _read_body(receive, limit)
            if read is None:
                await self._too_large(send, surface)
                return
            body = read

        try:
            if surface == "jsonrpc":
                await self._check_jsonrpc(body, send, headers.get("a2a-version", ""),
                                          headers.get("content-type", ""))
            elif rest_match is not None:
                await self._check_rest(method, rest_match.group("rest"), headers, body, scope)
        except _Answered:
            return
        except _RestInvalid as e:
            await _send_json(send, e.status, _rest_error(e.status, e.grpc_status, str(e)))
            return
        except _Busy as e:
            await self._busy(send, surface, e.check, e.request_id)
            return

        await self.app(scope, _replay(body, receive) if has_body else receive, send)

    # ---- JSON-RPC

    async def _check_jsonrpc(self, body: bytes, send: Send, version: str,
                             content_type: str = "") -> None:
        request_id: Any = None
        try:
            ctype = content_type.split(";")[0].strip().lower()
            if ctype and ctype not in _JSON_TYPES:  # checked before the body is read as JSON
                raise Invalid("content_type", f"Content-Type must be application/json, got "
                              f"{ctype}; send the request with Content-Type: application/json")
            try:
                doc = _parse_json(body, self.config.max_json_depth)
            except Invalid as e:
                raise Invalid("parse", str(e)) from None
            if isinstance(doc, list):
                raise Invalid("request", "batch requests are not supported; send one object")
            if not isinstance(doc, dict):
                raise Invalid("request", "a JSON-RPC request must be a JSON object")
            rid = doc.get("id")
            if rid is None or (isinstance(rid, str | int) and not isinstance(rid, bool)):
                request_id = rid
            else:
                raise Invalid("request", "id must be a string, an integer or null")
            if doc.get("jsonrpc") != "2.0":
                raise Invalid("request", "'jsonrpc' must be exactly \"2.0\"")
            method = doc.get("method")
            if not isinstance(method, str) or not method:
                raise Invalid("request", "'method' must be a non-empty string")
            if method not in JSONRPC_METHODS:
                raise Invalid(
                    "method",
                    f"method {method!r} not found; A2A 1.0 methods: "
                    + ", ".join(sorted(m for m in JSONRPC_METHODS if "/" not in m)),
                )
            if "/" in method and not _is_v0_3(version):
                # The SDK's 0.3 adapter answers this with -32603 (internal error).
                raise Invalid(
                    "version",
                    f"method {method!r} is an A2A 0.3 name but the request says "
                    f"A2A-Version: {version}; use the 1.0 method names, or send "
                    "A2A-Version: 0.3",
                )
            params = doc.get("params", {})
            if not isinstance(params, dict):
                raise Invalid("params", "params must be an object")
            self.shapes.jsonrpc_params(method, params)
        except Invalid as e:
            code = {"parse": -32700, "request": -32600, "method": -32601, "params": -32602,
                    "version": -32009,  # A2A's VersionNotSupportedError
                    "content_type": -32005}  # A2A's ContentTypeNotSupportedError
            await _send_json(
                send,
                200,
                {
                    "jsonrpc": "2.0",
                    "id": request_id,
                    "error": {"code": code[e.kind], "message": str(e)},
                },
            )
            raise _Answered from None
        if method in _SEND:
            self._check_capacity(request_id)

    # ---- HTTP+JSON

    async def _check_rest(
        self, method: str, rest: str, headers: dict[str, str], body: bytes, scope: Scope
    ) -> None:
        legacy = rest.startswith("/v1/")
        op = rest[3:] if legacy else rest
        if method == "POST" and (
            op in ("/message:send", "/message:stream") or op.endswith("/pushNotificationConfigs")
        ):
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype not in _JSON_TYPES:
                raise _RestInvalid(
                    415,
                    "INVALID_ARGUMENT",
                    f"Content-Type must be application/json, got {ctype or 'none'}",
                )
            doc = self._rest_doc(body)
            if not legacy:
                try:
                    if op.startswith("/message:"):
                        self.shapes.send(doc, "body")
                    else:
                        self.shapes.push_config(doc, "body", need_task=False)
                except Invalid as e:
                    if e.kind == "content_type":  # A2A's ContentTypeNotSupportedError
                        raise _RestInvalid(415, "INVALID_ARGUMENT", str(e)) from None
                    raise _RestInvalid(422, "INVALID_ARGUMENT", str(e)) from None
            if op.startswith("/message:"):
                self._check_capacity(None)
        elif method == "POST" and body:
            self._rest_doc(body)
        elif method == "GET" and not legacy:
            query = _query(scope)
            try:
                if op == "/tasks":
                    self.shapes.list_tasks(query, "query")
                elif op.startswith("/tasks/"):
                    _int(query, "historyLength", "query", 0)
                    _int(query, "pageSize", "query", 1, 100)
            except Invalid as e:
                raise _RestInvalid(400, "INVALID_ARGUMENT", str(e)) from None

    def _rest_doc(self, body: bytes) -> dict[str, Any]:
        try:
            doc = _parse_json(body, self.config.max_json_depth)
        except Invalid as e:
            raise _RestInvalid(400, "INVALID_ARGUMENT", str(e)) from None
        if not isinstance(doc, dict):
            raise _RestInvalid(400, "INVALID_ARGUMENT", "body must be a JSON object")
        return doc

    # ---- capacity / size answers

    def _check_capacity(self, request_id: Any) -> None:
        if self.check_queue is None:
            return
        check = self.check_queue()
        if not check.ok:
            raise _Busy(check, request_id)

    async def _busy(self, send: Send, surface: str, check: QueueCheck, request_id: Any) -> None:
        retry = max(1, math.ceil(check.retry_after_s))
        text = (
            f"over capacity: the gate's queue is full ({check.queue_len} waiting"
            + (f"; {check.reason}" if check.reason else "")
            + f"); retry after {retry} s"
        )
        if surface == "jsonrpc":
            payload: dict[str, Any] = {
                "jsonrpc": "2.0",
                "id": request_id,
                "error": {"code": -32000, "message": text, "data": {"retryAfter": retry}},
            }
        else:
            payload = _rest_error(429, "RESOURCE_EXHAUSTED", text)
        await _send_json(send, 429, payload, [(b"retry-after", str(retry).encode("ascii"))])

    async def _too_large(self, send: Send, surface: str) -> None:
        text = (
            f"request body exceeds {self.config.max_body_bytes} bytes; "
            "send less (split the work into subtasks or raise max_body_bytes)"
        )
        if surface == "jsonrpc":
            payload: dict[str, Any] = {
                "jsonrpc": "2.0",
                "id": None,
                "error": {"code": -32600, "message": text},
            }
        else:
            payload = _rest_error(413, "INVALID_ARGUMENT", text)
        await _send_json(send, 413, payload, [(b"connection", b"close")])


class _Answered(Exception):
    """The guard already sent the response."""


class _RestInvalid(Exception):
    def __init__(self, status: int, grpc_status: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.grpc_status = grpc_status


class _Busy(Exception):
    def __init__(self, check: QueueCheck, request_id: Any) -> None:
        super().__init__(check.reason)
        self.check = check
        self.request_id = request_id


def _is_v0_3(version: str) -> bool:
    """Whether the SDK's 0.3 adapter accepts an ``A2A-Version`` header (none means 0.3)."""
    text = version.strip()
    if not text:
        return True
    major = text.split(".")[0]
    return major.isdigit() and int(major) == 0


def _rest_error(status: int, grpc_status: str, message: str) -> dict[str, Any]:
    """The SDK's HTTP+JSON error shape (``{"error": {code, status, message}}``)."""
    return {"error": {"code": status, "status": grpc_status, "message": message}}


def _query(scope: Scope) -> dict[str, Any]:
    from urllib.parse import parse_qsl

    out: dict[str, Any] = {}
    raw = scope.get("query_string", b"").decode("latin-1")
    for key, value in parse_qsl(raw, keep_blank_values=True):
        if key in ("pageSize", "page_size", "historyLength", "history_length"):
            try:
                out[key] = int(value)
            except ValueError:
                out[key] = value
        elif key in ("includeArtifacts", "include_artifacts"):
            out[key] = {"true": True, "false": False}.get(value.lower(), value)
        else:
            out[key] = value
    return out


async def _read_body(receive: Receive, limit: int) -> bytes | None:
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


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls wait for the disconnect, as usual

    return replay


async def _send_json(
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
