"""The JSON-RPC surface's checks (``POST /``), each refusal with its JSON-RPC error code.

In order: content type (-32005, before the body is read as JSON), UTF-8 and JSON (-32700,
also for nesting past ``max_json_depth``), the request object (-32600), a known method
(-32601; an A2A 0.3 name only under ``A2A-Version: 0.3``, else -32009), the params shape
(-32602, :class:`~mesh.a2a.validation.shapes.Shapes`).
"""

from __future__ import annotations

from typing import Any

from mesh.a2a.validation.checked import CheckedMessage
from mesh.a2a.validation.fields import Invalid, parse_json
from mesh.a2a.validation.shapes import JSONRPC_METHODS, Shapes

__all__ = ["JSON_TYPES", "RpcRefused", "check_jsonrpc", "is_v0_3", "rpc_error"]

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
                  max_depth: int) -> tuple[str, Any, CheckedMessage | None]:
    """The request's method, id and, for a send, the message as checked, once every
    check passed; raises RpcRefused (carrying the request id as far as it was read)."""
    request_id: Any = None
    try:
        ctype = content_type.split(";")[0].strip().lower()
        if ctype and ctype not in JSON_TYPES:  # checked before the body is read as JSON
            raise Invalid("content_type", f"Content-Type must be application/json, got "
                          f"{ctype}; send the request with Content-Type: application/json")
        try:
            doc = parse_json(body, max_depth)
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
        if "/" in method and not is_v0_3(version):
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
        checked = shapes.jsonrpc_params(method, params)
    except Invalid as e:
        raise RpcRefused(request_id, e.kind, str(e)) from None
    return method, request_id, checked


def is_v0_3(version: str) -> bool:
    """Whether the SDK's 0.3 adapter accepts an ``A2A-Version`` header (none means 0.3)."""
    text = version.strip()
    if not text:
        return True
    major = text.split(".")[0]
    return major.isdigit() and int(major) == 0
