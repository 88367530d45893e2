"""Chaining: one coordinator's worker delegates to another over A2A (two real servers)."""

from __future__ import annotations

from pathlib import Path

import pytest
from a2a.types import a2a_pb2 as pb

from mesh.fleet.peers import PeerClient, PeerError
from tests.support.coord_helpers import (
    TOKEN_B,
    Probe,
    artifact,
    request,
    sdk,
    send_all,
    serve,
    text_of,
)

pytestmark = pytest.mark.anyio


async def test_a_worker_delegates_to_a_peer_coordinator(tmp_path: Path) -> None:
    with (
        serve(tmp_path / "b", auth_token=TOKEN_B, name="peer-b") as peer,
        serve(tmp_path / "a", probe=Probe(peer_token=TOKEN_B)) as front,
    ):
        for streaming in (True, False):
            async with sdk(front.url, streaming=streaming) as client:
                events = await send_all(client, request(f"delegate {peer.url} look it up"))
                task = await client.get_task(pb.GetTaskRequest(id=events[0].task.id))
            assert task.status.state == pb.TaskState.TASK_STATE_COMPLETED
            assert text_of(artifact(task, "answer").parts) == "peer said: echo: look it up"
        assert len(peer.probe.started) == 2  # the peer really ran the work


async def test_peer_client_lists_skills_and_reports_failures(tmp_path: Path) -> None:
    with serve(tmp_path / "b", name="peer-b") as peer:
        peers = PeerClient([peer.url])
        try:
            text = await peers.describe()
            assert f"peer-b ({peer.url})" in text and "Delegated work" in text
            assert await peers.send("peer-b", "by name") == "echo: by name"
            with pytest.raises(PeerError, match="failed: subtask s1 failed: tool exploded"):
                await peers.send(peer.url, "fail please")
            with pytest.raises(PeerError, match="unknown peer"):
                await peers.send("nobody", "x")
        finally:
            await peers.aclose()
    unreachable = PeerClient([peer.url], timeout_s=5)
    try:
        with pytest.raises(PeerError, match="cannot fetch the agent card"):
            await unreachable.refresh()
    finally:
        await unreachable.aclose()
