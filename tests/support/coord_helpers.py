"""Honest fakes of the gate and the worker, and a real uvicorn server in a thread.

The fakes are driven by the subtask's instructions, so one worker factory serves every test:

* ``echo ...``/anything else: one turn, a few TEXT pieces, answer ``echo: <instructions>``;
* ``fail ...``: raises ``RuntimeError("tool exploded")`` after one turn;
* ``block ...``: waits until ``Probe.unblock`` is set (cancellable; records the detach);
* ``delegate URL TEXT``: asks the peer at URL through :class:`PeerClient` and returns its
  answer (chaining).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import uvicorn
from a2a.client import Client, ClientConfig, ClientFactory
from a2a.types import a2a_pb2 as pb
from a2a.utils.constants import TransportProtocol
from starlette.applications import Starlette

from mesh.a2a.app import build_app
from mesh.a2a.config import CoordinatorConfig
from mesh.engine.interface import PoolInfo
from mesh.gate.queue import OnPosition, QueueCheck, QueueFull
from mesh.worker.types import EventKind, Subtask, WorkerEvent, WorkerResult

S = pb.TaskState
TOKEN_A = "token-alpha-123"
TOKEN_B = "token-bravo-456"


def wait_for(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` (bounded) from a test thread."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


async def await_for(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` (bounded) from async test code."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# --------------------------------------------------------------------------- gate


@dataclass
class _Ticket:
    key: str
    owner: FakeAdmission
    released: bool = False

    async def release(self) -> None:
        if not self.released:
            self.released = True
            await self.owner._release(self.key)


class FakeAdmission:
    """N slots and a bounded FIFO queue; records every admit and release."""

    def __init__(self, slots: int = 4, max_queue: int = 8, retry_after_s: float = 3.0) -> None:
        self.slots = slots
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self.active: set[str] = set()
        self.waiting: list[tuple[str, asyncio.Future[None], OnPosition | None]] = []
        self.admitted: list[str] = []
        self.released: list[str] = []
        self.dequeued: list[str] = []  # left the queue without being admitted

    def check_queue(self, *, places: int = 1, caller: str = "") -> QueueCheck:
        ok = len(self.active) < self.slots or len(self.waiting) < self.max_queue
        return QueueCheck(ok=ok, queue_len=len(self.waiting), retry_after_s=self.retry_after_s,
                          reason="" if ok else "all slots busy")

    async def admit(
        self, key: str, on_position: OnPosition | None = None, *, accepted: bool = False,
        caller: str = "",
    ) -> _Ticket:
        if len(self.active) < self.slots and not self.waiting:
            self.active.add(key)
            self.admitted.append(key)
            return _Ticket(key, self)
        if len(self.waiting) >= self.max_queue and not accepted:
            raise QueueFull("queue is full", self.retry_after_s)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (key, future, on_position)
        self.waiting.append(entry)
        if on_position is not None:
            await on_position(len(self.waiting))
        try:
            await future
        except asyncio.CancelledError:
            if entry in self.waiting:
                self.waiting.remove(entry)
                self.dequeued.append(key)
            elif key in self.active:  # admitted and cancelled in the same breath
                self.active.discard(key)
                self.released.append(key)
            raise
        if on_position is not None:
            await on_position(0)
        return _Ticket(key, self)

    async def _release(self, key: str) -> None:
        self.active.discard(key)
        self.released.append(key)
        while self.waiting and len(self.active) < self.slots:
            next_key, future, _ = self.waiting.pop(0)
            self.active.add(next_key)
            self.admitted.append(next_key)
            future.set_result(None)

    def capacity(self) -> dict[str, Any]:
        return {"slots": self.slots, "active": len(self.active), "queued": len(self.waiting)}


# --------------------------------------------------------------------------- worker


@dataclass
class Probe:
    """Thread-safe view of what the fake workers did (the server runs in another thread)."""

    started: list[str] = field(default_factory=list)
    instructions: dict[str, str] = field(default_factory=dict)  # what each worker was given
    detached: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    unblock: threading.Event = field(default_factory=threading.Event)
    peer_token: str | None = None


class ScriptedWorker:
    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    async def run(self, subtask: Subtask, emit: Any) -> WorkerResult:
        text = subtask.instructions
        self.probe.started.append(subtask.id)
        self.probe.instructions[subtask.id] = text
        try:
            await emit(WorkerEvent(EventKind.TURN_STARTED, "turn 1", turn=1))
            if text.startswith("fail"):
                raise RuntimeError("tool exploded")
            if text.startswith("block"):
                await emit(WorkerEvent(EventKind.TOOL_CALL, 'wait(for="unblock")', turn=1))
                while not self.probe.unblock.is_set():
                    await asyncio.sleep(0.01)
                await emit(WorkerEvent(EventKind.TOOL_RESULT, "unblocked", turn=1))
                answer = "unblocked"
            elif text.startswith("delegate "):
                from mesh.fleet.peers import PeerClient

                _, url, rest = text.split(" ", 2)
                peers = PeerClient([url], token=self.probe.peer_token)
                try:
                    answer = "peer said: " + await peers.send(url, rest)
                finally:
                    await peers.aclose()
            else:
                answer = f"echo: {text}"
                for piece in ("hello", " ", "world"):
                    await emit(WorkerEvent(EventKind.TEXT, piece, turn=1))
            return WorkerResult(answer=answer, num_turns=1, num_generated=3, num_tool_calls=0,
                                finish_reason="answer")
        except asyncio.CancelledError:
            self.probe.cancelled.append(subtask.id)
            raise
        finally:
            self.probe.detached.append(subtask.id)


POOL_INFO = PoolInfo(
    model_path="/models/tiny.gguf",
    model_name="tiny",
    n_ctx=4096,
    n_seq_max=9,
    max_sessions=8,
    session_budget=256,
    n_vocab=400,
    prefix_tokens=900,
    prefix_hash="ab" * 32,
    warm_started=False,
    build_s=0.1,
)


# --------------------------------------------------------------------------- SDK client

def request(text: str = "", *, subtasks: list[dict[str, Any]] | None = None,
            immediately: bool = False) -> pb.SendMessageRequest:
    parts = [pb.Part(text=text)] if text else []
    if subtasks is not None:
        part = pb.Part()
        part.data.struct_value.update({"subtasks": subtasks})
        parts.append(part)
    req = pb.SendMessageRequest(
        message=pb.Message(role=pb.Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=parts)
    )
    req.configuration.return_immediately = immediately
    return req


@asynccontextmanager
async def sdk(
    url: str, *, streaming: bool = True, rest: bool = False, token: str | None = None
) -> AsyncIterator[Client]:
    """The SDK's plain client for ``url`` (JSON-RPC, or HTTP+JSON with ``rest``)."""
    bindings = [TransportProtocol.HTTP_JSON.value] if rest else [TransportProtocol.JSONRPC.value]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(timeout=30, headers=headers) as http:
        config = ClientConfig(httpx_client=http, streaming=streaming,
                              supported_protocol_bindings=bindings)
        client = await ClientFactory(config).create_from_url(url)
        try:
            yield client
        finally:
            await client.close()


async def send_all(client: Client, req: pb.SendMessageRequest) -> list[pb.StreamResponse]:
    return [r async for r in client.send_message(req)]


TERMINAL = {S.TASK_STATE_COMPLETED, S.TASK_STATE_FAILED, S.TASK_STATE_CANCELED,
            S.TASK_STATE_REJECTED}


async def wait_terminal(client: Client, task_id: str) -> pb.Task:
    """Poll GetTask (bounded) until the task is terminal."""
    tasks: list[pb.Task] = []

    async def fetch() -> None:
        tasks.append(await client.get_task(pb.GetTaskRequest(id=task_id)))

    for _ in range(1000):
        await fetch()
        if tasks[-1].status.state in TERMINAL:
            return tasks[-1]
        await anyio.sleep(0.01)
    raise AssertionError(f"task {task_id} stayed {tasks[-1].status.state}")


def text_of(parts: Any) -> str:
    return "".join(p.text for p in parts if p.HasField("text"))


def artifact(task: pb.Task, artifact_id: str) -> pb.Artifact:
    found = [a for a in task.artifacts if a.artifact_id == artifact_id]
    assert found, f"no artifact {artifact_id} in {[a.artifact_id for a in task.artifacts]}"
    first: pb.Artifact = found[0]
    return first


# --------------------------------------------------------------------------- server


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@dataclass
class Served:
    url: str
    app: Starlette
    admission: FakeAdmission
    probe: Probe
    config: CoordinatorConfig


@contextlib.contextmanager
def serve_asgi(app: Any, sock: socket.socket | None = None) -> Iterator[str]:
    """Any ASGI app on a real uvicorn on 127.0.0.1, in a thread; yields its base URL."""
    sock = sock or free_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), what="server start")
        assert server.started, "the server failed to start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


@contextlib.contextmanager
def serve(
    data_dir: Path,
    *,
    admission: FakeAdmission | None = None,
    probe: Probe | None = None,
    extra_routes: Any = (),
    **config: Any,
) -> Iterator[Served]:
    """A coordinator on a real uvicorn on 127.0.0.1 (a free port), in a thread."""
    sock = free_socket()
    port = sock.getsockname()[1]
    admission = admission or FakeAdmission()
    probe = probe or Probe()
    config.setdefault("allow_private_push", True)
    cfg = CoordinatorConfig(port=port, data_dir=str(data_dir), text_flush_s=0.0, **config)
    app = build_app(
        cfg,
        worker_factory=lambda: ScriptedWorker(probe),
        admission=admission,
        pool_info=POOL_INFO,
        extra_routes=extra_routes,
    )
    with serve_asgi(app, sock) as url:
        yield Served(url, app, admission, probe, cfg)
