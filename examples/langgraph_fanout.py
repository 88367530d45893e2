"""A LangGraph fan-out whose workers are pooled sessions: planner -> N workers -> join.

The planner splits a question into N sub-questions; LangGraph's ``Send`` runs one worker
node per sub-question concurrently, and each worker's model call is a session in mesh's
shared KV pool (the prefix is decoded once for all of them); the join node merges the
answers. This is the coordinator-with-sub-agents pattern, written as a LangGraph user
would write it: nothing here knows about KV caches.

    mesh serve --model tiny &            # or the default model
    python examples/langgraph_fanout.py --url http://127.0.0.1:8700 --workers 4 \\
        "How does a parcel get from the depot to the customer?"

Needs ``pip install mesh[langchain]``.
"""

from __future__ import annotations

import argparse
import asyncio
import operator
from typing import Annotated, Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import HumanMessage
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from mesh.integrations.langchain import MeshChat


class FanOut(TypedDict, total=False):
    question: str
    subquestions: list[str]
    answers: Annotated[list[tuple[int, str]], operator.add]  # workers append concurrently
    answer: str


class Job(TypedDict):
    index: int
    subquestion: str


def build_graph(model: BaseChatModel, workers: int) -> Any:
    """The compiled graph: ``await graph.ainvoke({"question": ...})``."""

    async def planner(state: FanOut) -> dict[str, Any]:
        q = state["question"]
        reply = await model.ainvoke([HumanMessage(
            f"Split this question into {workers} smaller questions, one per line:\n{q}")])
        lines = [ln.strip(" -*\t") for ln in str(reply.content).splitlines() if ln.strip()]
        subs = [ln for ln in lines if len(ln) > 3][:workers]
        # A small model may return fewer lines: the rest ask about the question itself.
        subs += [f"Part {i + 1} of {workers}: {q}" for i in range(len(subs), workers)]
        return {"subquestions": subs}

    def fan_out(state: FanOut) -> list[Send]:
        return [Send("worker", Job(index=i, subquestion=s))
                for i, s in enumerate(state["subquestions"])]

    async def worker(job: Job) -> dict[str, Any]:
        reply = await model.ainvoke([HumanMessage(f"Answer briefly: {job['subquestion']}")])
        return {"answers": [(job["index"], str(reply.content))]}

    async def join(state: FanOut) -> dict[str, Any]:
        parts = "\n".join(f"{i + 1}. {a}" for i, a in sorted(state["answers"]))
        reply = await model.ainvoke([HumanMessage(
            f"Question: {state['question']}\nAnswers to its parts:\n{parts}\n"
            "Merge them into one answer.")])
        return {"answer": str(reply.content)}

    graph = StateGraph(FanOut)
    graph.add_node("planner", planner)
    graph.add_node("worker", worker, input_schema=Job)  # type: ignore[arg-type]
    graph.add_node("join", join)
    graph.add_edge(START, "planner")
    graph.add_conditional_edges("planner", fan_out, ["worker"])
    graph.add_edge("worker", "join")
    graph.add_edge("join", END)
    return graph.compile()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("question")
    p.add_argument("--url", default="http://127.0.0.1:8700")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--token", default=None, help="bearer token (mesh serve --auth-token)")
    args = p.parse_args()
    model = MeshChat(base_url=args.url, max_tokens=args.max_tokens, api_key=args.token)
    out = await build_graph(model, args.workers).ainvoke({"question": args.question})
    for i, sub in enumerate(out["subquestions"]):
        print(f"[{i + 1}] {sub}\n    -> {dict(out['answers'])[i]}")
    print(f"\nanswer: {out['answer']}")


if __name__ == "__main__":
    asyncio.run(main())
