"""How much the A2A layer costs: trivial tasks through the whole coordinator stack.

The worker is a FAKE that returns at once (no model, no tokens), and the gate admits at
once, so every millisecond measured is the A2A layer: HTTP, JSON-RPC validation, the SDK's
request handler and event queues, the SQLite task store (a real file), and the client.

The coordinator runs in a child process (uvicorn on 127.0.0.1, a free port) on a real
SQLite file in a temporary data dir; this process is the client. Two phases, each bounded
by a task count and a time limit:

* latency: one task at a time, raw JSON-RPC ``SendMessage`` over httpx and through the
  SDK client; per-task p50/p95;
* throughput: ``--concurrency`` tasks in flight (raw JSON-RPC); tasks/s.

Each phase also records the CPU seconds the server process and this client process spent
per task (``/proc``, Linux; ``None`` elsewhere): on a shared two-core machine that, not the
wall clock, says what the A2A layer costs.

Writes ``bench/a2a/results/a2a.json`` (or ``--out``) and prints a table.

    .venv/bin/python -m bench.a2a            # 300 + 300 + 2,000 tasks, 16 in flight
    .venv/bin/python -m bench.a2a --quick    # 20 + 20 + 50 tasks, 4 in flight, seconds

``--quick`` writes to a temporary path (``QUICK_OUT``) unless ``--out`` says otherwise, so it
never overwrites the committed result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

TARGET_TPS = 200.0
TARGET_P50_MS = 10.0
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "a2a.json"
QUICK_OUT = Path(tempfile.gettempdir()) / "mesh-bench" / "a2a.json"
QUICK: dict[str, Any] = {"tasks": 20, "throughput_tasks": 50, "concurrency": 4, "seconds": 5.0,
                         "out": QUICK_OUT}


# --------------------------------------------------------------------------- server side


class _Ticket:
    def __init__(self, key: str) -> None:
        self.key = key

    async def release(self) -> None:
        return None


class _OpenGate:
    """Admits everything at once (the bench measures the A2A layer, not the gate)."""

    def check_queue(self, *, places: int = 1, caller: str = "") -> Any:
        from mesh.gate.queue import QueueCheck

        return QueueCheck(ok=True, queue_len=0, retry_after_s=0.0)

    async def admit(self, key: str, on_position: Any = None, *, accepted: bool = False,
                    caller: str = "") -> _Ticket:
        return _Ticket(key)

    def capacity(self) -> dict[str, Any]:
        return {"slots": "unbounded"}


class _InstantWorker:
    async def run(self, subtask: Any, emit: Any) -> Any:
        from mesh.worker.types import WorkerResult

        return WorkerResult(answer="ok", num_turns=1, num_generated=0, num_tool_calls=0,
                            finish_reason="answer")


def serve(port: int, data_dir: str) -> None:
    import logging

    import uvicorn

    from mesh.a2a.app import build_app
    from mesh.a2a.config import CoordinatorConfig

    logging.disable(logging.WARNING)
    app = build_app(
        CoordinatorConfig(port=port, data_dir=data_dir),
        worker_factory=_InstantWorker,
        admission=_OpenGate(),
        pool_info=None,
    )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


# --------------------------------------------------------------------------- client side


def _body(text: str) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "SendMessage",
        "params": {
            "message": {"messageId": uuid.uuid4().hex, "role": "ROLE_USER",
                        "parts": [{"text": text}]}
        },
    }


async def _raw_task(http: httpx.AsyncClient, url: str) -> float:
    start = time.perf_counter()
    response = await http.post(url + "/", json=_body("ping"))
    elapsed = time.perf_counter() - start
    state = response.json()["result"]["task"]["status"]["state"]
    if state != "TASK_STATE_COMPLETED":
        raise RuntimeError(f"task ended {state}")
    return elapsed


async def _latency_raw(url: str, n: int, limit_s: float) -> list[float]:
    samples: list[float] = []
    async with httpx.AsyncClient(headers={"A2A-Version": "1.0"}, timeout=30) as http:
        for _ in range(5):  # warm-up: connection, SQLite pages, code paths
            await _raw_task(http, url)
        deadline = time.monotonic() + limit_s
        while len(samples) < n and time.monotonic() < deadline:
            samples.append(await _raw_task(http, url))
    return samples


async def _latency_sdk(url: str, n: int, limit_s: float) -> list[float]:
    from a2a.client import ClientConfig, ClientFactory
    from a2a.types import a2a_pb2 as pb

    samples: list[float] = []
    async with httpx.AsyncClient(timeout=30) as http:
        client = await ClientFactory(ClientConfig(httpx_client=http, streaming=False)
                                     ).create_from_url(url)
        try:
            deadline = time.monotonic() + limit_s
            for i in range(n + 5):
                if time.monotonic() > deadline:
                    break
                request = pb.SendMessageRequest(message=pb.Message(
                    role=pb.Role.ROLE_USER, message_id=uuid.uuid4().hex,
                    parts=[pb.Part(text="ping")]))
                start = time.perf_counter()
                async for response in client.send_message(request):
                    if response.task.status.state != pb.TaskState.TASK_STATE_COMPLETED:
                        raise RuntimeError("task did not complete")
                if i >= 5:
                    samples.append(time.perf_counter() - start)
        finally:
            await client.close()
    return samples


async def _throughput(url: str, n: int, concurrency: int, limit_s: float) -> dict[str, Any]:
    done = 0
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(headers={"A2A-Version": "1.0"}, timeout=60,
                                 limits=limits) as http:
        await _raw_task(http, url)
        deadline = time.monotonic() + limit_s
        start = time.perf_counter()

        async def lane() -> None:
            nonlocal done
            while done < n and time.monotonic() < deadline:
                done += 1
                latencies.append(await _raw_task(http, url))

        await asyncio.gather(*(lane() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {"num_tasks": len(latencies), "concurrency": concurrency, "wall_s": round(wall, 3),
            "tasks_per_s": round(len(latencies) / wall, 1), **_stats(latencies)}


def _stats(samples: list[float]) -> dict[str, Any]:
    ms = sorted(s * 1000 for s in samples)
    if not ms:
        return {"p50_ms": None, "p95_ms": None}
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return {"p50_ms": round(statistics.median(ms), 2), "p95_ms": round(p95, 2),
            "mean_ms": round(statistics.fmean(ms), 2)}


def _server_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux), else ``None``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measured(pid: int, phase: Any, num_warmup: int) -> tuple[Any, dict[str, Any]]:
    """Run ``phase()`` (an ``asyncio.run`` of one phase); its result and CPU per task."""
    server0, client0 = _server_cpu_s(pid), time.process_time()
    result = phase()
    server1, client1 = _server_cpu_s(pid), time.process_time()
    num_tasks = (result["num_tasks"] if isinstance(result, dict) else len(result)) + num_warmup
    server = None if server0 is None or server1 is None else server1 - server0
    cpu = {
        "server_cpu_ms_per_task": None if server is None else round(server / num_tasks * 1e3, 2),
        "client_cpu_ms_per_task": round((client1 - client0) / num_tasks * 1e3, 2),
    }
    return result, cpu


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_up(url: str, proc: subprocess.Popen[bytes], limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server did not come up within 60 s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"default: {DEFAULT_OUT} (with --quick: {QUICK_OUT})")
    parser.add_argument("--quick", action="store_true",
                        help="a few tasks per phase: the suite's run, not a measurement")
    parser.add_argument("--tasks", type=int, default=300, help="tasks per latency phase")
    parser.add_argument("--throughput-tasks", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20.0, help="time limit per phase")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:  # the quick sizes become the defaults; flags given still win
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.data_dir)
        return 0

    load_at_start = os.getloadavg()[0]
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="a2a-bench-") as data_dir:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(port), "--data-dir", data_dir],
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )
        try:
            _wait_up(url, proc)
            raw, raw_cpu = _measured(
                proc.pid, lambda: asyncio.run(_latency_raw(url, args.tasks, args.seconds)), 5
            )
            sdk, sdk_cpu = _measured(
                proc.pid, lambda: asyncio.run(_latency_sdk(url, args.tasks, args.seconds)), 5
            )
            tput, tput_cpu = _measured(
                proc.pid,
                lambda: asyncio.run(
                    _throughput(url, args.throughput_tasks, args.concurrency, args.seconds)
                ),
                1,
            )
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    result: dict[str, Any] = {
        "what": "trivial tasks through the whole A2A stack (HTTP, validation, a2a-sdk handler, "
                "SQLite task store); the worker is a FAKE that returns at once and the gate "
                "admits at once, so all time measured is A2A-layer overhead",
        "store": "write-behind SQLite file (WAL, synchronous=NORMAL): first and terminal "
                 "states committed before the reply, working states coalesced",
        "worker": "fake (instant, no model)",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "platform": platform.platform(),
                    # Others' work on a shared machine shows here and in the wall clock,
                    # not in the CPU per task.
                    "load_avg_1m_at_start": round(load_at_start, 2)},
        "latency_raw_jsonrpc": {"num_tasks": len(raw), **_stats(raw), **raw_cpu},
        "latency_sdk_client": {"num_tasks": len(sdk), **_stats(sdk), **sdk_cpu},
        "throughput": {**tput, **tput_cpu},
        "targets": {"tasks_per_s": TARGET_TPS, "p50_overhead_ms": TARGET_P50_MS},
    }
    p50 = result["latency_raw_jsonrpc"]["p50_ms"]
    result["met"] = {
        "tasks_per_s": tput["tasks_per_s"] >= TARGET_TPS,
        "p50_overhead_ms": p50 is not None and p50 <= TARGET_P50_MS,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"A2A layer, fake instant worker ({os.cpu_count()} CPUs) -> {out}")
    print(f"{'phase':28} {'tasks':>6} {'p50 ms':>8} {'p95 ms':>8} {'tasks/s':>8} "
          f"{'server CPU ms/task':>19}")
    for name, key in (("latency, raw JSON-RPC", "latency_raw_jsonrpc"),
                      ("latency, SDK client", "latency_sdk_client"),
                      (f"throughput, {args.concurrency} in flight", "throughput")):
        row = result[key]
        rate = row.get("tasks_per_s", "")
        print(f"{name:28} {row['num_tasks']:>6} {row['p50_ms']:>8} {row['p95_ms']:>8} {rate:>8} "
              f"{row['server_cpu_ms_per_task']!s:>19}")
    met = {k: "met" if v else "MISSED" for k, v in result["met"].items()}
    print(f"targets: >= {TARGET_TPS:.0f} tasks/s ({met['tasks_per_s']}), "
          f"p50 <= {TARGET_P50_MS:.0f} ms ({met['p50_overhead_ms']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
