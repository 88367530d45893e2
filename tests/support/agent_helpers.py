"""A scripted fake engine and a served coordinator with an :class:`Agent` on it."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from a2a.types import a2a_pb2 as pb

from mesh.a2a.app import build_app
from mesh.a2a.config import CoordinatorConfig
from mesh.agent.task import Agent, AgentConfig
from mesh.engine.config import SamplingParams
from mesh.engine.interface import ContextOverflow, Piece, SessionState, TurnResult
from mesh.sim.fake import FakeEngine, FakeSession
from mesh.worker.types import Worker
from tests.support.coord_helpers import (
    POOL_INFO,
    FakeAdmission,
    Probe,
    ScriptedWorker,
    free_socket,
    serve_asgi,
)

Script = Callable[[str], str]


class _ScriptedGeneration:
    """Streams the script's reply word by word, with the fake pool's cell accounting."""

    def __init__(self, session: ScriptedSession, params: SamplingParams) -> None:
        self._session = session
        self._params = params
        self._closed = False
        self.result: TurnResult | None = None

    def __aiter__(self) -> AsyncIterator[Piece]:
        return self._run()

    async def aclose(self) -> None:
        self._closed = True

    async def _run(self) -> AsyncIterator[Piece]:
        s = self._session
        engine = s.engine
        assert isinstance(engine, ScriptedEngine)
        prompt = "".join(s.pending)
        s.pending = []
        s.private_cells += len(prompt.split())
        engine.turns.append((prompt, self._params))
        reply = engine.script(prompt)
        pieces = re.findall(r"\s*\S+", reply)
        start = time.monotonic()
        out: list[str] = []
        s.state = SessionState.DECODING
        for text in pieces[: self._params.max_tokens]:
            if self._closed:
                break
            if s.private_cells + 1 > engine.info.session_budget:
                raise ContextOverflow(f"session {s.id} reached its budget")
            s.private_cells += 1
            s.num_generated += 1
            out.append(text)
            yield Piece(token=len(out), text=text)
        s.state = SessionState.IDLE
        finish = "eos" if len(out) == len(pieces) else "length"
        self.result = TurnResult("".join(out), len(prompt.split()), len(out), finish,
                                 time.monotonic() - start)


class ScriptedSession(FakeSession):
    def generate(self, params: SamplingParams) -> _ScriptedGeneration:  # type: ignore[override]
        params.validate()
        return _ScriptedGeneration(self, params)


class ScriptedEngine(FakeEngine):
    """The fake pool, but each turn's text is ``script(prompt)``; ``turns`` records
    every (prompt, params) it was asked for."""

    def __init__(self, script: Script, **kw: Any) -> None:
        super().__init__(**kw)
        self.script = script
        self.turns: list[tuple[str, SamplingParams]] = []

    async def attach(self) -> ScriptedSession:
        check = self.check_attach()
        assert check.ok, check.reason
        session = ScriptedSession(self, f"s{next(self._ids)}")
        self.sessions[session.id] = session
        return session


def plan_json(*instructions: str) -> str:
    return json.dumps({"action": "delegate", "subtasks": [
        {"instructions": i, "files": ["routes.py"], "tools": ["read_file"]}
        for i in instructions]})


@dataclass
class Scripted:
    """Replies by turn kind: ``plans`` are used in order (the last repeats)."""

    plans: list[str]
    synthesis: str = "One synthesized answer."
    seen: list[str] = field(default_factory=list)

    def __call__(self, prompt: str) -> str:
        self.seen.append(prompt)
        if prompt.rstrip().endswith("Plan:"):
            return self.plans.pop(0) if len(self.plans) > 1 else self.plans[0]
        return self.synthesis


@dataclass
class AgentServed:
    url: str
    admission: FakeAdmission
    probe: Probe
    engine: Any
    agent: Agent


@contextlib.contextmanager
def serve_agent(
    data_dir: Path,
    engine: Any,
    *,
    agent_config: AgentConfig | None = None,
    worker_factory: Callable[[], Worker] | None = None,
    render: Callable[[str], str] | None = None,
    **config: Any,
) -> Iterator[AgentServed]:
    """A coordinator with an agent on ``engine``, on a real uvicorn on 127.0.0.1."""
    sock = free_socket()
    admission = FakeAdmission()
    probe = Probe()
    cfg = CoordinatorConfig(port=sock.getsockname()[1], data_dir=str(data_dir),
                            text_flush_s=0.0, allow_private_push=True, **config)
    acfg = agent_config or AgentConfig(plan=cfg.plan, tools=("read_file",))
    agent = Agent(engine, acfg, **({"render": render} if render else {}))
    app = build_app(cfg, worker_factory=worker_factory or (lambda: ScriptedWorker(probe)),
                    admission=admission, pool_info=POOL_INFO, agent=agent)
    with serve_asgi(app, sock) as url:
        yield AgentServed(url, admission, probe, engine, agent)


def reply(text: str, *, context_id: str = "", task_id: str = "") -> pb.SendMessageRequest:
    """A message continuing a context (or a task waiting for input)."""
    import uuid

    msg = pb.Message(role=pb.Role.ROLE_USER, message_id=uuid.uuid4().hex,
                     parts=[pb.Part(text=text)], context_id=context_id, task_id=task_id)
    return pb.SendMessageRequest(message=msg)
