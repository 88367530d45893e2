"""A peer's token goes only to the peer's configured, checked address (issue 27 hole 2).

Before: with ``--peer canary=http://127.0.0.1:P`` and a card at P whose interface URL named
another port (or host), the SendMessage with ``Authorization: Bearer <peer token>`` went
there; and ``describe()`` fetched a loopback peer's card, token included, at start-up even
though the address policy refuses private addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mesh.a2a.push import make_push_url_validator
from mesh.fleet.peers import (
    GuardedTransport,
    PeerAddressRefused,
    PeerClient,
    PeerError,
    PeerRefused,
    confine_card,
    within,
)
from tests.support.coord_helpers import serve_asgi

pytestmark = pytest.mark.anyio
TOKEN = "peer-token-canary-789"


class Peer:
    """A small A2A peer: a card naming ``interface_url``, JSON-RPC SendMessage answered with
    a message; every request's path and Authorization header recorded."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.interface_url = ""
        self.seen: list[tuple[str, str | None]] = []

    def card(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": f"{self.name} agent",
            "version": "1.0",
            "supportedInterfaces": [
                {"url": self.interface_url, "protocolBinding": "JSONRPC",
                 "protocolVersion": "1.0"},
            ],
            "capabilities": {"streaming": False},
            "defaultInputModes": ["text/plain"],
            "defaultOutputModes": ["text/plain"],
            "skills": [{"id": "s", "name": "look", "description": "looks things up",
                        "tags": ["x"]}],
        }

    async def any_request(self, request: Request) -> Response:
        self.seen.append((request.url.path, request.headers.get("authorization")))
        if request.method == "GET":
            return JSONResponse(self.card())
        body = json.loads(await request.body())
        text = body["params"]["message"]["parts"][0]["text"]
        message = {"messageId": "r", "role": "ROLE_AGENT",
                   "parts": [{"text": f"{self.name} says: {text}"}]}
        return JSONResponse({"jsonrpc": "2.0", "id": body["id"], "result": {"message": message}})

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self.any_request,
                                       methods=["GET", "POST"])])


def _socket(host: str, port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


@contextlib.contextmanager
def running(peer: Peer, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    sock = _socket(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}"
    with serve_asgi(peer.app(), sock):
        yield url


@contextlib.contextmanager
def canary_and_decoy(other_host: bool) -> Iterator[tuple[Peer, Peer, str, str]]:
    """The canary, whose card names the decoy's address: another port on the same host,
    or the same port on another host (127.0.0.2)."""
    canary, decoy = Peer("canary"), Peer("decoy")
    with running(canary) as canary_url:
        port = int(canary_url.rsplit(":", 1)[1])
        with running(decoy, *(("127.0.0.2", port) if other_host else ("127.0.0.1",))) as decoy_url:
            canary.interface_url = decoy_url + "/"
            decoy.interface_url = decoy_url + "/"
            yield canary, decoy, canary_url, decoy_url


@pytest.mark.parametrize("other_host", [False, True], ids=["other-port", "other-host"])
async def test_delegation_goes_to_the_configured_address_not_the_cards(other_host: bool) -> None:
    with canary_and_decoy(other_host) as (canary, decoy, canary_url, _):
        peers = PeerClient([f"canary={canary_url}"], tokens={"canary": TOKEN},
                           url_validator=make_push_url_validator(True))
        try:
            assert await peers.send("canary", "hello") == "canary says: hello"
        finally:
            await peers.aclose()
    assert decoy.seen == [], "the peer token left for the address the card named"
    assert ("/", f"Bearer {TOKEN}") in canary.seen


async def test_the_transport_refuses_any_other_origin() -> None:
    """Even a request the SDK might build from the card itself (or a redirect) cannot
    leave for an origin that is not a configured peer's."""
    with canary_and_decoy(False) as (canary, decoy, canary_url, decoy_url):
        peers = PeerClient([f"canary={canary_url}"], tokens={"canary": TOKEN})
        try:
            http = peers._http_for(canary_url)
            with pytest.raises(PeerAddressRefused, match="not a configured peer address"):
                await http.post(decoy_url + "/", json={})
            assert (await http.get(canary_url + "/x")).status_code == 200
        finally:
            await peers.aclose()
    assert decoy.seen == []
    assert canary.seen == [("/x", f"Bearer {TOKEN}")]


async def test_start_up_does_not_fetch_a_private_peer_unless_allowed() -> None:
    canary = Peer("canary")
    with running(canary) as url:
        canary.interface_url = url + "/"
        peers = PeerClient([f"canary={url}"], tokens={"canary": TOKEN},
                           url_validator=make_push_url_validator(False))
        try:
            with pytest.raises(PeerRefused, match="--allow-private-push") as refused:
                await peers.describe()
            assert isinstance(refused.value, ValueError)  # mesh serve: one line, rc 2
            with pytest.raises(PeerError, match="--allow-private-push"):
                await peers.send("canary", "hello")
        finally:
            await peers.aclose()
        assert canary.seen == [], "a private peer was contacted without --allow-private-push"
        allowed = PeerClient([f"canary={url}"], tokens={"canary": TOKEN},
                             url_validator=make_push_url_validator(True))
        try:
            assert "canary (" in await allowed.describe()
        finally:
            await allowed.aclose()
        assert canary.seen == [("/.well-known/agent-card.json", f"Bearer {TOKEN}")]


async def test_the_checked_address_is_the_one_connected_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host is resolved once; the policy judges every address and the connection goes
    to a judged one (a name that resolves to a private address is refused at connect time
    too, whatever it resolved to when it was first checked)."""
    answers = {"peer.test": ["10.0.0.5"]}

    async def getaddrinfo(host: str, port: int, **_: Any) -> list[Any]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))
                for ip in answers.get(host, [host])]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
    sent: list[httpx.Request] = []
    down = {"93.184.216.35"}

    def record(request: httpx.Request) -> httpx.Response:
        if request.url.host in down:
            raise httpx.ConnectError("connection refused", request=request)
        sent.append(request)
        return httpx.Response(200, json={})

    transport = GuardedTransport(["https://peer.test:8443"], make_push_url_validator(False),
                                 inner=httpx.MockTransport(record))
    async with httpx.AsyncClient(transport=transport) as http:
        for private in (["10.0.0.5"], ["93.184.216.34", "127.0.0.1"]):
            answers["peer.test"] = private
            with pytest.raises(PeerAddressRefused, match="--allow-private-push"):
                await http.get("https://peer.test:8443/")
        assert sent == []
        answers["peer.test"] = ["93.184.216.35", "93.184.216.34"]  # the first one is down
        await http.get("https://peer.test:8443/a")
    (request,) = sent
    assert request.url.host == "93.184.216.34" and request.url.path == "/a"
    assert request.headers["host"] == "peer.test:8443"
    assert request.extensions["sni_hostname"] == "peer.test"


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("http://h:1/a", True),
        ("http://H:1/a/", True),
        ("http://h:1/a/rpc", True),
        ("http://h:1/ab", False),
        ("http://h:1/", False),
        ("http://h:2/a", False),
        ("https://h:1/a", False),
        ("http://g:1/a", False),
        ("http://u@h:1/a", False),
        ("http://h:1/a/../b", False),
        ("http://h:1/a/%2e%2e/b", False),
        ("http://h:1/a?x=1", False),
        ("ftp://h:1/a", False),
    ],
)
def test_within(url: str, ok: bool) -> None:
    assert within(url, "http://h:1/a") is ok


def test_default_ports_are_the_same_origin() -> None:
    assert within("http://h/x", "http://h:80")
    assert within("https://h:443/x", "https://h")


def test_confine_card_keeps_the_binding_and_replaces_the_address() -> None:
    from a2a.types import a2a_pb2 as pb

    card = pb.AgentCard(name="c", supported_interfaces=[
        pb.AgentInterface(url="http://10.0.0.9:80/", protocol_binding="JSONRPC",
                          protocol_version="1.0"),
        pb.AgentInterface(url="http://peer.example/v1", protocol_binding="HTTP+JSON",
                          protocol_version="1.0"),
    ])
    confined, replaced = confine_card(card, "http://peer.example")
    assert [i.url for i in confined.supported_interfaces] == [
        "http://peer.example", "http://peer.example/v1"
    ]
    assert [i.protocol_binding for i in confined.supported_interfaces] == ["JSONRPC", "HTTP+JSON"]
    assert replaced == ["http://10.0.0.9:80/"]
    assert card.supported_interfaces[0].url == "http://10.0.0.9:80/"  # the cached card is kept
