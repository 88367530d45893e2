"""Pool nodes on this machine: 1 coordinator + 2 nodes, real ``mesh serve`` processes.

Phases (each bounded; every process started is killed at the end):

* ``routing``: the same one-subtask scenario task (real decoding, no tool latency), one at
  a time, sent straight to node A and then through the coordinator; the per-task latency
  added by the coordinator hop (p50/p95 of each, and their difference).
* ``share``: node A runs ``--policy static:4``, node B ``static:2``. Tasks arrive every
  ``--gap-s``; just before each send this bench reads both nodes' ``/capacity`` itself and
  notes which admitting node has the most headroom (ties and "nobody admits" are not
  counted); afterwards it reads from the task's status which node the coordinator chose.
  The share is how often they agree (the coordinator polls every 0.5 s, so it can differ).
* ``kill``: 4 tasks x 3 subtasks; once both nodes run subtasks, node A gets SIGKILL; every
  task's terminal state, the retries and the time to the last terminal state.
* ``prefix-cache`` (``--prefix-model``, default: the default Gemma model, heavy template at
  ``--prefix-tokens``): time from process start to the first admitted subtask, for a cold
  node, a node started on another node's ``--prefix-cache DIR``, and one that also got a
  copy of the gate's seed cache.

Aggregate speedups are not measured (2 shared cores); :func:`fleet_table` prints the
DESIGN-level arithmetic instead. Writes ``bench/results/nodes.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

TERMINAL = {"TASK_STATE_COMPLETED", "TASK_STATE_FAILED", "TASK_STATE_CANCELED",
            "TASK_STATE_REJECTED"}
HEADERS = {"A2A-Version": "1.0", "content-type": "application/json"}
ROOT = Path(__file__).resolve().parent.parent


class Proc:
    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name, self.log = name, log
        self.port = int(argv[argv.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        with log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 600) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not start:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def rpc(url: str, method: str, params: dict[str, Any], timeout: float = 300) -> Any:
    body = {"jsonrpc": "2.0", "id": uuid.uuid4().hex, "method": method, "params": params}
    r = httpx.post(url + "/", json=body, headers=HEADERS, timeout=timeout)
    r.raise_for_status()
    doc = r.json()
    if "result" not in doc:
        raise RuntimeError(f"{method}: {doc}")
    return doc["result"]


def task_message(n: int, steps: int, latency_s: float) -> dict[str, Any]:
    return {"messageId": uuid.uuid4().hex, "role": "ROLE_USER", "parts": [{"data": {
        "subtasks": [{"instructions": f"deliver {i}", "params": {
            "scenario": True, "steps": steps, "tokens_per_step": 8, "seed": i,
            "tool_latency_s": {"dist": "fixed", "value": latency_s}}} for i in range(n)]}}]}


def send(url: str, msg: dict[str, Any], *, wait: bool) -> dict[str, Any]:
    out: dict[str, Any] = rpc(url, "SendMessage", {
        "message": msg, "configuration": {"returnImmediately": not wait}})["task"]
    return out


def wait_terminal(url: str, task_id: str, timeout: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        task: dict[str, Any] = rpc(url, "GetTask", {"id": task_id, "historyLength": 1000})
        if task["status"]["state"] in TERMINAL:
            return task
        time.sleep(0.05)
    raise RuntimeError(f"task {task_id} not terminal after {timeout} s")


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Fleet:
    """Two nodes and a coordinator (``serve`` args shared), started in ``root``."""

    def __init__(self, root: Path, args: argparse.Namespace, env: dict[str, str],
                 node_policies: tuple[str, str]) -> None:
        self.procs: list[Proc] = []
        self.gate_cache: Path | None = Path(args.gate_cache) if args.gate_cache else None
        common = ["--model", args.model, "--threads", "1", "--host", "127.0.0.1",
                  "--project", str(args.project), "--prefix-tokens", str(args.node_prefix),
                  "--simulation"]
        self.nodes = [self._start(root, f"node-{x}", [*common, "--policy", pol], env)
                      for x, pol in zip("ab", node_policies, strict=True)]
        for n in self.nodes:
            n.wait_ready()
        node_args = [a for n in self.nodes for a in ("--node", n.url)]
        self.coord = self._start(root, "coord", [*common, *node_args], env)
        self.coord.wait_ready()

    def _start(self, root: Path, name: str, extra: list[str], env: dict[str, str]) -> Proc:
        port = free_port()
        if self.gate_cache is not None:  # seed files to copy in (keyed by model + machine)
            # the seed lives beside the prefix snapshots (DATA_DIR/prefix-cache by default)
            shutil.copytree(self.gate_cache, root / name / "prefix-cache" / "gate")
        argv = [sys.executable, "-m", "mesh", "serve", "--port", str(port),
                "--data-dir", str(root / name), *extra]
        proc = Proc(name, argv, root / f"{name}.log", env)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in self.procs:
            p.kill()


def routing_phase(fleet: Fleet, n: int) -> dict[str, Any]:
    def msg() -> dict[str, Any]:
        return task_message(1, 1, 0.0)

    for url in (fleet.nodes[0].url, fleet.coord.url):  # warm both paths
        send(url, msg(), wait=True)
    out: dict[str, Any] = {}
    for label, url in (("direct", fleet.nodes[0].url), ("via_coordinator", fleet.coord.url)):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            task = send(url, msg(), wait=True)
            times.append((time.perf_counter() - t0) * 1000)
            assert task["status"]["state"] == "TASK_STATE_COMPLETED", task["status"]
        out[label] = {"n": n, "p50_ms": pct(times, 0.5), "p95_ms": pct(times, 0.95),
                      "mean_ms": statistics.fmean(times)}
    out["added_p50_ms"] = out["via_coordinator"]["p50_ms"] - out["direct"]["p50_ms"]
    out["added_p95_ms"] = out["via_coordinator"]["p95_ms"] - out["direct"]["p95_ms"]
    return out


def _routed_to(task: dict[str, Any]) -> str | None:
    for m in task.get("history", []):
        for p in m.get("parts", []):
            text = p.get("text", "")
            if "routed to node " in text:
                return str(text.split("routed to node ", 1)[1].split()[0])
    return None


def share_phase(fleet: Fleet, n: int, gap_s: float) -> dict[str, Any]:
    expected: list[str | None] = []
    ids = []
    for _ in range(n):
        caps = [httpx.get(x.url + "/capacity", timeout=10).json() for x in fleet.nodes]
        rooms = [(c["headroom"] if c["verdict"] == "admit" else -1) for c in caps]
        best = max(rooms)
        winners = [x.url for x, r in zip(fleet.nodes, rooms, strict=True) if r == best]
        expected.append(winners[0] if best > 0 and len(winners) == 1 else None)
        ids.append(send(fleet.coord.url, task_message(1, 3, 0.4), wait=False)["id"])
        time.sleep(gap_s)
    routed = [_routed_to(wait_terminal(fleet.coord.url, t)) for t in ids]
    decided = [(e, r) for e, r in zip(expected, routed, strict=True) if e is not None]
    agree = sum(1 for e, r in decided if e == r)
    cap = httpx.get(fleet.coord.url + "/capacity", timeout=10).json()
    return {"tasks": n, "gap_s": gap_s, "decided": len(decided), "agree": agree,
            "share_to_max_headroom": agree / len(decided) if decided else None,
            "routed_per_node": {r["url"]: r["routed"] for r in cap["nodes"]},
            "node_policies": ["static:4", "static:2"]}


def kill_phase(fleet: Fleet) -> dict[str, Any]:
    ids = [send(fleet.coord.url, task_message(3, 3, 0.4), wait=False)["id"] for _ in range(4)]
    deadline = time.monotonic() + 60
    while True:
        cap = httpx.get(fleet.coord.url + "/capacity", timeout=10).json()
        if all(r["in_flight"] > 0 for r in cap["nodes"]) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    in_flight = {r["url"]: r["in_flight"] for r in cap["nodes"]}
    t0 = time.monotonic()
    fleet.nodes[0].kill()
    states = [wait_terminal(fleet.coord.url, t)["status"]["state"] for t in ids]
    cap = httpx.get(fleet.coord.url + "/capacity", timeout=10).json()
    return {"tasks": len(ids), "subtasks": 3 * len(ids), "in_flight_at_kill": in_flight,
            "queued_at_kill": cap.get("queue_len"), "states": states,
            "all_terminal": all(s in TERMINAL for s in states),
            "completed": states.count("TASK_STATE_COMPLETED"),
            "retried": cap["retried_total"], "last_terminal_after_kill_s":
            round(time.monotonic() - t0, 3)}


def first_admitted(root: Path, name: str, argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Seconds from process start to the first subtask admitted (status 'admitted')."""
    port = free_port()
    proc = Proc(name, [sys.executable, "-m", "mesh", "serve", "--port", str(port), *argv],
                root / f"{name}.log", env)
    try:
        ready = proc.wait_ready()
        task = send(proc.url, task_message(1, 1, 0.0), wait=False)
        while True:
            doc = rpc(proc.url, "GetTask", {"id": task["id"], "historyLength": 100})
            texts = [p.get("text", "") for m in doc.get("history", []) for p in m["parts"]]
            texts.append(text_of_status(doc))
            if any("admitted" in t for t in texts) or doc["status"]["state"] in TERMINAL:
                break
            time.sleep(0.02)
        admitted = time.monotonic() - proc.started
        log = proc.log.read_text(errors="replace")
        decoded = [ln for ln in log.splitlines() if " decoded in " in ln and "sha256" in ln]
        prefill_s = (float(decoded[0].split(" decoded in ")[1].split("s;")[0])
                     if decoded else None)
        return {"ready_s": round(ready, 3), "first_admitted_s": round(admitted, 3),
                "prefix_decode_s": prefill_s,
                "warm_started": "warm-started from cache" in log,
                "gate_seed": "cache" if "seeded from cache" in log else "benchmark"}
    finally:
        proc.kill()


def text_of_status(doc: dict[str, Any]) -> str:
    return "".join(p.get("text", "") for p in doc["status"].get("message", {}).get("parts", []))


def prefix_cache_phase(root: Path, args: argparse.Namespace,
                       env: dict[str, str]) -> dict[str, Any]:
    shared = root / "shared-prefix-cache"
    from mesh.template.loader import sample_project_dir

    # The template's own sample project: the same prefix whatever the working directory.
    common = ["--template", args.prefix_template, "--prefix-tokens", str(args.prefix_tokens),
              "--project", str(sample_project_dir()), "--prefix-cache", str(shared),
              "--simulation"]
    if args.prefix_model != "default":
        common = ["--model", args.prefix_model, *common]
    cold = first_admitted(root, "cold", ["--data-dir", str(root / "cold"), *common], env)
    # The pair that isolates the prefix: both have the gate's seed (so neither runs the
    # seed micro-benchmark; it lives beside the snapshots, so the shared dir already holds
    # the cold node's); one decodes the prefix into an empty snapshot dir (given a copy of
    # the seed), the other restores the snapshot the cold node wrote.
    for name in ("cold-prefix", "shared"):
        (root / name).mkdir()
    shutil.copytree(shared / "gate", root / "empty-prefix-cache" / "gate")
    own = list(common)
    own[own.index("--prefix-cache") + 1] = str(root / "empty-prefix-cache")
    cold_prefix = first_admitted(root, "cold-prefix",
                                 ["--data-dir", str(root / "cold-prefix"), *own], env)
    warm = first_admitted(root, "shared", ["--data-dir", str(root / "shared"), *common], env)
    size = sum(p.stat().st_size for p in shared.glob("*.kv"))
    return {"model": args.prefix_model, "template": args.prefix_template,
            "prefix_tokens": _prefix_tokens(root / "cold.log"),
            "prefix_tokens_target": args.prefix_tokens, "snapshot_bytes": size,
            "cold": cold, "cold_prefix_gate_cached": cold_prefix,
            "shared_prefix_gate_cached": warm,
            "method": "seconds from Popen to the first subtask's 'admitted' status; cold: "
                      "nothing cached (prefill + the gate's seed micro-benchmark); the other "
                      "two have cold's gate seed, then decode the prefix "
                      "(cold_prefix) or restore cold's snapshot from the shared "
                      "--prefix-cache (shared)"}


def _prefix_tokens(log: Path) -> int | None:
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("prefix: ") and " tokens, sha256 " in line:
            return int(line.split()[1])
    return None


def fleet_table(p: int = 131072, gpu_cells: int = 1 << 20, max_seqs: int = 255,
                sessions: Sequence[int] = (8192, 32768, 131072),
                fleet: Sequence[int] = (1, 2, 4, 8)) -> list[dict[str, Any]]:
    """Agents a fleet of K nodes holds: pooled (prefix once per node, then S per agent,
    at most ``max_seqs`` sequences per pool) vs naive (P + S per agent)."""
    rows = []
    for s in sessions:
        pooled = min(max_seqs, (gpu_cells - p) // s)
        naive = gpu_cells // (p + s)
        for k in fleet:
            rows.append({"P": p, "S": s, "K": k, "pooled": k * pooled, "naive": k * naive,
                         "ratio": round(pooled / naive, 2) if naive else None})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="the nodes' model (default tiny)")
    ap.add_argument("--n", type=int, default=20, help="tasks per routing leg")
    ap.add_argument("--share-tasks", type=int, default=24)
    ap.add_argument("--gap-s", type=float, default=0.08)
    ap.add_argument("--node-prefix", type=int, default=256)
    ap.add_argument("--prefix-model", default="default")
    ap.add_argument("--prefix-template", default="heavy")
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--gate-cache", default=None, metavar="DIR",
                    help="copy these gate seed files into each node's data dir (skips the "
                         "seed micro-benchmark at start; the files are keyed by model+machine)")
    ap.add_argument("--skip-prefix-cache", action="store_true")
    ap.add_argument("--only-prefix-cache", action="store_true",
                    help="run only the prefix-cache phase; update --out's other phases kept")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "nodes.json"))
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="mesh-nodes-bench-"))
    args.project = root / "project"
    args.project.mkdir()
    (args.project / "README.md").write_text("# demo\nA small project for the nodes bench.\n")
    (args.project / "main.py").write_text("def add(a, b):\n    return a + b\n")
    env = dict(os.environ)
    env.pop("MESH_AUTH_TOKEN", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    result: dict[str, Any] = {"meta": {
        "model": args.model, "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python bench/nodes_bench.py " + " ".join(argv or sys.argv[1:])}}
    if args.only_prefix_cache and Path(args.out).is_file():
        kept = json.loads(Path(args.out).read_text())
        result = {**kept, "meta": {**kept.get("meta", {}),
                                   "prefix_cache_command": result["meta"]["command"]}}
    try:
        if not args.only_prefix_cache:
            fleet = Fleet(root / "routing", args, env, ("static:4", "static:2"))
            try:
                result["routing"] = routing_phase(fleet, args.n)
                result["share"] = share_phase(fleet, args.share_tasks, args.gap_s)
                result["kill"] = kill_phase(fleet)
            finally:
                fleet.close()
        if not args.skip_prefix_cache:
            result["prefix_cache"] = prefix_cache_phase(root / "prefix", args, env)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["fleet"] = fleet_table()
    result["meta"]["elapsed_s" if not args.only_prefix_cache else "prefix_cache_elapsed_s"] = (
        round(time.monotonic() - t0, 1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    return 0


def print_table(r: dict[str, Any]) -> None:
    ro = r["routing"]
    print(f"routing  direct p50 {ro['direct']['p50_ms']:.1f} ms p95 {ro['direct']['p95_ms']:.1f}"
          f" | via coordinator p50 {ro['via_coordinator']['p50_ms']:.1f} ms p95 "
          f"{ro['via_coordinator']['p95_ms']:.1f} | added p50 {ro['added_p50_ms']:.1f} ms "
          f"p95 {ro['added_p95_ms']:.1f} ms")
    sh = r["share"]
    print(f"share    {sh['agree']}/{sh['decided']} decided sends went to the max-headroom node"
          f" (routed per node: {sh['routed_per_node']})")
    k = r["kill"]
    print(f"kill -9  {k['completed']}/{k['tasks']} tasks completed, all terminal: "
          f"{k['all_terminal']}, retried {k['retried']}, last terminal "
          f"{k['last_terminal_after_kill_s']} s after the kill")
    if "prefix_cache" in r:
        pc = r["prefix_cache"]
        for key in ("cold", "cold_prefix_gate_cached", "shared_prefix_gate_cached"):
            v = pc[key]
            print(f"start    {key:26s} first admitted {v['first_admitted_s']:7.2f} s "
                  f"(prefix decode {v.get('prefix_decode_s')} s, warm {v['warm_started']}, "
                  f"gate {v['gate_seed']})")
    print("fleet    P      S       K  pooled  naive  ratio")
    for row in r["fleet"]:
        print(f"         {row['P']:<6d} {row['S']:<7d} {row['K']:<2d} {row['pooled']:<7d} "
              f"{row['naive']:<6d} {row['ratio']}")


if __name__ == "__main__":
    sys.exit(main())
