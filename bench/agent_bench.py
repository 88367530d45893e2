"""Agent behaviour on the sample project: checkable questions, each an A2A task.

For every (model, template) pair, this starts a real ``mesh serve`` subprocess (on a free
port, a fresh data dir, the shipped sample project), sends each question of
:data:`QUESTIONS` as an A2A task (streaming, so the tool events are seen), and checks the
answer for the expected text (case-insensitive). Per pair it reports:

* ``parse_rate``: well-formed tool calls / all tool calls written (a call is malformed when
  the worker answers it with "could not read the tool call" or "unknown tool"; 1.0 when no
  call was written);
* ``tool_call_share``: turns that ran a tool / all turns;
* ``success_rate``: tasks whose answer contains the expected text;
* ``mean_turns``, ``mean_tokens`` (generated per task), ``p50_task_s``.

Usage (what the committed bench/results/agent.json was made with is in its ``command``)::

    python -m bench.agent_bench --models gemma,smollm2 --templates light,heavy
    python -m bench.agent_bench --limit 5 --max-turns 2   # quicker

``--max-turns``/``--max-tokens-per-turn`` run a copy of each template with those limits
(``--prefix-tokens`` shrinks the prefix too), so a CPU run stays short.
"""

from __future__ import annotations

import argparse
import asyncio
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

_MALFORMED = ("could not read the tool call", "unknown tool", "tool call longer than")


@dataclass
class TaskOutcome:
    question: str
    expected: str
    answer: str
    state: str
    ok: bool
    turns: int = 0
    tokens: int = 0
    tool_calls: int = 0
    malformed_calls: int = 0
    finish_reason: str = ""
    seconds: float = 0.0
    subtasks: int = 0


@dataclass
class PairResult:
    model: str
    template: str
    plan: str = "never"
    chat_format: str = ""
    tasks: list[TaskOutcome] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        t = self.tasks
        calls = sum(x.tool_calls for x in t)
        bad = sum(x.malformed_calls for x in t)
        turns = sum(x.turns for x in t)
        return {
            "model": self.model,
            "template": self.template,
            "plan": self.plan,
            "chat_format": self.chat_format,
            "tasks": len(t),
            "parse_rate": round(calls / (calls + bad), 4) if calls + bad else 1.0,
            "tool_call_share": round(calls / turns, 4) if turns else 0.0,
            "success_rate": round(sum(x.ok for x in t) / len(t), 4) if t else 0.0,
            "mean_turns": round(statistics.fmean(x.turns for x in t), 2) if t else 0.0,
            "mean_tokens": round(statistics.fmean(x.tokens for x in t), 1) if t else 0.0,
            "p50_task_s": round(statistics.median(x.seconds for x in t), 2) if t else 0.0,
            "p95_task_s": round(_p95([x.seconds for x in t]), 2) if t else 0.0,
            "subtasks_per_task": round(statistics.fmean(x.subtasks for x in t), 2) if t else 0.0,
            "finish_reasons": _count(x.finish_reason or x.state for x in t),
        }


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


def _template_copy(name: str, dest: Path, args: argparse.Namespace) -> str:
    """The shipped template, or a copy with the run's turn limits."""
    if args.max_turns is None and args.max_tokens_per_turn is None:
        return name
    from mesh.template import export_template

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
                 plan: str = "never"):
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


async def _ask(url: str, question: str, expected: str, timeout_s: float) -> TaskOutcome:
    from a2a.client import ClientConfig, ClientFactory
    from a2a.types import a2a_pb2 as pb
    from a2a.utils.constants import TransportProtocol

    start = time.perf_counter()
    out = TaskOutcome(question, expected, "", "", False)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10)) as http:
        config = ClientConfig(httpx_client=http, streaming=True, supported_protocol_bindings=[
            TransportProtocol.JSONRPC.value])
        client = await ClientFactory(config).create_from_url(url)
        request = pb.SendMessageRequest(message=pb.Message(
            role=pb.Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=[pb.Part(text=question)]))
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
    for artifact in task.artifacts:
        if artifact.artifact_id != "answer":
            continue
        for part in artifact.parts:
            if part.HasField("text"):
                out.answer = part.text
            elif part.HasField("data"):
                subs = json.loads(json.dumps(_to_py(part.data))).get("subtasks", [])
                out.subtasks = len(subs)
                # camelCase keys since the A2A conformance pass (snake_case before)
                out.turns = int(sum(_key(s, "numTurns", "turns") for s in subs))
                out.tokens = int(sum(_key(s, "numGenerated", "tokens") for s in subs))
                out.tool_calls = int(sum(_key(s, "numToolCalls", "toolCalls") for s in subs))
                out.finish_reason = ",".join(str(_key(s, "finishReason", default="")) for s in subs)
    # The worker runs a malformed call too (to answer it with the error): not a tool call.
    out.tool_calls = max(out.tool_calls - out.malformed_calls, 0)
    out.ok = expected.lower() in out.answer.lower()
    return out


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
    server = Server(model, spec, tmp / f"{model}-{template}-{plan}-data", args.prefix_tokens,
                    plan)
    try:
        await server.wait_ready()
        result.chat_format = server.chat_format()
        questions = QUESTIONS[: args.limit] if args.limit else QUESTIONS
        sem = asyncio.Semaphore(args.concurrency)

        async def one(q: str, expected: str) -> TaskOutcome:
            async with sem:
                return await _ask(server.url, q, expected, args.task_timeout)

        result.tasks = list(await asyncio.gather(*(one(q, e) for q, e in questions)))
    finally:
        server.stop()
    return result


def _table(rows: list[dict[str, Any]]) -> str:
    cols = ["model", "template", "plan", "tasks", "parse_rate", "tool_call_share",
            "success_rate", "subtasks_per_task", "mean_turns", "mean_tokens", "p50_task_s",
            "p95_task_s"]
    lines = ["  ".join(f"{c:>12}" for c in cols)]
    lines += ["  ".join(f"{r[c]!s:>12}" for c in cols) for r in rows]
    return "\n".join(lines)


def _report(pairs: list[PairResult]) -> dict[str, Any]:
    return {
        "command": "python -m bench.agent_bench " + " ".join(sys.argv[1:]),
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gemma,smollm2")
    p.add_argument("--templates", default="light,heavy")
    p.add_argument("--plans", default="never",
                   help="mesh serve --plan modes to run, comma-separated: never (the worker "
                        "alone), auto (the coordinator plans and synthesizes), delegate "
                        "(auto, with plans that must use workers)")
    p.add_argument("--limit", type=int, default=0, help="first N questions only (0: all)")
    p.add_argument("--max-turns", type=int, default=None)
    p.add_argument("--max-tokens-per-turn", type=int, default=None)
    p.add_argument("--prefix-tokens", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--task-timeout", type=float, default=600)
    p.add_argument("--out", default="bench/results/agent.json")
    args = p.parse_args(argv)
    report = asyncio.run(main_async(args))
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

