"""Where a peer's token may go: its configured address, checked, and nowhere else.

A peer's card lists its interfaces (``supportedInterfaces``) with URLs the *peer* chose; the
SDK's client sends to them. Followed blindly, a card could send the message, with the
bearer token meant for that peer, to any address (another port, a private host, a cloud
metadata service). Two guards keep delegation at the configured address:

* :func:`confine_card` rewrites a card before the SDK client is built: an interface URL at
  the configured URL's origin (scheme, host, port) and at or under its path is kept; any
  other interface URL is replaced by the configured URL. The card still chooses the
  protocol binding and version, never the address.
* :class:`GuardedTransport`, under every ``httpx`` client that carries a peer token, refuses
  any request whose origin is not a configured peer's, resolves the host once, checks the
  address it will connect to against the address policy (the push policy: no private
  addresses unless ``--allow-private-push``) and connects to that very address (the host
  stays in ``Host`` and, for https, in SNI), so DNS cannot answer differently between the
  check and the connect.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

import httpx
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import A2AError

__all__ = ["GuardedTransport", "Origin", "confine_card", "origin_of", "within"]

Origin = tuple[str, str, int]
Validator = Callable[[str], Awaitable[bool]]


def origin_of(url: str) -> Origin | None:
    """(scheme, lower-case host, port) of an absolute http(s) URL, or None."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts.scheme, parts.hostname.lower(), port or (443 if parts.scheme == "https" else 80)


def within(url: str, base: str) -> bool:
    """``url`` is at ``base``'s origin and at or under its path, with no user info, query,
    fragment, dot segment, escape or backslash that could make it mean another place."""
    if origin_of(url) is None or origin_of(url) != origin_of(base):
        return False
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        return False
    if "%" in parts.path or "\\" in parts.path:
        return False
    if any(seg in (".", "..") for seg in parts.path.split("/")):
        return False
    prefix = urlsplit(base).path.rstrip("/")
    path = parts.path.rstrip("/")
    return path == prefix or path.startswith(prefix + "/")


def confine_card(card: pb.AgentCard, url: str) -> tuple[pb.AgentCard, list[str]]:
    """A copy of ``card`` whose interfaces all point within ``url`` (the configured peer
    address), and the interface URLs that were replaced (see the module docstring)."""
    confined = pb.AgentCard()
    confined.CopyFrom(card)
    replaced: list[str] = []
    for interface in confined.supported_interfaces:
        if not within(interface.url, url):
            replaced.append(interface.url)
            interface.url = url
    return confined, replaced


class PeerAddressRefused(httpx.ConnectError):
    """A request of a peer client to an address that is not a configured, checked one."""


class GuardedTransport(httpx.AsyncBaseTransport):
    """The transport of every token-carrying peer client (see the module docstring).

    ``origins``: the configured peer URLs this client may reach; ``validate``: the address
    policy, asked about the URL with the resolved address as its host (None: no policy);
    ``inner``: the transport that really connects (default ``httpx.AsyncHTTPTransport``).
    """

    def __init__(
        self,
        urls: Iterable[str],
        validate: Validator | None,
        inner: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.origins = frozenset(o for o in (origin_of(u) for u in urls) if o is not None)
        self.validate = validate
        self.inner = inner if inner is not None else httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = str(request.url)
        origin = origin_of(url)
        if origin is None or origin not in self.origins:
            raise PeerAddressRefused(
                f"refused to send to {request.url.scheme}://{request.url.netloc.decode()}: "
                "not a configured peer address (configure it with --peer NAME=URL)",
                request=request,
            )
        host = origin[1]
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, origin[2], type=socket.SOCK_STREAM
            )
        except OSError as exc:
            raise httpx.ConnectError(f"cannot resolve {host}: {exc}", request=request) from exc
        addresses = list(dict.fromkeys(str(info[4][0]).split("%", 1)[0] for info in infos))
        if not addresses:
            raise httpx.ConnectError(f"cannot resolve {host}", request=request)
        for address in addresses:  # every address, as the push policy judges a host
            if self.validate is not None and not await _accepts(
                self.validate, str(request.url.copy_with(host=address))
            ):
                raise PeerAddressRefused(
                    f"refused to send to {host} ({address}): a private or loopback address, "
                    "refused by the push policy; start the server with --allow-private-push "
                    "to allow it",
                    request=request,
                )
        # ``Host`` was set from the configured URL when the request was built; only the
        # connection goes to a checked address, tried in resolver order as a plain connect
        # would (nothing was sent when a connect fails, so the next one may be tried).
        original = request.url
        if origin[0] == "https":
            request.extensions = {**request.extensions, "sni_hostname": host}
        for i, address in enumerate(addresses):
            request.url = original.copy_with(host=address)
            try:
                return await self.inner.handle_async_request(request)
            except httpx.ConnectError:
                if i == len(addresses) - 1:
                    raise
        raise AssertionError("unreachable")  # the loop returns or raises

    async def aclose(self) -> None:
        await self.inner.aclose()


async def _accepts(validate: Validator, url: str) -> bool:
    """The policy's verdict; a refusal raised (the push policy raises it with its reason)
    is a refusal."""
    try:
        return await validate(url)
    except A2AError:
        return False
