"""One line for every error a ``mesh`` user can cause, naming the fix.

A server that is not there, one that refuses (401/403), one that answers 4xx with its own
message, a timeout: each becomes one sentence on stderr and a non-zero exit; the traceback
is printed only with ``mesh --debug``. Errors are recognised through their cause chain,
because the a2a-sdk wraps httpx's errors in its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
from a2a.client.errors import A2AClientTimeoutError, AgentCardResolutionError
from a2a.utils.errors import A2AError

__all__ = ["describe", "server_message", "status_line"]

_DEBUG_HINT = "rerun with `mesh --debug ...` for the traceback"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        if isinstance(cur, BaseExceptionGroup) and cur.exceptions:
            cur = cur.exceptions[0]  # a task group's first failure is the one that matters
        else:
            cur = cur.__cause__ or cur.__context__


def server_message(response: httpx.Response) -> str:
    """The error text a server put in its body (A2A/JSON-RPC/REST/OpenAI shapes), else
    the first 200 characters of the body."""
    try:
        doc = response.json()
    except (ValueError, UnicodeDecodeError):
        return response.text.strip()[:200]
    for path in (("error", "message"), ("message",), ("detail",), ("error",)):
        cur: object = doc
        for key in path:
            cur = cur.get(key) if isinstance(cur, dict) else None
        if isinstance(cur, str) and cur:
            return cur
    return json.dumps(doc)[:200]


def status_line(code: int, where: str, text: str) -> str:
    """One line for an HTTP error status ``code`` from ``where`` whose body said ``text``."""
    said = f": {text}" if text else ""
    if code in (401, 403):
        return (f"{where} refused the request ({code}{said}); pass --token TOKEN or set "
                "MESH_TOKEN to a token the server accepts (its --auth-token)")
    if code == 404:
        return (f"{where} has no such route (404{said}); check the URL: it should be a "
                "mesh server's base URL, e.g. http://127.0.0.1:8700")
    if code == 429:
        return f"{where} is over capacity (429{said}); retry later"
    if code == 413:
        return f"{where} refused the request as too large (413{said})"
    if 400 <= code < 500:
        return f"{where} refused the request ({code}{said})"
    return f"{where} failed ({code}{said}); see the server's log"


def describe(exc: BaseException, url: str | None = None) -> str:
    """One line for ``exc`` naming the fix; ``url`` is the server the command talked to."""
    where = url.rstrip("/") if url else "the server"
    for e in _chain(exc):
        if isinstance(e, httpx.HTTPStatusError):
            return status_line(e.response.status_code, where, server_message(e.response))
        if isinstance(e, AgentCardResolutionError) and e.status_code is not None:
            return status_line(e.status_code, where, "")
        if isinstance(e, (httpx.ConnectError, ConnectionRefusedError)):
            return (f"cannot connect to {where}: nothing answers there; start it with "
                    "`mesh serve` or check the URL and port")
        if isinstance(e, (httpx.TimeoutException, A2AClientTimeoutError, TimeoutError)):
            return (f"{where} did not answer in time; raise --timeout, or check that it is "
                    "not overloaded (`mesh capacity URL`)")
        if isinstance(e, httpx.UnsupportedProtocol | httpx.InvalidURL):
            return f"{where} is not a valid URL ({e}); pass one like http://127.0.0.1:8700"
        if isinstance(e, httpx.RemoteProtocolError):
            return (f"{where} closed the connection mid-answer ({e}); is it an A2A server? "
                    "check the URL and the server's log")
    if isinstance(exc, A2AError):
        # The server's own JSON-RPC error message: it already names the fix.
        return f"{where}: {exc}"
    if isinstance(exc, httpx.HTTPError):
        return f"{where}: {exc}"
    return f"{type(exc).__name__}: {exc}; {_DEBUG_HINT}"
