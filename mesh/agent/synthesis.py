"""The synthesis turn's inputs and outputs: how each worker ended (:class:`Outcome`), the
prompt, the answer, and the ``answer`` artifact's parts. Pure functions.

An answer is never a fragment (:func:`mesh.worker.text.fragment`): a synthesis that is not
whole gives way to the workers' reports, as one that echoes its instructions does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from a2a.types import a2a_pb2 as pb

from mesh.agent.plans import Plan, plan_prompt
from mesh.worker.evidence import named_files, render_evidence
from mesh.worker.text import clean, echoed, fragment, instruction_sentences, without_echo
from mesh.worker.types import WorkerResult

__all__ = ["SYNTHESIS_INSTRUCTIONS", "Outcome", "answer_parts", "direct_answer", "evidence",
           "joined_answers", "missing_note", "needs_synthesis", "summary", "synthesis_answer",
           "synthesis_prompt", "without_repeats"]

SYNTHESIS_INSTRUCTIONS = (
    "You are the coordinator. Your workers have finished; write one answer for the user "
    "from their reports. Do not repeat the reports one by one; if a worker failed, say "
    "what is missing.")

_ANSWER_CHARS = 4_000  # one worker answer, as the synthesis turn reads it


@dataclass(frozen=True)
class Outcome:
    """One subtask once its worker ended: ``result`` or ``error`` (exactly one is set)."""

    id: str
    instructions: str
    result: WorkerResult | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.result is not None

    def record(self) -> dict[str, Any]:
        """This subtask in the ``answer`` artifact's data part."""
        r = self.result
        out: dict[str, Any] = {
            "id": self.id,
            "instructions": self.instructions,
            "answer": r.answer if r else "",
            "turns": r.num_turns if r else 0,
            "tokens": r.num_generated if r else 0,
            "toolCalls": r.num_tool_calls if r else 0,
            "finishReason": r.finish_reason if r else "failed",
        }
        if self.error is not None:
            out["error"] = self.error
        return out


def summary(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """The ``subtasks`` rows of the ``answer`` artifact (see :meth:`Outcome.record`)."""
    return [o.record() for o in outcomes]


def missing_note(outcomes: Sequence[Outcome]) -> str:
    """What the answer lacks because workers failed ('' when none did)."""
    failed = [o for o in outcomes if not o.ok]
    if not failed:
        return ""
    lines = [f"- [{o.id}] {o.instructions[:120]}: {o.error}" for o in failed]
    return "Missing from this answer (the worker failed):\n" + "\n".join(lines)


def without_repeats(text: str) -> str:
    """``text`` without the paragraphs (blank-line separated) that repeat an earlier one,
    whitespace aside. Small models under greedy decoding fall into such loops; an answer
    never needs the same paragraph twice."""
    seen: set[str] = set()
    kept: list[str] = []
    for para in text.strip().split("\n\n"):
        key = " ".join(para.split())
        if not key or key in seen:
            continue
        seen.add(key)
        kept.append(para.strip("\n"))
    return "\n\n".join(kept)


def joined_answers(outcomes: Sequence[Outcome]) -> str:
    """The workers' answers under their ids (used when the synthesis turn wrote nothing)."""
    ok = [o for o in outcomes if o.result is not None and o.result.answer.strip()]
    if len(ok) == 1 and ok[0].result is not None:
        return ok[0].result.answer
    return "\n\n".join(f"[{o.id}]\n{o.result.answer}" for o in ok if o.result is not None)


def synthesis_prompt(
    message: str, plan: Plan, outcomes: Sequence[Outcome], history: str
) -> str:
    """The synthesis session's suffix: the request, the plan and how every worker ended."""
    parts = [SYNTHESIS_INSTRUCTIONS]
    if history:
        parts.append("Earlier in this conversation:\n" + history)
    parts.append("User request:\n" + message)
    reports = []
    for o in outcomes:
        body = ((o.result.answer.strip()[:_ANSWER_CHARS] or "(empty answer)")
                if o.result is not None else "(no answer)")
        reports.append(f"[{o.id}] {o.instructions}\n{_how(o)}\n{body}")
    parts.append(f"Plan: {len(plan.subtasks)} subtask(s).\n\n" + "\n\n".join(reports))
    parts.append("Answer:")
    return "\n\n".join(parts) + "\n"


def needs_synthesis(outcomes: Sequence[Outcome]) -> bool:
    """Whether a synthesis turn runs: for two or more subtasks, or when a worker failed.
    One subtask's answer is the answer (a synthesis turn could only restate it, and a
    small model restates its own prompt instead)."""
    return len(outcomes) > 1 or any(not o.ok for o in outcomes)


def _how(o: Outcome) -> str:
    if o.result is not None:
        return f"ended with {o.result.finish_reason} after {o.result.num_turns} turn(s)"
    return f"FAILED: {o.error}"


def _scaffold(plan: Plan, outcomes: Sequence[Outcome]) -> set[str]:
    """The lines of :func:`synthesis_prompt` that are its frame, not anyone's content."""
    lines = {"user request:", "answer:", "earlier in this conversation:",
             f"plan: {len(plan.subtasks)} subtask(s).", "(empty answer)", "(no answer)"}
    for o in outcomes:
        lines.add(f"[{o.id}] {o.instructions}".splitlines()[0].strip().lower())
        lines.add(_how(o).lower())
    return lines


@functools.lru_cache(maxsize=16)
def _sentences(texts: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(instruction_sentences(texts))


def synthesis_answer(text: str, plan: Plan, outcomes: Sequence[Outcome],
                     instructions: Sequence[str] = ()) -> tuple[str, str]:
    """(the answer, '' or why the workers' reports replaced the synthesis): the turn's
    text without markup, loops and repeated paragraphs; the reports
    (:func:`joined_answers`) when it is empty, not whole (:func:`fragment`) or reproduces
    its instructions (a sentence of :data:`SYNTHESIS_INSTRUCTIONS` or of
    ``instructions``, or a line of the prompt's frame: a report's header, ``Answer:``...)."""
    answer = without_repeats(clean(text))
    if not answer:
        return joined_answers(outcomes), "the synthesis wrote nothing"
    if why := fragment(answer):
        return joined_answers(outcomes), f"the synthesis is not whole ({why})"
    frame = _scaffold(plan, outcomes)
    if echoed(answer, _sentences((SYNTHESIS_INSTRUCTIONS, *instructions))) or any(
            line.strip().lower() in frame for line in answer.splitlines()):
        return joined_answers(outcomes), "the synthesis reproduced its instructions"
    return answer, ""


def direct_answer(answer: str, tools: Sequence[str], max_subtasks: int,
                  instructions: Sequence[str] = ()) -> str:
    """A plan's own answer (action ``answer``) as the user may read it: no markup, no
    loop, none of the planning prompt's sentences nor of ``instructions``."""
    texts = (plan_prompt("\n", "", tuple(tools), max_subtasks), *instructions)
    return without_echo(clean(answer), _sentences(texts))


def evidence(answer: str, outcomes: Sequence[Outcome],
             files: Sequence[str] = ()) -> list[dict[str, Any]]:
    """What ``answer`` rests on: each worker's ``data["evidence"]`` (files and lines,
    :mod:`mesh.worker.evidence`), in order, one entry per file and source; with no worker,
    the project ``files`` the answer names."""
    out: list[dict[str, Any]] = []
    for o in outcomes:
        for e in (o.result.data.get("evidence", ()) if o.result is not None else ()):
            if isinstance(e, dict) and all((e.get("path"), e.get("source"))
                                           != (u["path"], u["source"]) for u in out):
                out.append(dict(e))
    if not outcomes:
        out = [{"path": rel, "lines": "", "source": "named"}
               for rel in named_files(answer, files)]
    return out


def answer_parts(answer: str, plan: Plan, outcomes: Sequence[Outcome],
                 cited: Sequence[dict[str, Any]]) -> list[pb.Part]:
    """The ``answer`` artifact's parts: the answer's text; the data part ``{"plan": ...,
    "subtasks": [...], "evidence": [...]}`` (:func:`summary`); then, when there is any,
    the evidence as a line a client shows under the answer (a text part: a client that
    joins the text parts shows the answer, then the evidence)."""
    data = pb.Part()
    data.data.struct_value.update({"plan": plan.to_dict(),
                                   "subtasks": summary(outcomes),
                                   "evidence": list(cited)})
    parts = [pb.Part(text=answer), data]
    if line := render_evidence(cited):
        parts.append(pb.Part(text="\n\n" + line))
    return parts
