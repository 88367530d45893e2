"""Other A2A agents as peers: delegation hops, the address guard, and the peer client.

**Hops.** ``metadata.meshHops`` (hops so far, this one included) and ``metadata.meshChain``
(the agents the message went through). The request guard reads them once at the door
(:func:`hops_of`, refusing a message past ``--max-hops``, so A → B → A cannot loop); they
travel with the task's subtasks as :class:`~mesh.worker.types.Hops`, and ``send`` writes
:func:`hops_metadata` of :meth:`Hops.onward <mesh.worker.types.Hops.onward>`.

**The address guard.** A peer's card lists interface URLs the *peer* chose; followed
blindly, they could send the bearer token meant for that peer anywhere (another port, a
private host, a cloud metadata service). Two guards keep delegation at the configured
address:

* :func:`confine_card` replaces every interface URL not at the configured URL's origin
  and at or under its path by the configured URL: the card chooses the protocol binding
  and version, never the address.
* :class:`GuardedTransport`, under every ``httpx`` client that carries a peer token,
  refuses any origin that is not a configured peer's, resolves the host once, checks each
  address against the push policy (no private addresses unless ``--allow-private-push``)
  and connects to that very address (the host stays in ``Host`` and SNI), so DNS cannot
  answer differently between the check and the connect.

**The peer client.** :class:`PeerClient` lists each peer's skills (the ``delegate`` tool's
description) and ``send(peer, text)`` returns the final answer text (:func:`answer_text`).
A task that fails, is canceled or rejected raises :class:`PeerError` with the peer's
reason. Each URL passes the push policy before its card is fetched and before each send.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx
from a2a.client import A2ACardResolver, A2AClientError, ClientConfig, ClientFactory
from a2a.types import a2a_pb2 as pb
from a2a.utils.constants import TransportProtocol
from a2a.utils.errors import A2AError

from mesh.agent.task import ANSWER_ARTIFACT
from mesh.worker.types import NO_HOPS, Hops

__all__ = [
    "CHAIN_KEY", "HOPS_KEY", "GuardedTransport", "Origin", "PeerClient", "PeerError",
    "PeerRefused", "answer_text", "confine_card", "hops_metadata", "hops_of", "origin_of",
    "parse_peer", "peer_token_env", "within"
]


# -------------------- hops ----------------------------------------------------

HOPS_KEY = "meshHops"
CHAIN_KEY = "meshChain"


def hops_of(metadata: Mapping[str, Any] | None) -> Hops:
    """The hops a message's metadata says; ``Hops()`` when absent or malformed."""
    if not metadata:
        return Hops()
    hops = metadata.get(HOPS_KEY, 0)
    chain = metadata.get(CHAIN_KEY, [])
    if isinstance(hops, float) and hops.is_integer():
        hops = int(hops)
    if not isinstance(hops, int) or isinstance(hops, bool) or hops < 0:
        hops = 0
    names = tuple(str(c) for c in chain) if isinstance(chain, list | tuple) else ()
    return Hops(hops, names)


def hops_metadata(hops: Hops) -> dict[str, Any]:
    """``hops`` as a message's metadata."""
    return {HOPS_KEY: hops.count, CHAIN_KEY: list(hops.chain)}

# -------------------- the address guard ---------------------------------------

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

    def __init__(self, urls: Iterable[str], validate: Validator | None,
                 inner: httpx.AsyncBaseTransport | None = None) -> None:
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
            infos = await asyncio.get_running_loop().getaddrinfo(host, origin[2],
                                                                 type=socket.SOCK_STREAM)
        except OSError as exc:
            raise httpx.ConnectError(f"cannot resolve {host}: {exc}", request=request) from exc
        addresses = list(dict.fromkeys(str(info[4][0]).split("%", 1)[0] for info in infos))
        if not addresses:
            raise httpx.ConnectError(f"cannot resolve {host}", request=request)
        for address in addresses:  # every address, as the push policy judges a host
            if not await _accepts(self.validate, str(request.url.copy_with(host=address))):
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


async def _accepts(validate: Validator | None, url: str) -> bool:
    """The policy's verdict (None: no policy); a refusal raised (the push policy raises it
    with its reason) is a refusal."""
    if validate is None:
        return True
    try:
        return await validate(url)
    except A2AError:
        return False

# -------------------- the peer client -----------------------------------------

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")


def parse_peer(spec: str) -> tuple[str | None, str]:
    """``NAME=URL`` (or a bare ``URL``, named by its card) → (name, url); raises
    ``ValueError`` naming the fix."""
    name: str | None = None
    url = spec
    if "=" in spec and not spec.startswith(("http://", "https://")):
        name, url = spec.split("=", 1)
        if not _NAME.match(name):
            raise ValueError(f"peer name {name!r} must match [A-Za-z][A-Za-z0-9_-]*")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"peer must be NAME=URL with an absolute http(s) URL, got {spec!r}")
    return name, url.rstrip("/")


def peer_token_env(name: str) -> str:
    """The environment variable holding a peer's token: ``MESH_PEER_TOKEN_<NAME>``."""
    return "MESH_PEER_TOKEN_" + re.sub(r"[^A-Za-z0-9]", "_", name).upper()


_TERMINAL = frozenset({pb.TaskState.TASK_STATE_COMPLETED, pb.TaskState.TASK_STATE_FAILED,
                       pb.TaskState.TASK_STATE_CANCELED, pb.TaskState.TASK_STATE_REJECTED})


class PeerError(Exception):
    """The peer could not be reached, or its task did not complete."""


class PeerRefused(PeerError, ValueError):
    """A configured peer's address is refused by the address policy (an operator error:
    a ``ValueError``, so ``mesh serve`` reports it in one line at start-up)."""


def _text(parts: Iterable[pb.Part], sep: str = "") -> str:
    return sep.join(p.text for p in parts if p.HasField("text"))


def _message_text(message: pb.Message) -> str:
    return _text(message.parts, "\n")


def answer_text(task: pb.Task) -> str:
    """The answer a terminal task carries: its ``answer`` artifact, else every text
    artifact, else the final status message."""
    for artifact in task.artifacts:
        if ANSWER_ARTIFACT in (artifact.artifact_id, artifact.name):
            return _text(artifact.parts)
    joined = "\n".join(filter(None, (_text(a.parts) for a in task.artifacts)))
    return joined or _message_text(task.status.message)


class PeerClient:
    """Cards, skills and ``send`` for a fixed list of peers (``NAME=URL`` or ``URL``).

    ``token`` is sent as a bearer token to every peer without one in ``tokens`` (by name).
    ``url_validator`` is the address policy checked before each card fetch and send (the
    push policy; None: no check; one that raises refuses). ``origin`` names this agent in
    ``meshChain``. One ``httpx.AsyncClient`` per token, on a :class:`GuardedTransport`
    that reaches only the peers holding that token; ``aclose`` closes them (unless a
    client was passed in: then that client's transport is the caller's business).
    """

    def __init__(self, peers: Iterable[str], *, token: str | None = None,
                 tokens: Mapping[str, str] | None = None, url_validator: Validator | None = None,
                 origin: str = "mesh", timeout_s: float = 300.0,
                 httpx_client: httpx.AsyncClient | None = None) -> None:
        parsed = [parse_peer(p) for p in peers]
        self.urls = tuple(url for _, url in parsed)
        self.names: dict[str, str] = {name: url for name, url in parsed if name}
        self.timeout_s = timeout_s
        self.origin = origin
        self._validate = url_validator
        self._shared = httpx_client
        self._clients: dict[str | None, httpx.AsyncClient] = {}
        self._token_of: dict[str, str | None] = {
            url: (tokens or {}).get(name or "", token) for name, url in parsed}
        self._cards: dict[str, pb.AgentCard] = {}
        self._warned: set[str] = set()

    def _http_for(self, url: str) -> httpx.AsyncClient:
        if self._shared is not None:
            return self._shared
        token = self._token_of.get(url)
        if token not in self._clients:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            reachable = [u for u, t in self._token_of.items() if t == token]
            self._clients[token] = httpx.AsyncClient(
                headers=headers, timeout=httpx.Timeout(self.timeout_s, connect=10.0),
                transport=GuardedTransport(reachable, self._validate))
        return self._clients[token]

    async def aclose(self) -> None:
        for client in self._clients.values():  # none when a client was passed in
            await client.aclose()
        self._clients.clear()

    async def card(self, url: str) -> pb.AgentCard:
        """The peer's card (fetched once, then cached)."""
        url = url.rstrip("/")
        if url not in self._cards:
            await self._check(url)  # before any byte, the token included, leaves
            try:
                http = self._http_for(url)
                self._cards[url] = await A2ACardResolver(http, url).get_agent_card()
            except A2AClientError as e:
                raise PeerError(f"cannot fetch the agent card of {url}: {e}") from e
        return self._cards[url]

    async def refresh(self) -> list[pb.AgentCard]:
        """Fetch every peer's card again, in ``urls`` order; a peer that cannot be reached
        raises PeerError."""
        self._cards.clear()
        return [await self.card(url) for url in self.urls]

    async def describe(self) -> str:
        """A plain-text list of peers and skills, for the ``delegate`` tool's description."""
        lines: list[str] = []
        names = {url: name for name, url in self.names.items()}
        for url, card in zip(self.urls, await self.refresh(), strict=True):
            name = names.get(url, card.name)
            named = f", card {card.name!r}" if name != card.name else ""
            lines.append(f"- {name} ({url}{named}): {card.description}")
            lines.extend(f"    * {skill.name}: {skill.description}" for skill in card.skills)
        if not lines:
            return "(no peers)"
        allowed = ", ".join(self.peer_names())
        return "\n".join([f"delegate: the peer argument must be one of: {allowed}", *lines])

    def peer_names(self) -> list[str]:
        """The names the ``delegate`` tool accepts (configured names, else card names)."""
        named = set(self.names.values())
        cards = [self._cards[u].name for u in self.urls if u not in named and u in self._cards]
        return [*self.names, *cards]

    async def send(self, peer: str, text: str, hops: Hops = NO_HOPS) -> str:
        """Send ``text`` to ``peer`` (a configured name, URL or card name) for a task that
        came ``hops`` far; return the answer: a ``Message``'s text, or a ``Task`` followed
        (streamed, or polled with ``GetTask``) until terminal, then :func:`answer_text`."""
        url = await self._resolve(peer)
        await self._check(url)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._send(url, text, hops)
        except TimeoutError:
            raise PeerError(f"peer {url} did not finish within {self.timeout_s:.0f} s") from None
        except (A2AClientError, A2AError) as e:
            raise PeerError(f"peer {url} failed: {e}") from e

    async def _check(self, url: str) -> None:
        """:class:`PeerRefused` unless ``url`` passes the address policy."""
        if not await _accepts(self._validate, url):
            raise PeerRefused(f"peer {url} resolves to a private or loopback address (or does "
                              "not resolve), refused by the push policy; start the server with "
                              "--allow-private-push to allow it")

    async def _resolve(self, peer: str) -> str:
        if peer in self.names:
            return self.names[peer]
        if peer.rstrip("/") in self.urls:
            return peer.rstrip("/")
        if not peer.startswith(("http://", "https://")):
            for url in self.urls:
                if (await self.card(url)).name == peer:
                    return url
        known = ", ".join(self.peer_names()) or "none configured (mesh serve --peer NAME=URL)"
        raise PeerError(f"unknown peer {peer!r}; delegate only to a configured peer: {known}")

    def _confined(self, url: str, card: pb.AgentCard) -> pb.AgentCard:
        """``card`` with every interface at the configured ``url`` (:func:`confine_card`);
        says once per peer when the card named another address."""
        confined, replaced = confine_card(card, url)
        if replaced and url not in self._warned:
            self._warned.add(url)
            logger.warning(
                "peer %s: its card names %s, not its configured address; sending to %s "
                "only (configure --peer with the card's address, or fix the peer's "
                "--public-url)", url, ", ".join(sorted(set(replaced))), url,
            )
        return confined

    async def _send(self, url: str, text: str, hops: Hops) -> str:
        card = self._confined(url, await self.card(url))
        config = ClientConfig(
            httpx_client=self._http_for(url),
            streaming=card.capabilities.streaming,
            supported_protocol_bindings=[TransportProtocol.JSONRPC.value,
                                         TransportProtocol.HTTP_JSON.value])
        client = ClientFactory(config).create(card)
        message = pb.Message(role=pb.Role.ROLE_USER, message_id=uuid.uuid4().hex,
                             parts=[pb.Part(text=text)])
        message.metadata.update(hops_metadata(hops.onward(self.origin)))
        request = pb.SendMessageRequest(message=message)
        task_id = ""
        state = pb.TaskState.TASK_STATE_UNSPECIFIED
        try:
            async for response in client.send_message(request):
                if response.HasField("message"):
                    return _message_text(response.message)
                if response.HasField("task"):
                    task_id, state = response.task.id, response.task.status.state
                elif response.HasField("status_update"):
                    task_id = response.status_update.task_id
                    state = response.status_update.status.state
                if state in _TERMINAL:
                    break
            if not task_id:
                raise PeerError(f"peer {url} answered with neither a message nor a task")
            task = await client.get_task(pb.GetTaskRequest(id=task_id))
            while task.status.state not in _TERMINAL:
                await asyncio.sleep(0.2)
                task = await client.get_task(pb.GetTaskRequest(id=task_id))
        finally:
            await client.close()
        if task.status.state != pb.TaskState.TASK_STATE_COMPLETED:
            state_name = pb.TaskState.Name(task.status.state).removeprefix("TASK_STATE_").lower()
            reason = _message_text(task.status.message) or "no reason given"
            raise PeerError(f"peer {url} task {task_id} {state_name}: {reason}")
        return answer_text(task)
