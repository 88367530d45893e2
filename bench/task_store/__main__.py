"""What the task store costs per A2A call: SQLite (the embedded default) vs PostgreSQL.

Two coordinators run side by side in child processes, identical but for the store: one on
a write-behind SQLite file in a temporary data dir, one with ``--task-store`` on a
PostgreSQL (a throwaway one started here, :mod:`bench.common.postgres`, unless ``--postgres URL``).
As in ``bench/a2a/`` the worker is a FAKE that answers at once and the gate admits
at once, so what differs between the two columns is the store. This process is the client
and sends the same requests to both, alternating which goes first, one call at a time:

* ``SendMessage`` (blocking): a task created, run and finished — first and final states
  durable before the reply (SQLite: two commits; PostgreSQL: a version compare-and-swap
  and an event row per state);
* ``GetTask`` of a finished task;
* ``ListTasks`` (first page of 50, out of every task sent).

Per call: p50/p95 wall ms, and the server's CPU ms per call (``/proc``; on a shared
machine the CPU, not the wall clock, says what a store costs). Writes
``bench/task_store/results/task_store.json`` (or ``--out``) and prints a table. ``--quick``:
20 calls of each (the suite runs it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.a2a.__main__ import _free_port, _server_cpu_s, _wait_up

STORES = ("sqlite", "postgres")
CALLS = ("SendMessage", "GetTask", "ListTasks")
LIST_PAGE = 50


def serve(port: int, data_dir: str, task_store: str | None) -> None:
    import logging

    import uvicorn

    from bench.a2a.__main__ import _InstantWorker, _OpenGate
    from mesh.a2a.app import build_app
    from mesh.a2a.config import CoordinatorConfig

    logging.disable(logging.WARNING)
    app = build_app(CoordinatorConfig(port=port, data_dir=data_dir, task_store=task_store),
                    worker_factory=_InstantWorker, admission=_OpenGate(), pool_info=None)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


# --------------------------------------------------------------------------- client side


def _rpc(method: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": uuid.uuid4().hex, "method": method, "params": params}


def _send_params() -> dict[str, Any]:
    return {"message": {"messageId": uuid.uuid4().hex, "role": "ROLE_USER",
                        "parts": [{"text": "ping"}]}}


async def _call(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    response = await http.post(url + "/", json=body)
    elapsed = time.perf_counter() - start
    doc = response.json()
    if "result" not in doc:
        raise RuntimeError(f"{body['method']} on {url} failed: {doc}")
    return elapsed, doc["result"]


async def _measure(urls: dict[str, str], num_calls: int, num_warmup: int,
                   pids: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Every call of ``CALLS``, ``num_calls`` times on each store, alternating the order."""
    samples: dict[str, dict[str, list[float]]] = {s: {c: [] for c in CALLS} for s in urls}
    cpu: dict[str, dict[str, float | None]] = {s: {} for s in urls}
    task_ids: dict[str, list[str]] = {s: [] for s in urls}
    async with httpx.AsyncClient(headers={"A2A-Version": "1.0"}, timeout=60) as http:

        async def send(store: str) -> float:
            elapsed, result = await _call(http, urls[store], _rpc("SendMessage", _send_params()))
            task = result["task"]
            if task["status"]["state"] != "TASK_STATE_COMPLETED":
                raise RuntimeError(f"a task on {store} ended {task['status']['state']}")
            task_ids[store].append(task["id"])
            return elapsed

        async def get(store: str) -> float:
            ids = task_ids[store]
            task_id = ids[len(samples[store]["GetTask"]) % len(ids)]
            elapsed, _ = await _call(http, urls[store], _rpc("GetTask", {"id": task_id}))
            return elapsed

        async def listed(store: str) -> float:
            elapsed, result = await _call(http, urls[store],
                                          _rpc("ListTasks", {"pageSize": LIST_PAGE}))
            if not result.get("tasks"):
                raise RuntimeError(f"ListTasks on {store} returned no task")
            return elapsed

        phases: dict[str, Callable[[str], Awaitable[float]]] = {
            "SendMessage": send, "GetTask": get, "ListTasks": listed}
        for call, run in phases.items():
            for _ in range(num_warmup):  # connections, pages, code paths
                for store in urls:
                    await run(store)
            before = {s: _server_cpu_s(pids[s]) for s in urls}
            for i in range(num_calls):
                order = list(urls) if i % 2 == 0 else list(reversed(urls))
                for store in order:
                    samples[store][call].append(await run(store))
            for store in urls:
                after, start = _server_cpu_s(pids[store]), before[store]
                cpu[store][call] = (None if after is None or start is None
                                    else round((after - start) / num_calls * 1e3, 3))
    return {store: {call: {"num_calls": len(samples[store][call]),
                           **_stats(samples[store][call]),
                           "server_cpu_ms_per_call": cpu[store][call]}
                    for call in CALLS} for store in urls}


def _stats(samples: list[float]) -> dict[str, float | None]:
    ms = sorted(s * 1e3 for s in samples)
    if not ms:
        return {"p50_ms": None, "p95_ms": None, "mean_ms": None}
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return {"p50_ms": round(statistics.median(ms), 2), "p95_ms": round(p95, 2),
            "mean_ms": round(statistics.fmean(ms), 2)}


# --------------------------------------------------------------------------- processes


@contextlib.contextmanager
def _server(data_dir: str, task_store: str | None) -> Iterator[tuple[str, int]]:
    port = _free_port()
    argv = [sys.executable, "-m", "bench.task_store", "--serve", str(port),
            "--data-dir", data_dir]
    if task_store:
        argv += ["--task-store", task_store]
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.Popen(argv, cwd=root, env={**os.environ, "PYTHONPATH": root})
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_up(url, proc)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def _postgres(url: str | None) -> Iterator[tuple[str, str]]:
    """The PostgreSQL to use and how it was had."""
    if url:
        yield url, "given (--postgres)"
        return
    from bench.common.postgres import throwaway_postgres

    with throwaway_postgres() as server:
        yield server.url, "throwaway (initdb on this machine, fsync off, 127.0.0.1)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/task_store/results/task_store.json")
    parser.add_argument("--calls", type=int, default=300, help="measured calls of each kind")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="20 calls of each, 3 warm-up")
    parser.add_argument("--postgres", default=None, metavar="URL",
                        help="an existing PostgreSQL to use (default: start a throwaway one)")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    parser.add_argument("--task-store", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.data_dir, args.task_store)
        return 0
    num_calls, num_warmup = (20, 3) if args.quick else (args.calls, args.warmup)

    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="task-store-bench-") as data_dir, \
            _postgres(args.postgres) as (pg_url, pg_how), \
            _server(data_dir, None) as (sqlite_url, sqlite_pid), \
            _server(data_dir + "/unused", pg_url) as (pg_server_url, pg_pid):
        measured = asyncio.run(_measure({"sqlite": sqlite_url, "postgres": pg_server_url},
                                        num_calls, num_warmup,
                                        {"sqlite": sqlite_pid, "postgres": pg_pid}))

    result: dict[str, Any] = {
        "what": "per-A2A-call latency, raw JSON-RPC, one call at a time, the same requests "
                "to two coordinators that differ only in the task store; the worker is a "
                "FAKE that answers at once and the gate admits at once",
        "stores": {
            "sqlite": "write-behind SQLite file (WAL, synchronous=NORMAL), the default",
            "postgres": f"--task-store: the a2a-sdk's versioned database store over "
                        f"asyncpg; PostgreSQL {pg_how}",
        },
        "calls": {"SendMessage": "blocking; the task completes", "GetTask": "a finished task",
                  "ListTasks": f"first page of {LIST_PAGE}"},
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "platform": platform.platform(),
                    "load_avg_1m_at_start": round(load_at_start, 2)},
        "num_calls": num_calls,
        "results": measured,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"task store per A2A call, fake instant worker ({os.cpu_count()} CPUs, "
          f"{num_calls} calls each) -> {out}")
    print(f"{'call':12} {'store':9} {'p50 ms':>8} {'p95 ms':>8} {'server CPU ms':>14}")
    for call in CALLS:
        for store in STORES:
            row = measured[store][call]
            print(f"{call:12} {store:9} {row['p50_ms']!s:>8} {row['p95_ms']!s:>8} "
                  f"{row['server_cpu_ms_per_call']!s:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
