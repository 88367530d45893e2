"""Agent behaviour on the sample project: checkable questions, each an A2A task.

For every (model, template, plan mode), this starts a real ``mesh serve`` subprocess (on a
free port, a fresh data dir, the shipped sample project), sends each question as an A2A
task (streaming, so the tool events are seen), and checks the answer. There are two kinds
of question: :data:`QUESTIONS` (one fact, found as a case-insensitive substring) and
:data:`MULTI_QUESTIONS` (multi-part: each needs two or more files, and the answer must hold
every fact, as whole words). Per run it reports:

* ``parse_rate``: well-formed tool calls / all tool calls written (a call is malformed when
  the worker answers it with "could not read the tool call" or "unknown tool"; 1.0 when no
  call was written);
* ``tool_call_share``: turns that ran a tool / all turns;
* ``success_rate`` (all tasks), ``single_success_rate``, ``multi_success_rate``;
* ``subtasks_per_task``, ``mean_turns``, ``mean_tokens`` (generated per task),
  ``p50_task_s``, ``p95_task_s``;
* what the shared prefix saved, from the pool's counters (``/capacity`` ``pool_totals``
  before and after the run, see :class:`PrefixUse`): ``sessions_per_task`` (planner,
  workers and synthesis: every session the task attached), ``prefix_saved_per_task``
  (prefix tokens x sessions: prompt tokens not prefilled), ``prefilled_per_task`` (suffix
  tokens actually prefilled) and ``prefix_saved_share`` = saved / (saved + prefilled).
  With ``--concurrency 1`` every task's own numbers are in its row of ``tasks`` too.
* answer quality (:func:`answer_quality`, the same measure for a run and for stored
  results): ``loop_share``, the answers holding a phrase of >= 8 words 3 or more times,
  and ``echo_share``, the answers holding a sentence of >= 8 words of the instructions the
  task's turns were given (the template's system, instruction and tool-result text, the
  planning and the synthesis prompts; never the question itself).
  ``--rescore FILE...`` computes both from the answers stored in earlier results.

Usage (what the committed bench/agent/results/agent.json was made with is in its ``command``)::

    python -m bench.agent --models gemma,smollm2 --templates light,heavy
    python -m bench.agent --plans never,auto --concurrency 1   # per-task prefix use
    python -m bench.agent --limit 5 --max-turns 2   # quicker: 5 of each kind
    python -m bench.agent --rescore bench/agent/results/agent_*.json --out Q.json
    python -m bench.agent --quick   # 2 questions on the tiny model: seconds, not a measurement

``--quick`` (:data:`QUICK`; flags given as well still win) checks that the bench runs end to
end: every task comes back with a checked verdict. The tiny model's answers are random, so
it says nothing about accuracy; without ``--out`` it writes to a temporary path
(:data:`QUICK_OUT`), never over a committed result.

``--max-turns``/``--max-tokens-per-turn`` run a copy of each template with those limits
(``--prefix-tokens`` shrinks the prefix too), so a CPU run stays short.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mesh.worker.text import echoed, has_loop, instruction_sentences

# (question, expected text in the answer)
QUESTIONS: tuple[tuple[str, str], ...] = (
    ("Which file defines the class Parcel?", "parcels.py"),
    ("Which file defines the class Courier?", "dispatch.py"),
    ("Which file defines the class Route?", "routes.py"),
    ("Which file defines the function plan_route?", "routes.py"),
    ("Which file defines the function dispatch?", "dispatch.py"),
    ("Which file defines the function distance?", "parcels.py"),
    ("Which file defines the function group_by_destination?", "parcels.py"),
    ("Which file defines the function nearest_neighbour?", "routes.py"),
    ("Which file defines the function two_opt?", "routes.py"),
    ("Which file defines the class Stop?", "parcels.py"),
    ("Which file defines the exception ParcelError?", "parcels.py"),
    ("Which file defines the class Plan?", "dispatch.py"),
    ("What is the value of the constant MAX_WEIGHT_KG?", "30"),
    ("Which exception does Parcel raise when its weight is out of range?", "ParcelError"),
    ("Which exception does Parcel raise when its id is empty?", "ParcelError"),
    ("What is the base class of ParcelError?", "ValueError"),
    ("What is the default value of max_rounds in two_opt?", "20"),
    ("What is the default weight_kg of a Parcel?", "1.0"),
    ("What is the default priority of a Parcel?", "0"),
    ("Which test checks that a too heavy parcel is reported, not dropped?",
     "test_heavy_parcel_is_reported_not_dropped"),
    ("Which test checks that a route visits every stop once?",
     "test_route_visits_every_stop_once"),
    ("Which test checks that the closest courier with room wins?",
     "test_closest_courier_with_room_wins"),
    ("Which test checks that a parcel's weight is validated?", "test_parcel_weight_is_checked"),
    ("Which file holds the tests of the sample project?", "test_sample_courier.py"),
    ("What kind of distance does the function distance compute?", "Manhattan"),
    ("Which field of Courier says how much it can carry?", "capacity_kg"),
    ("Which field of Plan lists the parcels nobody could carry?", "unassigned"),
    ("Which field of Stop holds the ids of the parcels delivered there?", "parcel_ids"),
    ("From which module does courier/dispatch.py import plan_route?", "courier.routes"),
    ("What route length does test_route_visits_every_stop_once assert?", "10"),
    ("What is the name of the courier in the README's usage example?", "ana"),
    ("How many tests passed in the latest test results?", "4"),
)

# Multi-part questions: each needs two or more files of templates/sample, and its answer
# must hold every fact (case-insensitive, whole words; "a|b" accepts either). None of the
# facts is written in the question itself, so echoing the question does not pass.
# (question, facts, files the facts come from)
MULTI_QUESTIONS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("Which function does dispatch() use to find the closest courier, in which file is that "
     "function defined, and what kind of distance does it compute?",
     ("parcels.py", "Manhattan"), ("dispatch.py", "parcels.py")),
    ("Which function in routes.py does dispatch.py call to build each route, and which two "
     "functions does that function call?",
     ("plan_route", "nearest_neighbour|nearest neighbour", "two_opt|2-opt"),
     ("dispatch.py", "routes.py")),
    ("Which function does dispatch.py use to turn a courier's parcels into stops, in which "
     "file is it defined, and which field of Stop holds the ids delivered there?",
     ("group_by_destination", "parcels.py", "parcel_ids"), ("dispatch.py", "parcels.py")),
    ("Which test checks that a too heavy parcel is reported, not dropped, and which field of "
     "the Plan returned by dispatch holds such a parcel?",
     ("test_heavy_parcel_is_reported_not_dropped", "unassigned"),
     ("tests/test_sample_courier.py", "dispatch.py")),
    ("What does test_parcel_weight_is_checked expect to be raised, and what is the base "
     "class of that exception?",
     ("ParcelError", "ValueError"), ("tests/test_sample_courier.py", "parcels.py")),
    ("What route length does test_route_visits_every_stop_once assert, and what kind of "
     "distance is that length summed from?",
     ("10", "Manhattan"), ("tests/test_sample_courier.py", "routes.py", "parcels.py")),
    ("In test_closest_courier_with_room_wins, which courier gets the parcel, and which "
     "field of Courier limits how much a courier can carry?",
     ("ben", "capacity_kg"), ("tests/test_sample_courier.py", "dispatch.py")),
    ("Which courier does the README's usage example use, and in which file of the package "
     "is the function it calls to plan the deliveries defined?",
     ("ana", "dispatch.py"), ("README.md", "dispatch.py")),
    ("From which module does courier/dispatch.py import Parcel, and what is the default "
     "weight_kg of a Parcel?",
     ("courier.parcels", "1.0"), ("dispatch.py", "parcels.py")),
    ("Which function in routes.py does dispatch() call, which module defines the Parcel "
     "class that dispatch() is given, and what does a Parcel raise for a weight of 40 kg?",
     ("plan_route", "parcels", "ParcelError"), ("dispatch.py", "routes.py", "parcels.py")),
    ("In which file is the parcel weight checked, what happens to a parcel of 40 kg, and "
     "where does dispatch put a 20 kg parcel that no courier has room for?",
     ("parcels.py", "ParcelError", "unassigned"), ("parcels.py", "dispatch.py")),
)


@dataclass(frozen=True)
class Question:
    """One checkable question: the answer must hold every fact (see :func:`check`)."""

    text: str
    facts: tuple[str, ...]
    multi: bool = False
    files: tuple[str, ...] = ()


def questions(which: str = "all", limit: int = 0) -> list[Question]:
    """The single questions, then the multi-part ones; ``limit`` keeps the first N of each."""
    single = [Question(q, (e,)) for q, e in QUESTIONS]
    multi = [Question(q, f, True, files) for q, f, files in MULTI_QUESTIONS]
    if limit:
        single, multi = single[:limit], multi[:limit]
    return {"single": single, "multi": multi, "all": single + multi}[which]


def _holds(answer: str, fact: str, whole_words: bool) -> bool:
    for alt in fact.split("|"):
        if not whole_words:
            if alt.lower() in answer.lower():
                return True
            continue
        lead = r"(?<!\w)" if alt[0].isalnum() else ""
        tail = r"(?![\w])" if alt[-1].isalnum() else ""
        if re.search(lead + re.escape(alt) + tail, answer, re.I):
            return True
    return False


def check(answer: str, question: Question) -> list[str]:
    """The facts ``answer`` lacks ([] when it holds them all). Single questions keep the
    plain substring test their results were first measured with; multi-part facts must be
    whole words ("10" is not found in "100", "parcels" not in "parcels_x", but in
    "courier.parcels")."""
    return [f for f in question.facts if not _holds(answer, f, question.multi)]

_MALFORMED = ("could not read the tool call", "unknown tool", "tool call longer than")


@functools.lru_cache(maxsize=8)
def prompt_sentences(template: str) -> tuple[str, ...]:
    """The instruction sentences (>= 8 words) a task's turns are given with ``template``:
    its own texts (system, instructions, tool results; the request left out), the planning
    prompt (free and guided) and the synthesis prompt."""
    from mesh.agent.plans import plan_prompt
    from mesh.agent.synthesis import SYNTHESIS_INSTRUCTIONS
    from mesh.template.loader import load_template
    from mesh.worker.text import template_texts

    t = load_template(template)
    tools = tuple(t.manifest.tools.enabled)
    texts = [*template_texts(t), SYNTHESIS_INSTRUCTIONS,
             plan_prompt("\n", "", tools, 4), plan_prompt("\n", "", tools, 4, ("\n",))]
    return tuple(instruction_sentences(texts))


def answer_quality(answer: str, template: str) -> tuple[bool, bool]:
    """(loop, echo) of one answer: a phrase of >= 8 words comes 3 or more times; it holds a
    sentence of >= 8 words of the instructions (:func:`prompt_sentences`)."""
    return has_loop(answer), bool(echoed(answer, prompt_sentences(template)))


@dataclass
class TaskOutcome:
    question: str
    expected: str  # the facts, " + "-joined
    answer: str
    state: str
    ok: bool
    multi: bool = False
    missing: list[str] = field(default_factory=list)
    turns: int = 0
    tokens: int = 0
    tool_calls: int = 0
    malformed_calls: int = 0
    finish_reason: str = ""
    seconds: float = 0.0
    subtasks: int = 0
    # From /capacity pool_totals before and after this task (only at --concurrency 1,
    # where nothing else runs meanwhile); None otherwise.
    sessions: int | None = None
    prefilled_tokens: int | None = None
    prefix_saved_tokens: int | None = None
    loop: bool = False  # the answer repeats a phrase of >= 8 words 3+ times
    echo: bool = False  # the answer holds a sentence of >= 8 words of the instructions
    evidence: str = ""  # the answer artifact's evidence part (files and lines), not checked


EVIDENCE_PREFIX = "Evidence: "


def split_evidence(texts: list[str]) -> tuple[str, str]:
    """(answer, evidence) from the text parts of the ``answer`` artifact, in order: the
    answer streams as chunks, then one part says its evidence (``Evidence: path lines
    …``; :func:`mesh.worker.evidence.render_evidence`). The checker reads the answer
    alone: a file named in the evidence is not the model saying it."""
    answer = [t for t in texts if not t.strip().startswith(EVIDENCE_PREFIX)]
    evidence = [t.strip() for t in texts if t.strip().startswith(EVIDENCE_PREFIX)]
    return "".join(answer).strip(), "\n".join(evidence)


@dataclass
class PairResult:
    model: str
    template: str
    plan: str = "never"
    chat_format: str = ""
    tasks: list[TaskOutcome] = field(default_factory=list)
    prefix: PrefixUse | None = None

    def summary(self) -> dict[str, Any]:
        t = self.tasks
        calls = sum(x.tool_calls for x in t)
        bad = sum(x.malformed_calls for x in t)
        turns = sum(x.turns for x in t)
        single = [x for x in t if not x.multi]
        multi = [x for x in t if x.multi]
        return {
            "model": self.model,
            "template": self.template,
            "plan": self.plan,
            "chat_format": self.chat_format,
            "tasks": len(t),
            "parse_rate": round(calls / (calls + bad), 4) if calls + bad else 1.0,
            "tool_call_share": round(calls / turns, 4) if turns else 0.0,
            "success_rate": _rate(t),
            "single_tasks": len(single),
            "single_success_rate": _rate(single),
            "multi_tasks": len(multi),
            "multi_success_rate": _rate(multi),
            "mean_turns": round(statistics.fmean(x.turns for x in t), 2) if t else 0.0,
            "mean_tokens": round(statistics.fmean(x.tokens for x in t), 1) if t else 0.0,
            "p50_task_s": round(statistics.median(x.seconds for x in t), 2) if t else 0.0,
            "p95_task_s": round(_p95([x.seconds for x in t]), 2) if t else 0.0,
            "loop_share": _share(t, "loop"),
            "echo_share": _share(t, "echo"),
            "subtasks_per_task": round(statistics.fmean(x.subtasks for x in t), 2) if t else 0.0,
            "finish_reasons": _count(x.finish_reason or x.state for x in t),
            **(self.prefix.summary(len(t)) if self.prefix else PrefixUse.unmeasured()),
        }


@dataclass(frozen=True)
class PrefixUse:
    """What the shared prefix saved over one run, from the pool's own counters: sessions
    attached and suffix tokens prefilled (``/capacity`` ``pool_totals``, before and after
    the run) and the prefix length (``kv_cells.prefix``, 0 for a naive pool). Every session
    (planner, worker, synthesis) shares the prefix instead of prefilling it: it saves
    ``prefix_tokens`` prompt tokens each."""

    prefix_tokens: int
    sessions: int
    prefilled: int

    @property
    def saved(self) -> int:
        return self.prefix_tokens * self.sessions

    def summary(self, tasks: int) -> dict[str, Any]:
        n = max(tasks, 1)
        total = self.saved + self.prefilled
        return {
            "prefix_tokens": self.prefix_tokens,
            "sessions_per_task": round(self.sessions / n, 2),
            "prefix_saved_per_task": round(self.saved / n, 1),
            "prefilled_per_task": round(self.prefilled / n, 1),
            "prefix_saved_share": round(self.saved / total, 4) if total else None,
            "prefix_source": "measured: /capacity pool_totals (sessions_attached, "
                             "prefill_tokens) before and after the run; kv_cells.prefix",
        }

    @staticmethod
    def unmeasured() -> dict[str, Any]:
        return {"prefix_tokens": None, "sessions_per_task": None, "prefix_saved_per_task": None,
                "prefilled_per_task": None, "prefix_saved_share": None,
                "prefix_source": "unmeasured: the server reports no pool_totals"}


def _share(tasks: list[TaskOutcome], flag: str) -> float | None:
    return round(sum(bool(getattr(x, flag)) for x in tasks) / len(tasks), 4) if tasks else None


def _rate(tasks: list[TaskOutcome]) -> float | None:
    return round(sum(x.ok for x in tasks) / len(tasks), 4) if tasks else None


def _p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "agent.json"
QUICK_OUT = Path(tempfile.gettempdir()) / "mesh-bench" / "agent.json"
# --quick: two single questions to one `mesh serve --model tiny` with short turns and a
# short prefix (about 15 s on 2 cores).
QUICK: dict[str, Any] = {"models": "tiny", "templates": "light", "plans": "never",
                         "questions": "single", "limit": 2, "max_turns": 2,
                         "max_tokens_per_turn": 16, "prefix_tokens": 256, "concurrency": 2,
                         "task_timeout": 120.0}

def _template_copy(name: str, dest: Path, args: argparse.Namespace) -> str:
    """The shipped template, or a copy with the run's turn limits."""
    if args.max_turns is None and args.max_tokens_per_turn is None:
        return name
    from mesh.template.loader import export_template

    root = export_template(name, dest / name)
    toml = (root / "template.toml").read_text()
    if args.max_turns is not None:
        toml = re.sub(r"(?m)^max_turns = \d+", f"max_turns = {args.max_turns}", toml)
    if args.max_tokens_per_turn is not None:
        toml = re.sub(r"(?m)^max_tokens_per_turn = \d+",
                      f"max_tokens_per_turn = {args.max_tokens_per_turn}", toml)
    (root / "template.toml").write_text(toml)
    return str(root)


class Server:
    """A ``mesh serve`` child process; stopped (and waited for) on exit."""

    def __init__(self, model: str, template: str, data_dir: Path, prefix_tokens: int | None,
                 plan: str = "never", extra: tuple[str, ...] = ()):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "mesh", "serve", "--port", str(self.port),
               "--template", template, "--data-dir", str(data_dir), "--max-sessions", "4"]
        # "delegate": plans that must use workers (--plan-actions delegate)
        cmd += (["--plan", "auto", "--plan-actions", "delegate"] if plan == "delegate"
                else ["--plan", plan])
        if model != "default":
            cmd += ["--model", model]
        if prefix_tokens is not None:
            cmd += ["--prefix-tokens", str(prefix_tokens)]
        cmd += list(extra)
        self.log = data_dir / "serve.log"
        data_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "MESH_MODEL": ""}
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=data_dir)

    async def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=5) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"mesh serve exited:\n{self.log.read_text()[-2000:]}")
                try:
                    r = await http.get(self.url + "/.well-known/agent-card.json")
                    if r.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        raise RuntimeError(f"mesh serve did not start in {timeout_s:.0f} s")

    def chat_format(self) -> str:
        m = re.search(r"^chat format: (.*?);", self.log.read_text(), re.M)
        return m.group(1) if m else "?"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def _totals(http: httpx.AsyncClient, url: str) -> tuple[int, int, int] | None:
    """(prefix tokens, sessions attached, tokens prefilled) from ``/capacity``; None when
    the server does not count them."""
    cap = (await http.get(url + "/capacity")).json()
    totals = cap.get("pool_totals")
    if not isinstance(totals, dict):
        return None
    return (int(cap["kv_cells"]["prefix"]), int(totals["sessions_attached"]),
            int(totals["prefill_tokens"]))


async def _ask(url: str, question: Question, timeout_s: float) -> TaskOutcome:
    from a2a.client import ClientConfig, ClientFactory
    from a2a.types import a2a_pb2 as pb
    from a2a.utils.constants import TransportProtocol

    start = time.perf_counter()
    out = TaskOutcome(question.text, " + ".join(question.facts), "", "", False, question.multi)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10)) as http:
        config = ClientConfig(httpx_client=http, streaming=True, supported_protocol_bindings=[
            TransportProtocol.JSONRPC.value])
        client = await ClientFactory(config).create_from_url(url)
        request = pb.SendMessageRequest(message=pb.Message(
            role=pb.Role.ROLE_USER, message_id=uuid.uuid4().hex,
            parts=[pb.Part(text=question.text)]))
        task_id = ""
        try:
            async for response in client.send_message(request):
                if response.HasField("task"):
                    task_id = response.task.id
                elif response.HasField("status_update"):
                    task_id = response.status_update.task_id
                    note = "".join(p.text for p in response.status_update.status.message.parts)
                    if "tool result: " in note and any(m in note for m in _MALFORMED):
                        out.malformed_calls += 1
            task = await client.get_task(pb.GetTaskRequest(id=task_id))
        finally:
            await client.close()
    out.seconds = time.perf_counter() - start
    out.state = pb.TaskState.Name(task.status.state).removeprefix("TASK_STATE_").lower()
    texts: list[str] = []
    for artifact in task.artifacts:
        if artifact.artifact_id != "answer":
            continue
        for part in artifact.parts:
            if part.HasField("text"):
                texts.append(part.text)
            elif part.HasField("data"):
                subs = json.loads(json.dumps(_to_py(part.data))).get("subtasks", [])
                out.subtasks = len(subs)
                # camelCase keys since the A2A conformance pass (snake_case before)
                out.turns = int(sum(s.get("turns", 0) for s in subs))
                out.tokens = int(sum(s.get("tokens", 0) for s in subs))
                out.tool_calls = int(sum(s.get("toolCalls", 0) for s in subs))
                out.finish_reason = ",".join(str(_key(s, "finishReason", default="")) for s in subs)
    out.answer, out.evidence = split_evidence(texts)
    # The worker runs a malformed call too (to answer it with the error): not a tool call.
    out.tool_calls = max(out.tool_calls - out.malformed_calls, 0)
    out.missing = check(out.answer, question)  # the model's words only, never the evidence
    out.ok = not out.missing
    return out


def _template_name(spec: str) -> str:
    """The shipped template a run used (a --max-turns copy keeps its folder's name)."""
    name = Path(spec).name
    return name if name in ("light", "heavy") else "light"


def _key(sub: dict[str, Any], *names: str, default: Any = 0) -> Any:
    for name in names:
        if name in sub:
            return sub[name]
    return default


def _to_py(value: Any) -> Any:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(value)


async def run_pair(model: str, template: str, args: argparse.Namespace, tmp: Path,
                   plan: str = "never") -> PairResult:
    result = PairResult(model, template, plan)
    spec = _template_copy(template, tmp / f"{model}-{template}-{plan}", args)
    extra = ("--first-turn", args.first_turn) if args.first_turn else ()
    server = Server(model, spec, tmp / f"{model}-{template}-{plan}-data", args.prefix_tokens,
                    plan, extra)
    try:
        await server.wait_ready()
        result.chat_format = server.chat_format()
        sem = asyncio.Semaphore(args.concurrency)
        alone = args.concurrency == 1  # per-task counter deltas are this task's alone

        async def one(q: Question, http: httpx.AsyncClient) -> TaskOutcome:
            async with sem:
                before = await _totals(http, server.url) if alone else None
                out = await _ask(server.url, q, args.task_timeout)
                out.loop, out.echo = answer_quality(out.answer, _template_name(template))
                after = await _totals(http, server.url) if before else None
                if before and after:
                    out.sessions = after[1] - before[1]
                    out.prefilled_tokens = after[2] - before[2]
                    out.prefix_saved_tokens = after[0] * out.sessions
                return out

        async with httpx.AsyncClient(timeout=30) as http:
            start = await _totals(http, server.url)
            result.tasks = list(await asyncio.gather(
                *(one(q, http) for q in questions(args.questions, args.limit))))
            end = await _totals(http, server.url)
        if start and end:
            result.prefix = PrefixUse(end[0], end[1] - start[1], end[2] - start[2])
    finally:
        server.stop()
    return result


def _table(rows: list[dict[str, Any]]) -> str:
    cols = {"model": "model", "template": "template", "plan": "plan", "tasks": "tasks",
            "parse_rate": "parse", "tool_call_share": "tool_share", "success_rate": "success",
            "single_success_rate": "single_ok", "multi_success_rate": "multi_ok",
            "subtasks_per_task": "subtasks", "sessions_per_task": "sessions",
            "prefix_saved_per_task": "prefix_saved", "prefilled_per_task": "prefilled",
            "prefix_saved_share": "saved_share", "mean_turns": "turns",
            "mean_tokens": "tokens", "p50_task_s": "p50_s", "p95_task_s": "p95_s",
            "loop_share": "loops", "echo_share": "echoes"}
    lines = ["  ".join(f"{c:>12}" for c in cols.values())]
    lines += ["  ".join(f"{'-' if r[c] is None else r[c]!s:>12}" for c in cols) for r in rows]
    return "\n".join(lines)


def _report(pairs: list[PairResult]) -> dict[str, Any]:
    return {
        "command": "python -m bench.agent " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "results": [p.summary() for p in pairs],
        "tasks": {f"{p.model}/{p.template}/{p.plan}": [asdict(t) for t in p.tasks]
                  for p in pairs},
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    pairs: list[PairResult] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="agent-bench-") as tmp:
        for model in args.models.split(","):
            for template in args.templates.split(","):
                for plan in args.plans.split(","):
                    print(f"{model} / {template} / plan {plan} ...", file=sys.stderr,
                          flush=True)
                    pairs.append(await run_pair(model, template, args, Path(tmp), plan))
                    out.write_text(json.dumps(_report(pairs), indent=2) + "\n")  # each run
    print(_table([p.summary() for p in pairs]))
    return _report(pairs)


def rescore(files: list[str]) -> dict[str, Any]:
    """Answer quality, success and p50 of stored results (their ``tasks`` answers), with
    the measure a run uses (:func:`answer_quality`)."""
    rows: list[dict[str, Any]] = []
    for file in files:
        data = json.loads(Path(file).read_text())
        for key, tasks in data.get("tasks", {}).items():
            parts = key.split("/")
            template = parts[1] if len(parts) > 1 else "light"
            flags = [answer_quality(t.get("answer", ""), _template_name(template))
                     for t in tasks]
            n = len(tasks)
            rows.append({
                "file": file, "run": key, "tasks": n,
                "answers": sum(1 for t in tasks if t.get("answer")),
                "success_rate": round(sum(bool(t.get("ok")) for t in tasks) / n, 4)
                if n else None,
                "p50_task_s": round(statistics.median(t["seconds"] for t in tasks), 2)
                if n else None,
                "loop_share": round(sum(f[0] for f in flags) / n, 4) if n else None,
                "echo_share": round(sum(f[1] for f in flags) / n, 4) if n else None,
                "command": data.get("command") or data.get("commands"),
            })
    return {"rescored": "answers stored in earlier results, measured by "
                        "bench.agent.__main__.answer_quality", "results": rows}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gemma,smollm2")
    p.add_argument("--templates", default="light,heavy")
    p.add_argument("--plans", default="never",
                   help="mesh serve --plan modes to run, comma-separated: never (the worker "
                        "alone), auto (the coordinator plans and synthesizes), delegate "
                        "(auto, with plans that must use workers)")
    p.add_argument("--questions", choices=("all", "single", "multi"), default="all",
                   help="which questions: the single ones, the multi-part ones, or both")
    p.add_argument("--limit", type=int, default=0,
                   help="first N questions of each kind only (0: all)")
    p.add_argument("--max-turns", type=int, default=None)
    p.add_argument("--max-tokens-per-turn", type=int, default=None)
    p.add_argument("--prefix-tokens", type=int, default=None)
    p.add_argument("--first-turn", choices=("any", "call"), default=None,
                   help="mesh serve --first-turn (default: the server's own, any)")
    p.add_argument("--concurrency", type=int, default=4,
                   help="tasks in flight; 1 also measures each task's sessions and prefill")
    p.add_argument("--task-timeout", type=float, default=600)
    p.add_argument("--quick", action="store_true",
                   help="two questions on the tiny model, to a temporary path (a smoke)")
    p.add_argument("--out", default=None,
                   help="default: bench/agent/results/agent.json (--quick: QUICK_OUT)")
    p.add_argument("--rescore", nargs="+", metavar="FILE",
                   help="only measure answer quality in stored results (no server)")
    args = p.parse_args(argv)
    if args.quick:
        given = set(argv if argv is not None else sys.argv[1:])
        for key, value in QUICK.items():
            flag = "--" + key.replace("_", "-")
            if not any(g == flag or g.startswith(flag + "=") for g in given):
                setattr(args, key, value)
    if args.out is None:
        args.out = str(QUICK_OUT if args.quick else DEFAULT_OUT)
    if args.rescore:
        report = rescore(args.rescore)
        for r in report["results"]:
            print(f"{r['file']:48} {r['run']:28} tasks {r['tasks']:3}  success "
                  f"{r['success_rate']}  p50 {r['p50_task_s']}  loops {r['loop_share']}  "
                  f"echoes {r['echo_share']}")
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
        return
    report = asyncio.run(main_async(args))
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

