"""Load: many A2A clients against a running mesh; nothing may be lost, nothing may 5xx.

Two runs, each bounded by a task count and a time limit, loopback only, stops by itself:

* ``fake``: 1,000 tasks from 50 concurrent clients against the whole ``mesh serve`` app
  (coordinator, FloorGate, agent worker, SQLite store) on the FAKE engine, served by a
  child process. The gate's queue is kept short so that clients meet 429s and must
  retry after the ``Retry-After`` they were given.
* ``tiny``: 50 tasks from 10 clients against a real ``mesh serve --model tiny``, mixed:
  blocking send, streamed send (SSE read to the end), and send-then-cancel.

Per run: tasks submitted, reached a terminal state, lost (never answered, or missing or not
terminal in ``GetTask`` at the end), 5xx answers, 429s (each checked for Retry-After, and
whether its retry went through), p50/p95 latency of send and stream tasks, and the server's
RSS growth (peak during the run minus its RSS after a warm-up). Prints a table and writes
``bench/load/results/load.json`` (or ``--out``; with ``--quick``, a temporary path: ``QUICK_OUT``).

    python -m bench.load            # both runs
    python -m bench.load --quick    # 60 fake tasks from 20 clients, 10 tiny from 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common.servers import free_port, stop, wait_healthy

TERMINAL = {"TASK_STATE_COMPLETED", "TASK_STATE_FAILED", "TASK_STATE_CANCELED",
            "TASK_STATE_REJECTED"}
MAX_RSS_GROWTH_MB = 100.0
MAX_ATTEMPTS = 40  # per task, 429 retries included
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "load.json"
QUICK_OUT = Path(tempfile.gettempdir()) / "mesh-bench" / "load.json"


@dataclass(frozen=True)
class Sizes:
    """Tasks and concurrent clients per run, and warm-up tasks before each."""

    fake_tasks: int
    fake_clients: int
    tiny_tasks: int
    tiny_clients: int
    num_warmup: int


FULL = Sizes(fake_tasks=1000, fake_clients=50, tiny_tasks=50, tiny_clients=10, num_warmup=20)
# The suite's run: 30 clients against 16 workers and a queue of 8, so some meet a 429.
QUICK = Sizes(fake_tasks=60, fake_clients=30, tiny_tasks=10, tiny_clients=5, num_warmup=3)


# --------------------------------------------------------------------------- server side


def serve_fake(port: int, data_dir: str, max_queue: int) -> None:
    """The app ``mesh serve`` builds, on the fake engine (run in a child process)."""
    import logging

    import uvicorn

    from mesh.a2a.app import build_app
    from mesh.a2a.config import CoordinatorConfig
    from mesh.api.sessions import api_routes
    from mesh.gate.admission import FloorGate
    from mesh.gate.config import GateConfig
    from mesh.sim.fake import FakeEngine
    from mesh.template.loader import load_template, sample_project_dir
    from mesh.worker.loop import AgentWorker
    from mesh.worker.tools import ProjectTools

    logging.disable(logging.WARNING)
    engine = FakeEngine(max_sessions=16, session_budget=1024, step_delay_s=0.0005)
    gate = FloorGate(engine, GateConfig.create(policy="none", max_workers=16, max_queue=max_queue))
    template = load_template("light")
    tools = ProjectTools(sample_project_dir()).as_tools()
    app = build_app(
        CoordinatorConfig(port=port, data_dir=data_dir),
        worker_factory=lambda: AgentWorker(engine, template, tools),
        admission=gate,
        pool_info=engine.info,
        extra_routes=api_routes(engine, gate),
    )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@contextlib.contextmanager
def child(argv: list[str], env: dict[str, str] | None = None) -> Any:
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            yield proc
        finally:
            stop(proc)


# --------------------------------------------------------------------------- client side


@dataclass
class Tally:
    submitted: int = 0
    answered: int = 0
    num_5xx: int = 0
    num_429: int = 0
    num_429_without_retry_after: int = 0
    num_429_retried_ok: int = 0
    errors: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    task_ids: list[str] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)


def rpc(method: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": uuid.uuid4().hex, "method": method, "params": params}


def send_params(text: str, immediately: bool = False) -> dict[str, Any]:
    return {"message": {"messageId": uuid.uuid4().hex, "role": "ROLE_USER",
                        "parts": [{"text": text}]},
            "configuration": {"returnImmediately": immediately}}


async def post(http: httpx.AsyncClient, tally: Tally, body: dict[str, Any]) -> httpx.Response:
    """POST, retrying 429s after their Retry-After (bounded)."""
    refused = False
    for _ in range(MAX_ATTEMPTS):
        response = await http.post("/", json=body)
        if response.status_code >= 500:
            tally.num_5xx += 1
        if response.status_code != 429:
            if refused and response.status_code == 200:
                tally.num_429_retried_ok += 1
            return response
        refused = True
        tally.num_429 += 1
        retry = response.headers.get("retry-after")
        if retry is None:
            tally.num_429_without_retry_after += 1
        await asyncio.sleep(min(float(retry or 1), 5.0) * random.uniform(1.0, 1.5))
    raise RuntimeError(f"still refused after {MAX_ATTEMPTS} attempts")


async def one_task(http: httpx.AsyncClient, tally: Tally, kind: str, i: int) -> None:
    text = f"task {i}: list the files and summarize the readme"
    tally.submitted += 1
    tally.kinds[kind] = tally.kinds.get(kind, 0) + 1
    start = time.perf_counter()
    if kind == "stream":
        task_id = None
        body = rpc("SendStreamingMessage", send_params(text))
        refused = False
        for _ in range(MAX_ATTEMPTS):
            async with http.stream("POST", "/", json=body) as response:
                if response.status_code == 429:
                    refused = True
                    tally.num_429 += 1
                    retry = response.headers.get("retry-after")
                    if retry is None:
                        tally.num_429_without_retry_after += 1
                    await asyncio.sleep(min(float(retry or 1), 5.0) * random.uniform(1.0, 1.5))
                    continue
                if response.status_code >= 500:
                    tally.num_5xx += 1
                elif refused and response.status_code == 200:
                    tally.num_429_retried_ok += 1
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        doc = json.loads(line[5:])
                        result = doc.get("result", {})
                        task_id = task_id or result.get("task", {}).get("id")
            break
        if task_id is None:
            raise RuntimeError("the stream never named its task")
        tally.latencies_s.append(time.perf_counter() - start)
    else:
        response = await post(http, tally, rpc("SendMessage",
                                                send_params(text, immediately=kind == "cancel")))
        doc = response.json()
        if "result" not in doc:
            raise RuntimeError(f"send refused: {doc.get('error')}")
        task_id = doc["result"]["task"]["id"]
        if kind == "cancel":
            cancel = await post(http, tally, rpc("CancelTask", {"id": task_id}))
            code = cancel.json().get("error", {}).get("code")
            if code not in (None, -32002):  # -32002: it finished first (not cancelable)
                raise RuntimeError(f"cancel answered {cancel.json()}")
        else:
            tally.latencies_s.append(time.perf_counter() - start)
    tally.task_ids.append(task_id)
    tally.answered += 1


async def drive(url: str, num_tasks: int, num_clients: int, mix: list[str], limit_s: float,
                pid: int, num_warmup: int) -> dict[str, Any]:
    tally = Tally()
    todo = list(range(num_tasks))
    peak = base = rss_mb(pid)
    headers = {"A2A-Version": "1.0"}

    async def client(n: int) -> None:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
            while todo:
                i = todo.pop()
                try:
                    await one_task(http, tally, mix[i % len(mix)], i)
                except Exception as exc:  # counted as never answered
                    tally.errors.append(f"{type(exc).__name__}: {exc}"[:200])

    async def sample_rss() -> None:
        nonlocal peak
        while True:
            peak = max(peak, rss_mb(pid))
            await asyncio.sleep(0.1)

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
        for i in range(num_warmup):  # warm-up: code paths, SQLite pages, allocator arenas
            await http.post("/", json=rpc("SendMessage", send_params(f"warm {i}")))
    peak = base = rss_mb(pid)
    sampler = asyncio.create_task(sample_rss())
    start = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(client(n) for n in range(num_clients))), limit_s)
    finally:
        sampler.cancel()
    wall = time.perf_counter() - start
    peak = max(peak, rss_mb(pid))

    # Every task answered must be terminal in GetTask (cancels may still be settling).
    terminal = 0
    states: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
        for task_id in tally.task_ids:
            state = None
            for _ in range(200):
                doc = (await http.post("/", json=rpc("GetTask", {"id": task_id}))).json()
                state = doc.get("result", {}).get("status", {}).get("state")
                if state in TERMINAL:
                    break
                await asyncio.sleep(0.05)
            if state in TERMINAL:
                terminal += 1
                states[state] = states.get(state, 0) + 1
    lat = sorted(tally.latencies_s)
    return {
        "tasks_submitted": tally.submitted,
        "clients": num_clients,
        "mix": {k: v for k, v in sorted(tally.kinds.items())},
        "reached_terminal": terminal,
        "terminal_states": states,
        "lost": tally.submitted - terminal,
        "num_5xx": tally.num_5xx,
        "num_429": tally.num_429,
        "num_429_without_retry_after": tally.num_429_without_retry_after,
        "num_429_retried_ok": tally.num_429_retried_ok,
        "p50_latency_ms": round(1000 * statistics.median(lat), 1) if lat else None,
        "p95_latency_ms": round(1000 * lat[int(0.95 * (len(lat) - 1))], 1) if lat else None,
        "wall_s": round(wall, 2),
        "tasks_per_s": round(tally.submitted / wall, 1) if wall else None,
        "rss_base_mb": round(base, 1),
        "rss_peak_mb": round(peak, 1),
        "rss_growth_mb": round(peak - base, 1),
        "client_errors": tally.errors[:10],
    }


def run_fake(num_tasks: int, num_clients: int, limit_s: float,
             num_warmup: int) -> dict[str, Any]:
    port = free_port()
    with tempfile.TemporaryDirectory() as data:
        argv = [sys.executable, "-m", "bench.load", "--serve-fake", str(port), data]
        with child(argv) as proc:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc)
            result = asyncio.run(drive(url, num_tasks, num_clients, ["send", "send", "stream"],
                                       limit_s, proc.pid, num_warmup))
    result["backend"] = "fake engine (AgentWorker, light template), static:16, max_queue 8"
    return result


def run_tiny(num_tasks: int, num_clients: int, limit_s: float,
             num_warmup: int) -> dict[str, Any]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp) / "project"
        project.mkdir()
        (project / "README.md").write_text("# load\nA small project for the load bench.\n")
        env = dict(os.environ, XDG_CACHE_HOME=str(Path(tmp) / "cache"))
        env.pop("MESH_AUTH_TOKEN", None)
        argv = [sys.executable, "-m", "mesh", "serve", "--model", "tiny", "--port", str(port),
                "--data-dir", str(Path(tmp) / "data"), "--project", str(project),
                "--max-sessions", "8", "--max-queue", "16", "--threads", "2",
                # the random-weight planner's plans are noise (an `ask` stops a task at
                # INPUT_REQUIRED, which this bench would count as not terminal)
                "--plan", "never"]
        with child(argv, env) as proc:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc)
            result = asyncio.run(drive(url, num_tasks, num_clients,
                                       ["send", "stream", "cancel"], limit_s, proc.pid,
                                       num_warmup))
    result["backend"] = ("mesh serve --model tiny --plan never (real llama.cpp), 8 sessions, "
                         "max_queue 16")
    return result


def verdict(fake: dict[str, Any], tiny: dict[str, Any] | None) -> dict[str, bool]:
    runs = [r for r in (fake, tiny) if r is not None]
    return {
        "zero_lost": all(r["lost"] == 0 for r in runs),
        "zero_5xx": all(r["num_5xx"] == 0 for r in runs),
        "every_429_has_retry_after": all(r["num_429_without_retry_after"] == 0 for r in runs),
        "429_retries_succeed": all(r["num_429"] == 0 or r["num_429_retried_ok"] > 0
                                   for r in runs),
        "rss_growth_under_100mb": fake["rss_growth_mb"] < MAX_RSS_GROWTH_MB,
    }


def table(results: dict[str, Any]) -> str:
    rows = [
        ("tasks submitted", "tasks_submitted"), ("clients", "clients"),
        ("reached terminal", "reached_terminal"), ("lost", "lost"), ("5xx", "num_5xx"),
        ("429 (all with Retry-After)", "num_429"), ("429 retried ok", "num_429_retried_ok"),
        ("p50 latency ms", "p50_latency_ms"), ("p95 latency ms", "p95_latency_ms"),
        ("wall s", "wall_s"), ("tasks/s", "tasks_per_s"),
        ("RSS base MB", "rss_base_mb"), ("RSS growth MB", "rss_growth_mb"),
    ]
    runs = [(name, results[name]) for name in ("fake", "tiny") if results.get(name)]
    lines = ["| metric | " + " | ".join(n for n, _ in runs) + " |",
             "|---|" + "---|" * len(runs)]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(str(r[key]) for _, r in runs) + " |")
    lines.append("")
    lines += [f"{k}: {'PASS' if v else 'FAIL'}" for k, v in results["verdict"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--serve-fake", nargs=2, metavar=("PORT", "DATA_DIR"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-tiny", action="store_true")
    parser.add_argument("--limit-s", type=float, default=600)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"default: {DEFAULT_OUT} (with --quick: {QUICK_OUT})")
    args = parser.parse_args(argv)
    if args.serve_fake:
        serve_fake(int(args.serve_fake[0]), args.serve_fake[1], max_queue=8)
        return 0
    sizes = QUICK if args.quick else FULL
    fake = run_fake(sizes.fake_tasks, sizes.fake_clients, args.limit_s, sizes.num_warmup)
    tiny = (None if args.skip_tiny
            else run_tiny(sizes.tiny_tasks, sizes.tiny_clients, args.limit_s, sizes.num_warmup))
    results: dict[str, Any] = {
        "bench": "load",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "fake": fake,
        "tiny": tiny,
    }
    results["verdict"] = verdict(fake, tiny)
    print(table(results))
    out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if all(results["verdict"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
