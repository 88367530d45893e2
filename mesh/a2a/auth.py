"""Bearer-token authentication and per-caller identity, as a pure ASGI middleware.

The SDK declares security schemes on the card but enforces none; this middleware does.
Every HTTP request except the public paths (the agent card, ``/healthz``) must carry
``Authorization: Bearer TOKEN`` for one of the configured tokens, else it gets 401 with
``WWW-Authenticate: Bearer``. Tokens are compared in constant time, and every configured
token is compared on every request, so timing reveals neither the token nor which one
matched.

A matched token becomes ``scope["user"]`` (a Starlette ``SimpleUser`` named
``caller-<sha256 prefix>``); the SDK turns it into ``ServerCallContext.user`` and the task
store scopes every read and write by that name, so a caller sees only its own tasks.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable

from starlette.authentication import AuthCredentials, SimpleUser
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["BearerAuth", "caller_name"]


def caller_name(token: str) -> str:
    """The stable, non-secret name of the caller holding ``token``."""
    return "caller-" + hashlib.sha256(token.encode("utf-8")).hexdigest()[:16]


class BearerAuth:
    """Reject requests without a valid bearer token; name the caller of those with one."""

    def __init__(self, app: ASGIApp, tokens: Iterable[str], public_paths: Iterable[str]) -> None:
        self.app = app
        self._tokens = [(t.encode("utf-8"), caller_name(t)) for t in tokens]
        self._public = frozenset(public_paths)

    def _match(self, header: str | None) -> str | None:
        if not header:
            return None
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented:
            return None
        candidate = presented.strip().encode("utf-8")
        found: str | None = None
        for token, name in self._tokens:
            # No early exit: each token is compared on every request.
            if hmac.compare_digest(candidate, token):
                found = name
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._tokens:
            await self.app(scope, receive, send)
            return
        if scope["path"] in self._public:
            await self.app(scope, receive, send)
            return
        header: str | None = None
        for key, value in scope.get("headers", ()):
            if key == b"authorization":
                header = value.decode("latin-1")
                break
        name = self._match(header)
        if name is None:
            await _unauthorized(send, header is not None)
            return
        scope["user"] = SimpleUser(name)
        scope["auth"] = AuthCredentials(["authenticated"])
        await self.app(scope, receive, send)


async def _unauthorized(send: Send, had_header: bool) -> None:
    message = (
        "invalid bearer token" if had_header else "missing bearer token"
    ) + "; send 'Authorization: Bearer TOKEN' (mesh commands: --token or MESH_TOKEN)"
    body = json.dumps(
        {"error": {"code": 401, "status": "UNAUTHENTICATED", "message": message}}
    ).encode("utf-8")
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode("ascii")),
                (b"www-authenticate", b'Bearer realm="mesh"'),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
