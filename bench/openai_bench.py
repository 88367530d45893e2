"""The multi-turn agent workload through OpenAI-style chat APIs: mesh vs other servers.

N agents run T turns each, all at once: every turn asks for G tokens (greedy), then the
agent appends a simulated tool result (~60 tokens) and asks again. Every agent's first
message is the same system text: mesh's prefix (``GET /v1/prefix``), so every server is
sent byte-identical prompts. Two waves run back to back: the first from a cold server
(start-up included when this script starts the server), the second with new agents on the
warm server. Per target and wave: wall time, turn latency p50/p95, prompt tokens the
server actually processed (``prompt_tokens - cached_tokens``, or llama.cpp's
``timings.prompt_n``) and the KV cells it was given.

    python -m bench.openai_bench --spawn-mesh "--model tiny --policy none" --agents 4
    python -m bench.openai_bench --spawn-mesh "--policy none --max-sessions 8" \\
        --llama-server http://127.0.0.1:8080 --llama-server-cells 40760 \\
        --llama-cpp-server http://127.0.0.1:8081

``--spawn-mesh ARGS`` starts ``mesh serve ARGS`` on a free port (and stops it); ``--mesh URL``
uses a running one. Other servers are only measured when their URL is given (start them
yourself with the same model; their start-up is then not included). Prints a table and
writes ``bench/results/openai.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.servers import free_port, stop, wait_healthy

TOOL_RESULT = ("courier/parcel.py:{n}: def route(parcel, depot): return depot.next_hop("
               "parcel.zone) if parcel.zone in depot.zones else None  # {n} of the log, "
               "status ok, 3 tests passed, 0 failed, elapsed 0.{n}s")


@dataclass
class Wave:
    wall_s: float = 0.0
    turns: int = 0
    errors: int = 0
    turn_p50_s: float = 0.0
    turn_p95_s: float = 0.0
    prompt_tokens_processed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latencies: list[float] = field(default_factory=list, repr=False)


@dataclass
class Target:
    name: str
    url: str
    kv_cells: int | None = None
    startup_s: float | None = None
    waves: list[Wave] = field(default_factory=list)


def spawn_mesh(args: str, log: Path) -> tuple[subprocess.Popen[bytes], str, float]:
    port = free_port()
    argv = [sys.executable, "-m", "mesh", "serve", "--host", "127.0.0.1", "--port", str(port),
            *shlex.split(args)]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        return proc, url, wait_healthy(url, proc, limit_s=900, log=log, name="mesh serve")
    except RuntimeError as exc:
        stop(proc)
        raise SystemExit(str(exc)) from None


def processed(body: dict[str, Any]) -> int:
    timings = body.get("timings") or {}
    if "prompt_n" in timings:
        return int(timings["prompt_n"])
    usage = body.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return int(usage.get("prompt_tokens", 0)) - int(cached)


async def chat(client: httpx.AsyncClient, messages: list[dict[str, str]], tokens: int,
               slot: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "bench", "messages": messages, "max_tokens": tokens,
                            "temperature": 0, "seed": 1}
    if slot is not None:  # llama-server: pin each agent to its own slot
        body["id_slot"], body["cache_prompt"] = slot, True
    for _ in range(200):
        r = await client.post("/v1/chat/completions", json=body)
        if r.status_code == 429:
            await asyncio.sleep(float(r.headers.get("retry-after", "1")))
            continue
        r.raise_for_status()
        doc: dict[str, Any] = r.json()
        return doc
    raise RuntimeError("still 429 after 200 tries")


async def agent(client: httpx.AsyncClient, system: str, wave: int, i: int, turns: int,
                tokens: int, slot: int | None, out: Wave) -> None:
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": f"Task w{wave}a{i}: find where parcels are routed "
                 f"and explain step {i} of the route."}]
    for t in range(turns):
        t0 = time.monotonic()
        try:
            body = await chat(client, messages, tokens, slot)
        except (httpx.HTTPError, RuntimeError):
            out.errors += 1
            return
        out.latencies.append(time.monotonic() - t0)
        out.turns += 1
        usage = body.get("usage") or {}
        out.prompt_tokens += int(usage.get("prompt_tokens", 0))
        out.completion_tokens += int(usage.get("completion_tokens", 0))
        out.prompt_tokens_processed += processed(body)
        reply = body["choices"][0]["message"].get("content") or ""
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": TOOL_RESULT.format(n=wave * 100 + i * 10 + t)}]


async def run_target(target: Target, system: str, a: argparse.Namespace, pin: bool) -> None:
    async with httpx.AsyncClient(base_url=target.url, timeout=a.timeout) as client:
        for w in range(2):
            wave = Wave()
            t0 = time.monotonic()
            await asyncio.gather(*(agent(client, system, w, i, a.turns, a.tokens,
                                         i if pin else None, wave) for i in range(a.agents)))
            wave.wall_s = time.monotonic() - t0
            if wave.latencies:
                q = sorted(wave.latencies)
                wave.turn_p50_s = statistics.median(q)
                wave.turn_p95_s = q[min(len(q) - 1, int(0.95 * len(q)))]
            target.waves.append(wave)
        if target.name == "mesh":
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                cap = (await client.get("/capacity")).json()
                target.kv_cells = int(cap["kv_cells"]["total"])


def table(targets: list[Target]) -> str:
    rows = ["| system | wave | wall s | +start-up s | turn p50 s | turn p95 s | prompt tok "
            "processed | KV cells | errors |", "|---|---|---|---|---|---|---|---|---|"]
    for t in targets:
        for i, w in enumerate(t.waves):
            start = f"{t.startup_s:.1f}" if (i == 0 and t.startup_s is not None) else ""
            rows.append(f"| {t.name} | {i + 1} | {w.wall_s:.1f} | {start} | {w.turn_p50_s:.2f} "
                        f"| {w.turn_p95_s:.2f} | {w.prompt_tokens_processed:,} | "
                        f"{t.kv_cells or '?'} | {w.errors} |")
    return "\n".join(rows)


async def amain(a: argparse.Namespace) -> int:
    targets: list[Target] = []
    proc = None
    log = Path(tempfile.mkdtemp(prefix="openai-bench-")) / "mesh.log"
    try:
        if a.spawn_mesh is not None:
            proc, url, startup = spawn_mesh(a.spawn_mesh, log)
            targets.append(Target("mesh", url, startup_s=startup))
        elif a.mesh:
            targets.append(Target("mesh", a.mesh.rstrip("/")))
        if a.system_file:
            system = Path(a.system_file).read_text()
        elif targets:
            system = httpx.get(targets[0].url + "/v1/prefix", timeout=30).json()["system"]
        else:
            raise SystemExit("give --spawn-mesh, --mesh or --system-file")
        if a.llama_server:
            targets.append(Target("llama-server", a.llama_server.rstrip("/"),
                                  kv_cells=a.llama_server_cells))
        if a.llama_cpp_server:
            targets.append(Target("llama-cpp-python server", a.llama_cpp_server.rstrip("/"),
                                  kv_cells=a.llama_cpp_server_cells))
        for t in targets:
            await run_target(t, system, a, pin=t.name == "llama-server" and a.pin_slots)
    finally:
        if proc is not None:
            stop(proc)
    print(table(targets))
    doc = {
        "workload": {"agents": a.agents, "turns": a.turns, "tokens": a.tokens,
                     "system_chars": len(system), "mesh_args": a.spawn_mesh},
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "targets": [{**asdict(t), "waves": [
            {k: v for k, v in asdict(w).items() if k != "latencies"} for w in t.waves]}
            for t in targets],
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if all(w.errors == 0 for t in targets for w in t.waves) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spawn-mesh", metavar="ARGS", default=None,
                   help='start "mesh serve ARGS" (e.g. "--model tiny --policy none")')
    p.add_argument("--mesh", metavar="URL", default=None, help="a running mesh serve")
    p.add_argument("--llama-server", metavar="URL", default=None)
    p.add_argument("--llama-server-cells", type=int, default=None, help="its -c")
    p.add_argument("--pin-slots", action="store_true", help="agent i -> llama-server slot i")
    p.add_argument("--llama-cpp-server", metavar="URL", default=None)
    p.add_argument("--llama-cpp-server-cells", type=int, default=None, help="its --n_ctx")
    p.add_argument("--system-file", default=None, help="system text (default: mesh's prefix)")
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default="bench/results/openai.json")
    # A SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so a spawned server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return asyncio.run(amain(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
