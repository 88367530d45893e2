"""The HTTP+JSON surface's checks (under ``rest_prefix``), each refusal an HTTP status.

Sending a message or a push config: content type (415), UTF-8 / JSON (400), shape (422;
a refused part media type is 415). Any other POST body: UTF-8 / JSON (400). GET: query
parameters (400). Legacy ``/v1/`` routes get the body checks only.
"""

from __future__ import annotations

from typing import Any

from starlette.types import Scope

from mesh.a2a.validation.checked import CheckedMessage
from mesh.a2a.validation.fields import Invalid, integer, parse_json
from mesh.a2a.validation.jsonrpc import JSON_TYPES
from mesh.a2a.validation.shapes import Shapes

__all__ = ["RestInvalid", "check_rest", "query_params", "rest_error"]


class RestInvalid(Exception):
    """A client mistake on the HTTP+JSON surface: its status and gRPC status name."""

    def __init__(self, status: int, grpc_status: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.grpc_status = grpc_status


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
            raise RestInvalid(
                415,
                "INVALID_ARGUMENT",
                f"Content-Type must be application/json, got {ctype or 'none'}",
            )
        doc = _rest_doc(body, max_depth)
        sends = op.startswith("/message:")
        try:
            if legacy:
                message = doc.get("message", doc.get("request"))
                return shapes.legacy_message(message, "body.message", rest=True) if sends \
                    else None
            if sends:
                return shapes.send(doc, "body")
            shapes.push_config(doc, "body", need_task=False)
        except Invalid as e:
            if e.kind == "content_type":  # A2A's ContentTypeNotSupportedError
                raise RestInvalid(415, "INVALID_ARGUMENT", str(e)) from None
            raise RestInvalid(422, "INVALID_ARGUMENT", str(e)) from None
        return None
    elif method == "POST" and body:
        _rest_doc(body, max_depth)
    elif method == "GET" and not legacy:
        query = query_params(scope)
        try:
            if op == "/tasks":
                shapes.list_tasks(query, "query")
            elif op.startswith("/tasks/"):
                integer(query, "historyLength", "query", 0)
                integer(query, "pageSize", "query", 1, 100)
        except Invalid as e:
            raise RestInvalid(400, "INVALID_ARGUMENT", str(e)) from None
    return None


def _rest_doc(body: bytes, max_depth: int) -> dict[str, Any]:
    try:
        doc = parse_json(body, max_depth)
    except Invalid as e:
        raise RestInvalid(400, "INVALID_ARGUMENT", str(e)) from None
    if not isinstance(doc, dict):
        raise RestInvalid(400, "INVALID_ARGUMENT", "body must be a JSON object")
    return doc


def query_params(scope: Scope) -> dict[str, Any]:
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
