"""``delegate`` reaches only configured peers, by name, under the push address policy, with
per-peer tokens; every delegated message carries its hop count and chain, and a message
past --max-hops is refused at once with the chain (issue 12, point 4)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from mesh.a2a.app import build_app
from mesh.a2a.config import CoordinatorConfig
from mesh.a2a.push import make_push_url_validator
from mesh.cli import serve as serve_cli
from mesh.cli.compose import peer_tokens
from mesh.fleet.peers import PeerClient, PeerError
from mesh.worker.tools import ToolError, delegate_tool
from mesh.worker.types import Hops, Subtask, WorkerResult
from tests.support.coord_helpers import FakeAdmission

pytestmark = pytest.mark.anyio


class HopWorker:
    """Answers with the hop count and chain its subtask carries from the incoming message."""

    async def run(self, subtask: Subtask, emit: Any) -> WorkerResult:
        hops, chain = subtask.hops.count, subtask.hops.chain
        return WorkerResult(answer=f"{hops}:{','.join(chain)}", num_turns=1, num_generated=0,
                            num_tool_calls=0, finish_reason="answer")


@asynccontextmanager
async def peer_app(tmp: Path, **coord: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(
        CoordinatorConfig(name="b", data_dir=str(tmp / "data"), **coord),
        worker_factory=HopWorker, admission=FakeAdmission(), pool_info=None,
    )
    async with app.router.lifespan_context(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://peer-b", timeout=30,
    ) as client:
        yield client


async def test_only_configured_peers_are_reachable() -> None:
    peers = PeerClient(["b=http://127.0.0.1:9"])
    tool = delegate_tool(peers.send)
    with pytest.raises(ToolError, match="configured peer: b"):
        await tool({"peer": "http://169.254.169.254/", "text": "steal"})
    await peers.aclose()


async def test_peers_follow_the_push_address_policy() -> None:
    peers = PeerClient(["b=http://127.0.0.1:9"], url_validator=make_push_url_validator(False))
    with pytest.raises(PeerError, match="--allow-private-push"):
        await peers.send("b", "hello")
    await peers.aclose()


def test_peer_tokens_come_from_env_or_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "tok"
    secret.write_text("file-token-123\n")
    monkeypatch.setenv("MESH_PEER_TOKEN_REVIEWER", "env-token-456")
    monkeypatch.setenv("MESH_PEER_TOKEN_BUILD_BOT_FILE", str(secret))
    specs = ["reviewer=http://10.0.0.5:8700", "build-bot=http://10.0.0.6:8700"]
    tokens = peer_tokens(specs)
    assert tokens == {"reviewer": "env-token-456", "build-bot": "file-token-123"}
    peers = PeerClient(specs, tokens=tokens)
    assert peers._http_for("http://10.0.0.6:8700").headers["authorization"] == (
        "Bearer file-token-123"
    )
    assert "authorization" not in PeerClient(["http://x.example"])._http_for("x").headers


async def test_delegated_messages_carry_hops_and_chain(tmp_path: Path) -> None:
    async with peer_app(tmp_path) as http:
        peers = PeerClient(["b=http://peer-b"], httpx_client=http, origin="a")
        assert await peers.send("b", "count my hops", Hops(1, ("x",))) == "2:x,a"


async def test_a_message_past_max_hops_is_refused_with_the_chain(tmp_path: Path) -> None:
    async with peer_app(tmp_path, max_hops=4) as http:
        msg = {"messageId": uuid.uuid4().hex, "role": "ROLE_USER", "parts": [{"text": "loop"}],
               "metadata": {"meshHops": 5, "meshChain": ["a", "b", "a", "b", "a"]}}
        r = await http.post("/", json={"jsonrpc": "2.0", "id": 1, "method": "SendMessage",
                                       "params": {"message": msg}},
                            headers={"A2A-Version": "1.0"})
        err = r.json()["error"]
        assert err["code"] == -32602
        assert "--max-hops" in err["message"] and "a -> b -> a -> b -> a -> b" in err["message"]
        peers = PeerClient(["b=http://peer-b"], httpx_client=http, origin="a")
        with pytest.raises(PeerError, match="max-hops"):
            await peers.send("b", "once more", Hops(4, ("a", "b", "a", "b")))


def test_serve_takes_max_hops_and_named_peers() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="mesh")
    serve_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--peer", "b=http://h:1"])
    assert args.max_hops == 4 and args.peer == ["b=http://h:1"]
    with pytest.raises(ValueError, match="NAME=URL"):
        CoordinatorConfig(peers=("b=ftp://h",)).validate()
