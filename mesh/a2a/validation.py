"""Request checks that run before the SDK sees a body, as a pure ASGI middleware
(:class:`RequestGuard`); the order of checks and their answers are in docs/security.md
("At the door").

Why: the SDK parses bodies with protobuf's lenient JSON parser (``role: true`` and
``parts: ["x"]`` are silently reinterpreted), answers 500 to a non-UTF-8 body on the HTTP+JSON
routes and -32603 to JSON nested 10,000 deep, and enforces no body size. The guard turns every
client mistake into a clear 4xx / JSON-RPC error and lets only well-formed requests through,
untouched (the body is replayed as read). A checked send's :class:`CheckedMessage` (subtask
list, text, hops: parsed once, at the door) rides on the ASGI scope to the executor
(:class:`CheckedContextBuilder`, :func:`checked_message`); a send whose places do not fit the
gate's queue, or the caller's share of it, is 429 with ``Retry-After``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qsl

from a2a.server.context import ServerCallContext
from a2a.server.routes import DefaultServerCallContextBuilder
from a2a.types import a2a_pb2 as pb
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mesh.a2a.config import CoordinatorConfig
from mesh.agent.plans import SubtaskSpec, check_subtask_list
from mesh.fleet.peers import HOPS_KEY, hops_of
from mesh.gate.queue import QueueCheck
from mesh.worker.simulated import check_scenario_bounds
from mesh.worker.types import NO_HOPS, Hops

__all__ = [
    "JSONRPC_METHODS", "CheckedContextBuilder", "CheckedMessage", "Invalid", "RequestGuard",
    "Shapes", "check_jsonrpc", "check_rest", "checked_message", "rest_error", "send_json",
]

T = TypeVar("T")


# -------------------- fields --------------------------------------------------

class Invalid(Exception):
    """A client mistake; ``kind`` picks the error code, the message names the fix."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # parse | request | method | params | version | content_type


def parse_json(body: bytes, max_depth: int) -> Any:
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


def field(obj: dict[str, Any], camel: str) -> Any:
    """A field by its JSON name or its proto name (protobuf accepts both)."""
    if camel in obj:
        return obj[camel]
    snake = re.sub(r"(?<!^)([A-Z])", r"_\1", camel).lower()
    return obj.get(snake)


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _typed(obj: dict[str, Any], key: str, at: str, noun: str, kind: type[T],
           *, required: bool = False) -> T | None:
    """The field ``key`` if it is a ``kind`` (None when absent and not ``required``)."""
    value = field(obj, key)
    if value is None:
        if required:
            raise Invalid("params", f"{at}.{key} is required ({noun})")
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise Invalid("params", f"{at}.{key} must be {noun}, got {type_name(value)}")
    return value


def string(obj: dict[str, Any], key: str, at: str, *, required: bool = False) -> str | None:
    value = _typed(obj, key, at, "a string", str, required=required)
    if required and not value:
        raise Invalid("params", f"{at}.{key} must not be empty")
    return value


def integer(obj: dict[str, Any], key: str, at: str, lo: int, hi: int | None = None) -> None:
    value = _typed(obj, key, at, "an integer", int)
    if value is not None and (value < lo or (hi is not None and value > hi)):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise Invalid("params", f"{at}.{key} must be {bound}, got {value}")


def boolean(obj: dict[str, Any], key: str, at: str) -> None:
    _typed(obj, key, at, "true or false", bool)


def obj(obj: dict[str, Any], key: str, at: str, *, required: bool = False) -> dict[str, Any] | None:
    return _typed(obj, key, at, "an object", dict, required=required)


def str_list(obj: dict[str, Any], key: str, at: str) -> None:
    value = field(obj, key)
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise Invalid("params", f"{at}.{key} must be a list of strings")

# -------------------- checked messages ----------------------------------------

_KEY = "mesh.checked_message"  # on the ASGI scope and in the call context's state


@dataclass(frozen=True)
class CheckedMessage:
    """A sent message as the door checked it. ``subtasks``: its explicit subtask list (None:
    its text is planned or run as one subtask); ``text``: with a list, its text parts (the
    subtasks' shared context), else its text and other data parts (as JSON) in part order;
    ``hops``: how far it was delegated; ``places``: the gate's queue places it asks for."""

    text: str
    subtasks: tuple[SubtaskSpec, ...] | None = None
    hops: Hops = NO_HOPS

    @classmethod
    def of_parts(cls, pieces: list[tuple[str, Any]], subtasks: list[SubtaskSpec] | None,
                 hops: Hops) -> CheckedMessage:
        """From the message's ``pieces`` in part order: ``("text", str)`` or ``("data",
        value)`` (a data part that is not the subtask list)."""
        if subtasks is not None:
            lines = [v for k, v in pieces if k == "text" and v.strip()]
            return cls("\n".join(lines), tuple(subtasks), hops)
        lines = [v if k == "text" else json.dumps(v, sort_keys=True) for k, v in pieces
                 if k != "text" or v.strip()]
        return cls("\n".join(lines).strip(), None, hops)

    @property
    def places(self) -> int:
        return len(self.subtasks) if self.subtasks else 1


def checked_message(context: ServerCallContext | None) -> CheckedMessage | None:
    """What the guard checked of the message this call sends (None: it did not run)."""
    if context is None:
        return None
    checked = context.state.get(_KEY)
    return checked if isinstance(checked, CheckedMessage) else None


class CheckedContextBuilder(DefaultServerCallContextBuilder):
    """The SDK's call context, plus the :class:`CheckedMessage` the guard left on the
    scope. Give it to ``create_jsonrpc_routes`` and ``create_rest_routes``
    (``context_builder=``); the 0.3 adapters wrap it."""

    def build(self, request: Request) -> ServerCallContext:
        context = super().build(request)
        checked = request.scope.get(_KEY)
        if checked is not None:
            context.state[_KEY] = checked
        return context

# -------------------- asgi bodies ---------------------------------------------

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


async def send_json(send: Send, status: int, payload: dict[str, Any],
                    extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer ``payload`` as JSON with ``status`` (and ``extra_headers``)."""
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
    ``application/json``, body untouched: the SDK labels HTTP+JSON answers the A2A 1.0.1 way,
    A2A 1.0.0 section 11.1 says ``application/json``; clients that did not name
    ``application/a2a+json`` get that. SSE streams and other types pass as they are."""

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

# -------------------- shapes --------------------------------------------------

# 1.0 names -> params check; 0.3 names are accepted with a lighter check.
JSONRPC_METHODS: frozenset[str] = frozenset({
    "SendMessage", "SendStreamingMessage", "GetTask", "ListTasks", "CancelTask",
    "SubscribeToTask", "CreateTaskPushNotificationConfig", "GetTaskPushNotificationConfig",
    "ListTaskPushNotificationConfigs", "DeleteTaskPushNotificationConfig",
    "GetExtendedAgentCard",
    # A2A 0.3 names (served by the SDK's compatibility adapter).
    "message/send", "message/stream", "tasks/get", "tasks/list", "tasks/cancel",
    "tasks/resubscribe", "tasks/pushNotificationConfig/set", "tasks/pushNotificationConfig/get",
    "tasks/pushNotificationConfig/list", "tasks/pushNotificationConfig/delete",
    "agent/getAuthenticatedExtendedCard",
})
_ROLES = frozenset({"ROLE_USER", "ROLE_AGENT"})
_TASK_STATES = frozenset(pb.TaskState.keys()) - {"TASK_STATE_UNSPECIFIED"}
_PART_KINDS = ("text", "raw", "url", "data")
#: The media types a message part may declare (the card's default input modes).
ACCEPTED_MEDIA_TYPES = ("text/plain", "application/json")


def accepted_media(kind: str, media: str) -> bool:
    base = media.split(";", 1)[0].strip().lower()
    return base in ACCEPTED_MEDIA_TYPES or (kind == "text" and base.startswith("text/"))


class Shapes:
    """Checks of A2A 1.0 request params (JSON-RPC params == HTTP+JSON bodies)."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config

    def hops(self, meta: dict[str, Any] | None, at: str) -> Hops:
        """The hops ``meta`` (a message's metadata) says, refused past ``--max-hops``."""
        hops = hops_of(meta)
        if hops.count > self.config.max_hops:
            path = " -> ".join([*hops.chain, self.config.name]) or "unknown"
            raise Invalid("params", f"{at}.metadata.{HOPS_KEY} is {hops.count}, past this "
                          f"agent's limit of {self.config.max_hops} delegation hops "
                          f"(--max-hops); chain: {path}")
        return hops

    def subtask_list(self, value: Any, at: str) -> list[SubtaskSpec]:
        """A ``subtasks`` list, checked; scenario params are refused unless simulation is on,
        and bounded when it is."""
        try:
            specs = check_subtask_list(value, self.config.max_subtasks, at)
        except ValueError as e:
            raise Invalid("params", str(e)) from None
        for i, spec in enumerate(specs):
            if not spec.params.get("scenario"):
                continue
            if not self.config.simulation:
                raise Invalid("params", f"{at}[{i}].params.scenario: scenario params are off "
                              "on this server; start it with `mesh serve --simulation` (or use "
                              "`mesh simulate`)")
            try:
                check_scenario_bounds(spec.params)
            except ValueError as e:
                raise Invalid("params", f"{at}[{i}].params: {e}") from None
        return specs

    def message(self, msg: dict[str, Any], at: str) -> CheckedMessage:
        """Check a message; returns what the task needs of it (its subtask list, text,
        hops and queue places)."""
        string(msg, "messageId", at, required=True)
        role = field(msg, "role")
        if not isinstance(role, str) or role not in _ROLES:
            raise Invalid("params", f"{at}.role must be \"ROLE_USER\" (or \"ROLE_AGENT\")")
        for key in ("contextId", "taskId"):
            string(msg, key, at)
        hops = self.hops(obj(msg, "metadata", at), at)
        str_list(msg, "extensions", at)
        str_list(msg, "referenceTaskIds", at)
        parts = field(msg, "parts")
        if not isinstance(parts, list) or not parts:
            raise Invalid("params", f"{at}.parts must be a non-empty list of part objects")
        if len(parts) > self.config.max_parts:
            raise Invalid("params",
                          f"{at}.parts has {len(parts)} parts; at most {self.config.max_parts}")
        num_chars = 0
        has_content = False
        specs: list[SubtaskSpec] | None = None
        pieces: list[tuple[str, Any]] = []  # text and other data parts, in part order
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
                    if specs is not None:
                        raise Invalid("params", f"{pat}: only one data part may list subtasks")
                    specs = self.subtask_list(value["subtasks"], f"{pat}.data.subtasks")
                    num_chars += sum(len(s.instructions) for s in specs)
                    has_content = True
                elif value is None:
                    raise Invalid("params", f"{pat}.data must not be null")
                else:
                    pieces.append(("data", value))
            elif not isinstance(value, str):
                raise Invalid("params", f"{pat}.{kind} must be a string, got {type_name(value)}")
            elif kind == "text":
                num_chars += len(value)
                has_content = has_content or bool(value.strip())
                pieces.append(("text", value))
            for key in ("filename", "mediaType"):
                string(part, key, pat)
            media = field(part, "mediaType")
            if media and not accepted_media(kind, media):
                raise Invalid("content_type", f"{pat}.mediaType {media!r} is not accepted; this "
                              f"agent takes {', '.join(ACCEPTED_MEDIA_TYPES)} (and text/* in "
                              "text parts)")
            obj(part, "metadata", pat)
        if num_chars > self.config.max_message_chars:
            raise Invalid("params", f"{at} carries {num_chars} characters; at most "
                          f"{self.config.max_message_chars}")
        if not has_content:
            raise Invalid("params", f"{at} has no text and no subtasks; send a text part")
        return CheckedMessage.of_parts(pieces, specs, hops)

    def send(self, params: dict[str, Any], at: str = "params") -> CheckedMessage:
        """Check SendMessage params; returns the message as checked."""
        msg = obj(params, "message", at, required=True)
        assert msg is not None
        checked = self.message(msg, f"{at}.message")
        obj(params, "metadata", at)
        string(params, "tenant", at)
        conf = obj(params, "configuration", at)
        if conf is not None:
            cat = f"{at}.configuration"
            str_list(conf, "acceptedOutputModes", cat)
            integer(conf, "historyLength", cat, 0)
            boolean(conf, "returnImmediately", cat)
            push = obj(conf, "taskPushNotificationConfig", cat)
            if push is not None:
                self.push_config(push, f"{cat}.taskPushNotificationConfig", need_task=False)
        return checked

    def push_config(self, cfg: dict[str, Any], at: str, *, need_task: bool) -> None:
        string(cfg, "url", at, required=True)
        string(cfg, "taskId", at, required=need_task)
        for key in ("id", "token", "tenant"):
            string(cfg, key, at)
        auth = obj(cfg, "authentication", at)
        if auth is not None:
            string(auth, "scheme", f"{at}.authentication", required=True)
            string(auth, "credentials", f"{at}.authentication")

    def list_tasks(self, params: dict[str, Any], at: str) -> None:
        for key in ("contextId", "pageToken", "tenant", "statusTimestampAfter"):
            string(params, key, at)
        integer(params, "pageSize", at, 1, 100)
        integer(params, "historyLength", at, 0)
        boolean(params, "includeArtifacts", at)
        status = field(params, "status")
        if status is not None and status not in _TASK_STATES:
            raise Invalid("params", f"{at}.status must be one of {sorted(_TASK_STATES)}")

    def jsonrpc_params(self, method: str, params: dict[str, Any]) -> CheckedMessage | None:
        """Check a method's params; returns the message a send sends (else None)."""
        at = "params"
        if method in ("SendMessage", "SendStreamingMessage"):
            return self.send(params)
        elif method in ("GetTask", "CancelTask", "SubscribeToTask"):
            string(params, "id", at, required=True)
            integer(params, "historyLength", at, 0)
        elif method == "ListTasks":
            self.list_tasks(params, at)
        elif method == "CreateTaskPushNotificationConfig":
            self.push_config(params, at, need_task=True)
        elif method in ("GetTaskPushNotificationConfig", "DeleteTaskPushNotificationConfig"):
            string(params, "taskId", at, required=True)
            string(params, "id", at, required=True)
        elif method == "ListTaskPushNotificationConfigs":
            string(params, "taskId", at, required=True)
            integer(params, "pageSize", at, 1, 100)
        elif method in ("message/send", "message/stream"):
            msg = obj(params, "message", at, required=True)
            assert msg is not None
            parts = msg.get("parts")
            if not isinstance(parts, list) or not parts or not all(
                isinstance(p, dict) for p in parts
            ):
                raise Invalid("params", "params.message.parts must be a non-empty list of objects")
            if len(parts) > self.config.max_parts:
                raise Invalid("params", f"params.message.parts: at most {self.config.max_parts}")
            return self.legacy_message(msg, "params.message")
        elif method in ("tasks/get", "tasks/cancel", "tasks/resubscribe"):
            string(params, "id", at, required=True)
        return None

    def legacy_message(self, msg: Any, at: str, *, rest: bool = False) -> CheckedMessage:
        """An A2A 0.3 message, checked lightly (the SDK's adapter parses the rest): its
        subtask list, text and hops. JSON-RPC parts are ``{"kind": "text", "text": ...}``
        / ``{"kind": "data", "data": {...}}``; HTTP+JSON (``rest``) puts them in
        ``content`` as ``{"text": ...}`` / ``{"data": {"data": {...}}}``."""
        msg = msg if isinstance(msg, dict) else {}
        parts = msg.get("content" if rest else "parts")
        meta = msg.get("metadata")
        hops = self.hops(meta if isinstance(meta, dict) else None, at)
        specs: list[SubtaskSpec] | None = None
        pieces: list[tuple[str, Any]] = []
        for i, part in enumerate(parts if isinstance(parts, list) else ()):
            if not isinstance(part, dict):
                continue
            kind = part.get("kind") or ("text" if "text" in part else "data" if "data" in part
                                        else "")
            value = part.get(kind) if kind in ("text", "data") else None
            if rest and kind == "data" and isinstance(value, dict):
                value = value.get("data")
            if kind == "text" and isinstance(value, str):
                pieces.append(("text", value))
            elif isinstance(value, dict) and "subtasks" in value:
                if specs is not None:
                    raise Invalid("params", f"{at}: only one data part may list subtasks")
                specs = self.subtask_list(value["subtasks"], f"{at}.parts[{i}].data.subtasks")
            elif kind == "data" and value is not None:
                pieces.append(("data", value))
        checked = CheckedMessage.of_parts(pieces, specs, hops)
        if specs is None and not checked.text:
            raise Invalid("params", f"{at} has no text and no subtasks; send a text part")
        return checked

# -------------------- json-rpc ------------------------------------------------

JSON_TYPES = ("application/json", "application/a2a+json")
_CODES = {"parse": -32700, "request": -32600, "method": -32601, "params": -32602,
          "version": -32009,  # A2A's VersionNotSupportedError
          "content_type": -32005}  # A2A's ContentTypeNotSupportedError


def rpc_error(request_id: Any, code: int, message: str,
              data: dict[str, Any] | None = None) -> dict[str, Any]:
    """A JSON-RPC 2.0 error response."""
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": request_id, "error": error}


class RpcRefused(Exception):
    """A client mistake on the JSON-RPC surface; ``payload`` is the error response."""

    def __init__(self, request_id: Any, kind: str, message: str) -> None:
        super().__init__(message)
        self.payload = rpc_error(request_id, _CODES[kind], message)


def check_jsonrpc(body: bytes, *, version: str, content_type: str, shapes: Shapes,
                  max_depth: int) -> tuple[Any, CheckedMessage | None]:
    """The request's id and, for a send, the message as checked, once every check passed;
    raises RpcRefused (carrying the request id as far as it was read)."""
    request_id: Any = None
    try:
        ctype = content_type.split(";")[0].strip().lower()
        if ctype and ctype not in JSON_TYPES:  # checked before the body is read as JSON
            raise Invalid("content_type", f"Content-Type must be application/json, got "
                          f"{ctype}; send the request with Content-Type: application/json")
        doc = parse_json(body, max_depth)
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
            raise Invalid("method", f"method {method!r} not found; A2A 1.0 methods: "
                          + ", ".join(sorted(m for m in JSONRPC_METHODS if "/" not in m)))
        if "/" in method and not is_v0_3(version):
            # The SDK's 0.3 adapter answers this with -32603 (internal error).
            raise Invalid("version", f"method {method!r} is an A2A 0.3 name but the request "
                          f"says A2A-Version: {version}; use the 1.0 method names, or send "
                          "A2A-Version: 0.3")
        params = doc.get("params", {})
        if not isinstance(params, dict):
            raise Invalid("params", "params must be an object")
        checked = shapes.jsonrpc_params(method, params)
    except Invalid as e:
        raise RpcRefused(request_id, e.kind, str(e)) from None
    return request_id, checked


def is_v0_3(version: str) -> bool:
    """Whether the SDK's 0.3 adapter accepts an ``A2A-Version`` header (none means 0.3)."""
    major = version.strip().split(".")[0]
    return not major or (major.isdigit() and int(major) == 0)

# -------------------- rest ----------------------------------------------------

class RestInvalid(Exception):
    """A client mistake on the HTTP+JSON surface, answered with ``status`` and the gRPC
    status ``INVALID_ARGUMENT``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@contextmanager
def _refused_as(status: int) -> Iterator[None]:
    """Raise an ``Invalid`` from the block as ``RestInvalid(status)``; an unaccepted media
    type is 415 (A2A's ContentTypeNotSupportedError) wherever it is found."""
    try:
        yield
    except Invalid as e:
        raise RestInvalid(415 if e.kind == "content_type" else status, str(e)) from None


def rest_error(status: int, grpc_status: str, message: str) -> dict[str, Any]:
    """The SDK's HTTP+JSON error shape (``{"error": {code, status, message}}``)."""
    return {"error": {"code": status, "status": grpc_status, "message": message}}


def check_rest(method: str, rest: str, headers: dict[str, str], body: bytes, scope: Scope,
               shapes: Shapes, max_depth: int) -> CheckedMessage | None:
    """Check one HTTP+JSON request (``rest``: the path after the prefix); raises
    RestInvalid. When it sends a message, the message as checked (the caller checks its
    places against the gate's queue); else None."""
    legacy = rest.startswith("/v1/")
    op = rest[3:] if legacy else rest
    if method == "POST" and (
        op in ("/message:send", "/message:stream") or op.endswith("/pushNotificationConfigs")
    ):
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in JSON_TYPES:
            raise RestInvalid(415, f"Content-Type must be application/json, got {ctype or 'none'}")
        doc = _rest_doc(body, max_depth)
        sends = op.startswith("/message:")
        with _refused_as(422):
            if legacy and sends:
                message = doc.get("message", doc.get("request"))
                return shapes.legacy_message(message, "body.message", rest=True)
            if sends:
                return shapes.send(doc, "body")
            if not legacy:
                shapes.push_config(doc, "body", need_task=False)
    elif method == "POST" and body:
        _rest_doc(body, max_depth)
    elif method == "GET" and not legacy:
        query = query_params(scope)
        with _refused_as(400):
            if op == "/tasks":
                shapes.list_tasks(query, "query")
            elif op.startswith("/tasks/"):
                integer(query, "historyLength", "query", 0)
                integer(query, "pageSize", "query", 1, 100)
    return None


def _rest_doc(body: bytes, max_depth: int) -> dict[str, Any]:
    with _refused_as(400):
        doc = parse_json(body, max_depth)
    if not isinstance(doc, dict):
        raise RestInvalid(400, "body must be a JSON object")
    return doc


def query_params(scope: Scope) -> dict[str, Any]:
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

# -------------------- the guard -----------------------------------------------

class RequestGuard:
    """See the module docstring. ``check_queue`` is the gate's pure queue check
    (:meth:`~mesh.gate.queue.Admission.check_queue`), asked for the request's places and
    its caller (``scope["user"]``, set by the auth middleware in front of this one)."""

    def __init__(self, app: ASGIApp, config: CoordinatorConfig,
                 check_queue: Callable[..., QueueCheck] | None = None,
                 jsonrpc_path: str = "/") -> None:
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
        try:
            too_big = declared is not None and int(declared) > limit
        except ValueError:
            bad = rest_error(400, "INVALID_ARGUMENT", "Content-Length is not a number")
            await send_json(send, 400, bad)
            return
        has_body = declared not in (None, "0") or "chunked" in headers.get("transfer-encoding", "")
        body: bytes | None = b""
        if has_body and not too_big:
            body = await read_body(receive, limit)
        if too_big or body is None:
            await self._too_large(send, surface)
            return

        request_id: Any = None
        checked: CheckedMessage | None = None  # what a send sends
        try:
            if surface == "jsonrpc":
                request_id, checked = check_jsonrpc(
                    body, version=headers.get("a2a-version", ""),
                    content_type=headers.get("content-type", ""), shapes=self.shapes,
                    max_depth=self.config.max_json_depth)
            elif rest_match is not None:
                checked = check_rest(method, rest_match.group("rest"), headers, body, scope,
                                     self.shapes, self.config.max_json_depth)
        except RpcRefused as e:
            await send_json(send, 200, e.payload)
            return
        except RestInvalid as e:
            await send_json(send, e.status, rest_error(e.status, "INVALID_ARGUMENT", str(e)))
            return
        if checked is not None:
            if self.check_queue is not None:
                caller = str(getattr(scope.get("user"), "username", "") or "")
                check = self.check_queue(places=checked.places, caller=caller)
                if not check.ok:
                    await self._busy(send, surface, check, request_id)
                    return
            scope[_KEY] = checked  # for CheckedContextBuilder

        if surface == "rest" and not names_a2a_json(headers):
            send = relabel_a2a_json(send)  # A2A 1.0.0 section 11.1: application/json
        await self.app(scope, replay_body(body, receive) if has_body else receive, send)

    # ---- capacity / size answers

    async def _busy(self, send: Send, surface: str, check: QueueCheck, request_id: Any) -> None:
        retry = max(1, math.ceil(check.retry_after_s))
        text = (
            f"over capacity: the gate's queue cannot take this request ({check.queue_len} "
            "waiting" + (f"; {check.reason}" if check.reason else "")
            + f"); retry after {retry} s"
        )
        payload = (rpc_error(request_id, -32000, text, {"retryAfter": retry})
                   if surface == "jsonrpc" else rest_error(429, "RESOURCE_EXHAUSTED", text))
        await send_json(send, 429, payload, [(b"retry-after", str(retry).encode("ascii"))])

    async def _too_large(self, send: Send, surface: str) -> None:
        text = (
            f"request body exceeds {self.config.max_body_bytes} bytes; "
            "send less (split the work into subtasks), or start the server with a larger "
            "`mesh serve --max-body-bytes N`"
        )
        payload = (rpc_error(None, -32600, text) if surface == "jsonrpc"
                   else rest_error(413, "INVALID_ARGUMENT", text))
        await send_json(send, 413, payload, [(b"connection", b"close")])

