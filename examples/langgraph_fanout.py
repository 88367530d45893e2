"""A LangGraph fan-out whose workers are pooled sessions: planner -> N workers -> join.

The planner splits a question into N sub-questions; LangGraph's ``Send`` runs one worker
node per sub-question concurrently, and each worker's model call is a session in mesh's
shared KV pool (the prefix is decoded once for all of them); the join node merges the
answers. This is the coordinator-with-sub-agents pattern, written as a LangGraph user
would write it: nothing here knows about KV caches.

    mesh serve &                         # the default model (SmolLM2-135M), or --model tiny
    python examples/langgraph_fanout.py --url http://127.0.0.1:8700 --workers 4 \\
        "How does a parcel get from the depot to the customer?"

A small model writes odd text: the same sub-question three times, the question echoed
back, a sentence repeated until the token limit, markdown, now and then JSON. The graph
tidies each reply before it is used or printed (:func:`subquestions`, :func:`tidy`):
sub-questions are de-duplicated and, when the model wrote fewer than N distinct ones,
filled in from generic angles on the question (marked "filled in"); answers lose echoes,
repeats, markup and a sentence cut off by the limit; a reply with nothing left says so.

Needs ``pip install mesh[langchain]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import operator
import re
import textwrap
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import HumanMessage
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from mesh.integrations.langchain import MeshChat


class FanOut(TypedDict, total=False):
    question: str
    subquestions: list[str]
    planned: int  # how many of the sub-questions the planner wrote (the rest: ANGLES)
    answers: Annotated[list[tuple[int, str]], operator.add]  # workers append concurrently
    answer: str


class Job(TypedDict):
    index: int
    subquestion: str
    question: str  # the whole question: an answer that only restates it is no answer


# Sub-questions for when the planner wrote fewer distinct ones than there are workers:
# generic angles on any question, so each worker still has its own part.
ANGLES = (
    "What are the main steps in this: {q}",
    "Who or what takes part in this: {q}",
    "What is one example of this: {q}",
    "What can go wrong here: {q}",
    "Why does this matter: {q}",
)

_BULLET = re.compile(r"^\s*(?:[-*+\u2022]+|\(?\d{1,2}[.):]|\(?[a-z][.)])\s+", re.IGNORECASE)
_LABEL = re.compile(r"^(?:sub-?questions?|questions?|answer|q|a)\s*\d*\s*[:.)-]\s*",
                    re.IGNORECASE)
_MARKUP = re.compile(r"\*\*|__|`+|^#+\s*", re.MULTILINE)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
# A list number written inline, at the start or after a sentence or a colon ("steps: 1. ").
_INLINE_NUMBER = re.compile(r"(?:^|(?<=[.:!?]\s))\(?\d{1,2}[.)](?:\s+|$)")


def _key(text: str) -> str:
    """``text`` as a comparison key: lower-case words, no punctuation."""
    return " ".join(re.findall(r"\w+", text.casefold()))


def readable(text: str) -> str:
    """A reply as plain text: a JSON reply becomes its string values, one per line."""
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return text
    try:
        doc = json.loads(stripped)
    except ValueError:
        return text

    def strings(node: object) -> Iterable[str]:
        if isinstance(node, str):
            yield node
        elif isinstance(node, dict):
            for value in node.values():
                yield from strings(value)
        elif isinstance(node, list):
            for value in node:
                yield from strings(value)

    return "\n".join(s.strip() for s in strings(doc) if s.strip())


def _plain(line: str) -> str:
    """One line without list bullets, numbering, a "Question:" label or markdown."""
    line = _MARKUP.sub("", line)
    line = _BULLET.sub("", line)
    return _LABEL.sub("", line).strip(" \t\"'")


def subquestions(reply: str, question: str, n: int) -> tuple[list[str], int]:
    """``n`` sub-questions from the planner's ``reply``: the distinct lines it wrote, then
    ANGLES on ``question``; and how many came from the reply."""
    subs: list[str] = []
    seen: set[str] = set()
    for line in readable(reply).splitlines():
        sub = _plain(line)
        key = _key(sub)
        if len(key) < 4 or key in seen:
            continue
        seen.add(key)
        subs.append(sub)
        if len(subs) == n:
            break
    planned = len(subs)
    subs += [ANGLES[i % len(ANGLES)].format(q=question) for i in range(n - planned)]
    return subs, planned


def tidy(reply: str, echoes: Sequence[str] = ()) -> str:
    """A model's reply as one readable paragraph: JSON unpacked, markdown and list marks
    dropped, each sentence once, no sentence that restates one of ``echoes`` (the
    question it was asked), no last sentence cut off by the token limit. Empty when
    nothing is left."""
    seen: set[str] = set()
    lines: list[str] = []
    for line in (_plain(line) for line in readable(reply).splitlines()):
        if _key(line) and _key(line) not in seen:  # a list item repeated: once
            seen.add(_key(line))
            lines.append(line)
    echo_keys = [k for k in (_key(e) for e in echoes) if k]
    kept: list[str] = []
    seen.clear()
    for sentence in _SENTENCE_END.split(_INLINE_NUMBER.sub("", " ".join(lines))):
        key = _key(sentence)
        if not key or key in seen or any(e in key for e in echo_keys):
            continue
        seen.add(key)
        kept.append(sentence.strip())
    if kept and not kept[-1].endswith((".", "!", "?", ")", '"')):
        if len(kept) > 1:
            kept.pop()  # cut off by the token limit
        else:
            kept[-1] += " …"
    return " ".join(kept)


def build_graph(model: BaseChatModel, workers: int) -> Any:
    """The compiled graph: ``await graph.ainvoke({"question": ...})``; its answers are
    tidied (:func:`tidy`), empty when the model gave nothing usable."""

    async def planner(state: FanOut) -> dict[str, Any]:
        q = state["question"]
        reply = await model.ainvoke([HumanMessage(
            f"Split this question into {workers} smaller questions, one per line:\n{q}")])
        subs, planned = subquestions(str(reply.content), q, workers)
        return {"subquestions": subs, "planned": planned}

    def fan_out(state: FanOut) -> list[Send]:
        return [Send("worker", Job(index=i, subquestion=s, question=state["question"]))
                for i, s in enumerate(state["subquestions"])]

    async def worker(job: Job) -> dict[str, Any]:
        reply = await model.ainvoke([HumanMessage(
            f"Answer in one or two sentences: {job['subquestion']}")])
        answer = tidy(str(reply.content), [job["subquestion"], job["question"]])
        return {"answers": [(job["index"], answer)]}

    async def join(state: FanOut) -> dict[str, Any]:
        q = state["question"]
        parts = "\n".join(f"{i + 1}. {a or '(no answer)'}" for i, a in sorted(state["answers"]))
        reply = await model.ainvoke([HumanMessage(
            f"Question: {q}\nAnswers to its parts:\n{parts}\n"
            "Merge them into one short answer to the question.")])
        return {"answer": tidy(str(reply.content), [q, *state["subquestions"]])}

    graph = StateGraph(FanOut)
    graph.add_node("planner", planner)
    graph.add_node("worker", worker, input_schema=Job)  # type: ignore[arg-type]
    graph.add_node("join", join)
    graph.add_edge(START, "planner")
    graph.add_conditional_edges("planner", fan_out, ["worker"])
    graph.add_edge("worker", "join")
    graph.add_edge("join", END)
    return graph.compile()


def _block(text: str, indent: str = "    ") -> str:
    return textwrap.fill(text, width=96, initial_indent=indent, subsequent_indent=indent)


def report(out: FanOut) -> str:
    """What the example prints for the graph's output ``out``: the plan, each worker's
    sub-question and answer, the merged answer; plain labelled text."""
    subs = out["subquestions"]
    planned = out.get("planned", len(subs))
    answers = dict(out.get("answers", []))
    filled = len(subs) - planned
    plan = f"plan: {len(subs)} sub-questions"
    if filled:
        plan += (f", {planned} written by the planner, {filled} filled in (it wrote "
                 f"{'none' if planned == 0 else 'fewer'} distinct ones)")
    lines = [f"question: {out['question']}", plan, ""]
    for i, sub in enumerate(subs):
        tag = " (filled in)" if i >= planned else ""
        lines.append(f"[{i + 1}/{len(subs)}] {sub}{tag}")
        lines.append(_block(answers.get(i) or "(no usable answer: the reply was empty or only "
                                               "repeated the question)"))
    lines += ["", "answer:", _block(out.get("answer") or "(the model did not merge the parts "
                                                         "into an answer; see them above)")]
    return "\n".join(lines)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("question")
    p.add_argument("--url", default="http://127.0.0.1:8700")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--token", default=None, help="bearer token (mesh serve --auth-token)")
    args = p.parse_args()
    if args.workers < 1:
        p.error("--workers must be at least 1")
    model = MeshChat(base_url=args.url, max_tokens=args.max_tokens, api_key=args.token)
    out = await build_graph(model, args.workers).ainvoke({"question": args.question})
    print(report(out))


if __name__ == "__main__":
    asyncio.run(main())
