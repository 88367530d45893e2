"""MeshChat and the LangGraph fan-out example on the real tiny model's pool."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("langgraph")

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from starlette.applications import Starlette
from starlette.types import Receive, Scope, Send

from mesh.api.openai_api import OpenAIAPI
from mesh.engine.config import EngineConfig
from mesh.engine.pool import SharedKVPool
from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from mesh.integrations.langchain import MeshChat, MeshError
from mesh.template.chat import ChatFormat

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import itertools

import langgraph_fanout

pytestmark = pytest.mark.anyio

SYSTEM = "You are one of a team of agents working on the courier project. " * 4
CHAT = ChatFormat.plain()


class Peak:
    """ASGI wrapper that records the most requests in flight at once."""

    def __init__(self, app: Any) -> None:
        self.app, self.now, self.peak, self.count = app, 0, 0, 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/chat/completions":
            self.now += 1
            self.count += 1
            self.peak = max(self.peak, self.now)
            try:
                await self.app(scope, receive, send)
            finally:
                self.now -= 1
        else:
            await self.app(scope, receive, send)


class Served:
    def __init__(self, pool: SharedKVPool) -> None:
        gate = FloorGate(pool, GateConfig.create(policy="none", max_queue=16))
        self.api = OpenAIAPI(pool, gate, CHAT, SYSTEM, tokenize=pool.tokenize)
        self.asgi = Peak(Starlette(routes=self.api.routes))
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.asgi),
                                        base_url="http://mesh", timeout=120)
        self.model = MeshChat(async_client=self.client, max_tokens=8)


@pytest.fixture
async def served(tiny_model_path: Path) -> AsyncIterator[Served]:
    cfg = EngineConfig(model_path=str(tiny_model_path), max_sessions=8, session_budget=512,
                       n_threads=1)
    pool = SharedKVPool(cfg, CHAT.prefix_text(SYSTEM))
    await pool.start()
    s = Served(pool)
    try:
        async with s.client:
            yield s
    finally:
        await s.api.aclose()
        await pool.aclose()


async def test_chat_model_turns_reuse_the_session(served: Served) -> None:
    history: list[BaseMessage] = [HumanMessage("Which file defines Parcel?")]
    metas = []
    for turn in range(3):
        reply = await served.model.ainvoke(history)
        assert isinstance(reply, AIMessage) and reply.usage_metadata is not None
        metas.append((reply.usage_metadata, reply.response_metadata["finish_reason"]))
        history += [reply, HumanMessage(f"Tool result {turn}: courier/parcel.py")]
    first = metas[0][0]
    assert first["input_token_details"].get("cache_read") == served.api.engine.info.prefix_tokens
    for (before, reason), (now, _) in itertools.pairwise(metas):
        unseen = 1 if reason == "length" else 0
        assert now["input_token_details"].get("cache_read") == (
            before["input_tokens"] + before["output_tokens"] - unseen)


async def test_one_pooled_session_per_langgraph_thread(served: Served) -> None:
    async def call(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await served.model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", call)
    graph.add_edge(START, "agent")
    app = graph.compile(checkpointer=InMemorySaver())
    cached: dict[str, list[int]] = {"a": [], "b": []}
    for step in range(2):
        for thread in ("a", "b"):
            out = await app.ainvoke({"messages": [HumanMessage(f"{thread} step {step}")]},
                                    {"configurable": {"thread_id": thread}})
            meta = out["messages"][-1].usage_metadata
            cached[thread].append(meta["input_token_details"]["cache_read"])
    prefix = served.api.engine.info.prefix_tokens
    for thread in ("a", "b"):
        # Each thread's second turn continued its own session, not a fresh one.
        assert cached[thread][0] == prefix and cached[thread][1] > prefix
    assert len(served.api.cache) == 2


async def test_langgraph_fanout_example_runs_workers_concurrently(served: Served) -> None:
    graph = langgraph_fanout.build_graph(served.model, workers=3)
    out = await graph.ainvoke({"question": "How does a parcel reach the customer?"})
    assert len(out["subquestions"]) == 3
    assert sorted(i for i, _ in out["answers"]) == [0, 1, 2]
    assert isinstance(out["answer"], str)
    assert served.asgi.count == 5  # planner, 3 workers, join
    assert served.asgi.peak >= 2  # the workers' requests overlapped: concurrent sessions


async def test_errors_surface_as_mesh_error(served: Served) -> None:
    model = MeshChat(async_client=served.client, max_tokens=10**6)
    with pytest.raises(MeshError) as err:
        await model.ainvoke([HumanMessage("hi")])
    assert err.value.status == 400 and err.value.code == "context_length_exceeded"


async def test_bound_tools_come_back_as_tool_calls_a_tool_node_runs(served: Served) -> None:
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool
    from langgraph.prebuilt import ToolNode

    seen: list[str] = []

    @tool
    def read_file(path: str) -> str:
        """Read a file of the project."""
        seen.append(path)
        return f"contents of {path}"

    bound = served.model.bind_tools([read_file], tool_choice="read_file", max_tokens=240,
                                    temperature=1.0)
    async def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [await bound.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([read_file]))
    graph.add_edge(START, "agent")
    graph.add_edge("agent", "tools")
    state = await graph.compile().ainvoke({"messages": [HumanMessage("Read the parcels.")]})
    human, reply, result = state["messages"]
    assert isinstance(reply, AIMessage)
    assert [c["name"] for c in reply.tool_calls] == ["read_file"], reply
    assert isinstance(reply.tool_calls[0]["args"]["path"], str)
    assert isinstance(result, ToolMessage) and seen == [reply.tool_calls[0]["args"]["path"]]
    # The tool's answer goes back; the model may now answer in prose.
    after = await served.model.bind_tools([read_file], tool_choice="none").ainvoke(
        [human, reply, result])
    assert isinstance(after, AIMessage) and after.tool_calls == []
