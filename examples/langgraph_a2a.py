"""A LangGraph agent that hands a task to the mesh coordinator over A2A (official SDK client).

The graph's ``delegate`` node sends the question to the coordinator as an A2A message and
waits for the task to finish (the coordinator plans, runs pooled sub-agents, synthesizes);
the ``report`` node formats its answer artifact. Any A2A agent could stand in for mesh.

    mesh serve &
    python examples/langgraph_a2a.py --url http://127.0.0.1:8700 "Which file defines Parcel?"

Needs ``pip install mesh[langchain]``.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from typing import Any, TypedDict

import httpx
from a2a.client import ClientConfig, ClientFactory
from a2a.types import a2a_pb2 as pb
from a2a.utils.constants import TransportProtocol
from langgraph.graph import END, START, StateGraph


class Delegation(TypedDict, total=False):
    question: str
    state: str
    answer: str
    report: str


def _text(parts: Any) -> str:
    return "".join(p.text for p in parts if p.HasField("text"))


async def ask_agent(url: str, question: str, token: str | None = None) -> tuple[str, str]:
    """Send ``question`` to the A2A agent at ``url``; (final state name, answer text)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(headers=headers, timeout=600) as http:
        config = ClientConfig(httpx_client=http, streaming=False, supported_protocol_bindings=[
            TransportProtocol.JSONRPC.value, TransportProtocol.HTTP_JSON.value])
        client = await ClientFactory(config).create_from_url(url.rstrip("/"))
        try:
            request = pb.SendMessageRequest(message=pb.Message(
                role=pb.Role.ROLE_USER, message_id=uuid.uuid4().hex,
                parts=[pb.Part(text=question)]))
            task_id = ""
            async for response in client.send_message(request):
                if response.HasField("message"):
                    return "completed", _text(response.message.parts)
                if response.HasField("task"):
                    task_id = response.task.id
            task = await client.get_task(pb.GetTaskRequest(id=task_id))
        finally:
            await client.close()
    answer = "\n".join(_text(a.parts) for a in task.artifacts
                       if not a.artifact_id.startswith("stream-"))
    return pb.TaskState.Name(task.status.state).removeprefix("TASK_STATE_").lower(), answer


def build_graph(url: str, token: str | None = None) -> Any:
    async def delegate(state: Delegation) -> dict[str, Any]:
        status, answer = await ask_agent(url, state["question"], token)
        return {"state": status, "answer": answer}

    def report(state: Delegation) -> dict[str, Any]:
        return {"report": f"mesh ({state['state']}): {state['answer']}"}

    graph = StateGraph(Delegation)
    graph.add_node("delegate", delegate)
    graph.add_node("report", report)
    graph.add_edge(START, "delegate")
    graph.add_edge("delegate", "report")
    graph.add_edge("report", END)
    return graph.compile()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("question")
    p.add_argument("--url", default="http://127.0.0.1:8700")
    p.add_argument("--token", default=None)
    args = p.parse_args()
    out = await build_graph(args.url, args.token).ainvoke({"question": args.question})
    print(out["report"])


if __name__ == "__main__":
    asyncio.run(main())
