"""The worker of a node coordinator: one subtask sent over A2A to the node it was given.

:class:`NodeWorker` sends the subtask as an explicit one-entry subtask list (so the node
runs it as one worker, with no planning turn of its own), follows the node's stream
(its status lines become this subtask's status lines, its generated text this subtask's
text), and reads the answer from the node's ``answer`` artifact.

A node that cannot be reached or drops the stream (:class:`NodeUnreachable`) is marked
down; a node whose task fails (:class:`NodeTaskFailed`) stays up. Either way the subtask
is retried **once** on another node (:meth:`NodePool.reassign`, ahead of the queue) and the
client sees both in the task's status ("node X failed: ...; retrying on node Y"). A second
failure fails the subtask with both reasons.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import httpx
from a2a.client import A2ACardResolver, A2AClientError, ClientConfig, ClientFactory
from a2a.types import a2a_pb2 as pb
from a2a.utils.constants import TransportProtocol
from a2a.utils.errors import A2AError
from google.protobuf.json_format import MessageToDict

from mesh.agent.events import ANSWER_ARTIFACT
from mesh.agent.subtasks import local_id
from mesh.fleet.hops import hops_metadata
from mesh.fleet.node_cards import Node
from mesh.fleet.nodes import NodePool
from mesh.fleet.peer_guard import confine_card
from mesh.fleet.peers import answer_text
from mesh.worker.types import Emit, EventKind, Subtask, WorkerEvent, WorkerResult

__all__ = ["NodeClient", "NodeTaskFailed", "NodeUnreachable", "NodeWorker"]

_TERMINAL = frozenset({pb.TaskState.TASK_STATE_COMPLETED, pb.TaskState.TASK_STATE_FAILED,
                       pb.TaskState.TASK_STATE_CANCELED, pb.TaskState.TASK_STATE_REJECTED})


class NodeUnreachable(Exception):
    """The node did not answer or dropped the stream mid-subtask."""


class NodeTaskFailed(Exception):
    """The node answered, and its task did not complete."""


def _text(message: pb.Message) -> str:
    return "\n".join(p.text for p in message.parts if p.HasField("text"))


class NodeClient:
    """A2A to the nodes: cards cached, one httpx client for the client's life (made on
    first use, on the loop that serves; closed by :meth:`aclose`)."""

    def __init__(self, *, token: str | None = None, origin: str = "mesh",
                 timeout_s: float = 600.0) -> None:
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout_s = timeout_s
        self.origin = origin
        self._http: httpx.AsyncClient | None = None
        self._closed = False
        self._cards: dict[str, pb.AgentCard] = {}

    @property
    def http(self) -> httpx.AsyncClient:
        """The one client (RuntimeError once closed: no subtask runs after shutdown)."""
        if self._closed:
            raise RuntimeError("the node client is closed (aclose was called); build a new "
                               "NodeClient to reach the nodes")
        if self._http is None:
            self._http = httpx.AsyncClient(
                headers=self._headers, timeout=httpx.Timeout(self._timeout_s, connect=5.0))
        return self._http

    async def aclose(self) -> None:
        """Close the client. Idempotent."""
        self._closed = True
        http, self._http = self._http, None
        if http is not None:
            await http.aclose()

    async def _card(self, url: str) -> pb.AgentCard:
        if url not in self._cards:
            self._cards[url] = await A2ACardResolver(self.http, url).get_agent_card()
        return self._cards[url]

    def _message(self, subtask: Subtask) -> pb.Message:
        data = pb.Part()
        data.data.struct_value.update({"subtasks": [{
            "id": local_id(subtask), "instructions": subtask.instructions,
            "params": dict(subtask.params)}]})
        message = pb.Message(role=pb.Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=[data])
        message.metadata.update(hops_metadata(subtask.hops.onward(self.origin)))
        return message

    async def run(self, node: Node, subtask: Subtask, emit: Emit) -> tuple[pb.Task, str]:
        """Run ``subtask`` on ``node``; (the node's terminal task, its answer text)."""
        try:
            card = await self._card(node.url)
            config = ClientConfig(httpx_client=self.http, streaming=True,
                                  supported_protocol_bindings=[
                                      TransportProtocol.JSONRPC.value,
                                      TransportProtocol.HTTP_JSON.value])
            # The node's configured address, not whatever its card names (the token
            # goes nowhere else): see peer_guard.
            client = ClientFactory(config).create(confine_card(card, node.url)[0])
        except (httpx.HTTPError, A2AClientError, A2AError, ValueError) as exc:
            raise NodeUnreachable(f"{type(exc).__name__}: {exc}") from exc
        task_id = ""
        try:
            state = pb.TaskState.TASK_STATE_UNSPECIFIED
            request = pb.SendMessageRequest(message=self._message(subtask))
            async for response in client.send_message(request):
                if response.HasField("task"):
                    task_id, state = response.task.id, response.task.status.state
                elif response.HasField("status_update"):
                    task_id = response.status_update.task_id
                    state = response.status_update.status.state
                    text = _text(response.status_update.status.message)
                    if text and state not in _TERMINAL:
                        await emit(WorkerEvent(EventKind.STATUS, f"{node.url}: {text}"))
                elif response.HasField("artifact_update"):
                    art = response.artifact_update.artifact
                    if art.artifact_id.startswith("stream-"):
                        for part in art.parts:
                            if part.HasField("text") and part.text:
                                await emit(WorkerEvent(EventKind.TEXT, part.text))
                if state in _TERMINAL:
                    break
            if not task_id or state not in _TERMINAL:
                raise NodeUnreachable("the stream ended before the task did")
            task = await client.get_task(pb.GetTaskRequest(id=task_id))
        except asyncio.CancelledError:
            if task_id:
                await _cancel_quietly(client, task_id)
            raise
        except (httpx.HTTPError, A2AClientError, A2AError) as exc:
            raise NodeUnreachable(f"{type(exc).__name__}: {exc}") from exc
        finally:
            await client.close()
        if task.status.state != pb.TaskState.TASK_STATE_COMPLETED:
            name = pb.TaskState.Name(task.status.state).removeprefix("TASK_STATE_").lower()
            raise NodeTaskFailed(f"task {task_id} {name}: {_text(task.status.message)}")
        return task, answer_text(task)


async def _cancel_quietly(client: Any, task_id: str) -> None:
    with contextlib.suppress(httpx.HTTPError, A2AClientError, A2AError, TimeoutError):
        async with asyncio.timeout(2.0):
            await asyncio.shield(client.cancel_task(pb.CancelTaskRequest(id=task_id)))


def _summary(task: pb.Task) -> dict[str, Any]:
    """The node's own subtask row (``turns``, ``tokens``...) from its answer's data part."""
    for art in task.artifacts:
        if art.artifact_id == ANSWER_ARTIFACT:
            for part in art.parts:
                if part.HasField("data"):
                    data = MessageToDict(part.data)
                    rows = data.get("subtasks") if isinstance(data, dict) else None
                    if isinstance(rows, list) and rows and isinstance(rows[0], dict):
                        return rows[0]
    return {}


class NodeWorker:
    """A :class:`~mesh.worker.types.Worker` running its subtask on the node the pool gave
    it, retried once on another node (see the module docstring)."""

    def __init__(self, pool: NodePool, client: NodeClient) -> None:
        self._pool = pool
        self._client = client

    async def run(self, subtask: Subtask, emit: Emit) -> WorkerResult:
        ticket = self._pool.assigned(subtask.id)
        reasons: list[str] = []
        for attempt in range(2):
            node = ticket.node
            await emit(WorkerEvent(EventKind.STATUS, f"routed to node {node.url}",
                                   data={"node": node.url}))
            try:
                task, answer = await self._client.run(node, subtask, emit)
            except NodeUnreachable as exc:
                self._pool.node_failed(node, str(exc))
                reasons.append(f"node {node.url} failed: {exc}")
            except NodeTaskFailed as exc:
                self._pool.answered(node)
                reasons.append(f"node {node.url} failed: {exc}")
            else:
                self._pool.answered(node)
                row = _summary(task)
                # A node of the release before one task path names them numTurns...
                return WorkerResult(
                    answer=answer, num_turns=int(row.get("turns", row.get("numTurns", 0))),
                    num_generated=int(row.get("tokens", row.get("numGenerated", 0))),
                    num_tool_calls=int(row.get("toolCalls", row.get("numToolCalls", 0))),
                    finish_reason=str(row.get("finishReason", "answer")),
                    data={"node": node.url, "retried": attempt > 0})
            if attempt == 0:
                await emit(WorkerEvent(EventKind.STATUS,
                                       f"{reasons[-1]}; retrying once on another node"))
                new = await self._pool.reassign(ticket)
                await emit(WorkerEvent(EventKind.STATUS, f"retrying on node {new.url}"))
        raise RuntimeError("; ".join(reasons))
