"""Chaining: talk to other A2A agents (other coordinators, or any A2A server) as peers.

:class:`PeerClient` fetches each peer's card with the SDK's card resolver, lists their
skills (the text a worker's ``delegate`` tool shows the model), and ``send(peer, text)``
sends one message with the SDK client and returns the final answer text. A peer may answer
with a ``Message`` (its text is the answer) or a ``Task``: the client follows the stream
(or polls ``GetTask`` when the peer does not stream) until the task is terminal, then reads
the answer from the task's ``answer`` artifact (mesh peers) or, failing that, every text
artifact, or the final status message. A peer task that fails, is canceled or rejected
raises :class:`PeerError` with the peer's reason.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import httpx
from a2a.client import A2ACardResolver, A2AClientError, ClientConfig, ClientFactory
from a2a.types import a2a_pb2 as pb
from a2a.utils.constants import TransportProtocol

__all__ = ["PeerClient", "PeerError", "PeerInfo", "answer_text"]

_TERMINAL = frozenset(
    {
        pb.TaskState.TASK_STATE_COMPLETED,
        pb.TaskState.TASK_STATE_FAILED,
        pb.TaskState.TASK_STATE_CANCELED,
        pb.TaskState.TASK_STATE_REJECTED,
    }
)
_ANSWER = "answer"


class PeerError(Exception):
    """The peer could not be reached, or its task did not complete."""


@dataclass(frozen=True)
class PeerInfo:
    """What a peer's card says, in the words a model needs."""

    url: str
    name: str
    description: str
    skills: tuple[tuple[str, str], ...]  # (name, description)


def _message_text(message: pb.Message) -> str:
    return "\n".join(p.text for p in message.parts if p.HasField("text"))


def answer_text(task: pb.Task) -> str:
    """The answer a terminal task carries (see the module docstring for the order)."""
    for artifact in task.artifacts:
        if artifact.artifact_id == _ANSWER or artifact.name == _ANSWER:
            return "".join(p.text for p in artifact.parts if p.HasField("text"))
    texts = ["".join(p.text for p in a.parts if p.HasField("text")) for a in task.artifacts]
    joined = "\n".join(t for t in texts if t)
    return joined or _message_text(task.status.message)


class PeerClient:
    """Cards, skills and ``send`` for a fixed list of peer base URLs.

    ``token`` is sent as a bearer token to every peer. One ``httpx.AsyncClient`` is shared
    by all calls; ``aclose`` closes it (unless it was passed in).
    """

    def __init__(
        self,
        urls: Iterable[str],
        *,
        token: str | None = None,
        timeout_s: float = 300.0,
        httpx_client: httpx.AsyncClient | None = None,
    ) -> None:
        self.urls = tuple(u.rstrip("/") for u in urls)
        self.timeout_s = timeout_s
        self._owns_http = httpx_client is None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx_client or httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0)
        )
        self._cards: dict[str, pb.AgentCard] = {}

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def card(self, url: str) -> pb.AgentCard:
        """The peer's card (fetched once, then cached)."""
        url = url.rstrip("/")
        if url not in self._cards:
            try:
                self._cards[url] = await A2ACardResolver(self._http, url).get_agent_card()
            except A2AClientError as e:
                raise PeerError(f"cannot fetch the agent card of {url}: {e}") from e
        return self._cards[url]

    async def refresh(self) -> list[PeerInfo]:
        """Fetch every peer's card again; a peer that cannot be reached raises PeerError."""
        self._cards.clear()
        infos: list[PeerInfo] = []
        for url in self.urls:
            card = await self.card(url)
            infos.append(
                PeerInfo(
                    url=url,
                    name=card.name,
                    description=card.description,
                    skills=tuple((s.name, s.description) for s in card.skills),
                )
            )
        return infos

    async def describe(self) -> str:
        """A plain-text list of peers and skills, for the ``delegate`` tool's description."""
        lines: list[str] = []
        for info in await self.refresh():
            lines.append(f"- {info.name} ({info.url}): {info.description}")
            lines.extend(f"    * {name}: {desc}" for name, desc in info.skills)
        return "\n".join(lines) if lines else "(no peers)"

    async def send(self, peer: str, text: str) -> str:
        """Send ``text`` to ``peer`` (a URL or a card name); return the final answer text."""
        url = await self._resolve(peer)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._send(url, text)
        except TimeoutError:
            raise PeerError(f"peer {url} did not finish within {self.timeout_s:.0f} s") from None
        except A2AClientError as e:
            raise PeerError(f"peer {url} failed: {e}") from e

    async def _resolve(self, peer: str) -> str:
        if peer.startswith(("http://", "https://")):
            return peer.rstrip("/")
        for url in self.urls:
            if (await self.card(url)).name == peer:
                return url
        raise PeerError(f"unknown peer {peer!r}; known: {', '.join(self.urls) or 'none'}")

    async def _send(self, url: str, text: str) -> str:
        card = await self.card(url)
        config = ClientConfig(
            httpx_client=self._http,
            streaming=card.capabilities.streaming,
            supported_protocol_bindings=[
                TransportProtocol.JSONRPC.value,
                TransportProtocol.HTTP_JSON.value,
            ],
        )
        client = ClientFactory(config).create(card)
        request = pb.SendMessageRequest(
            message=pb.Message(
                role=pb.Role.ROLE_USER,
                message_id=uuid.uuid4().hex,
                parts=[pb.Part(text=text)],
            )
        )
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
