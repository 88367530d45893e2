"""The multi-turn agent workload through OpenAI-style chat APIs: mesh, llama-server, vLLM.

N agents run T turns each, all at once: every turn asks for G tokens (greedy), then the
agent appends a simulated tool result (~60 tokens) and asks again. Every agent's first
message is the same system text: mesh's prefix (``GET /v1/prefix``), so every server is
sent byte-identical messages. Two waves run back to back: the first from a cold server
(its start-up shown apart when this script starts the server), the second with new agents
on the warm server. Per system, prefix size P and agent count N, per wave: wall time, turn
latency p50/p95, prompt tokens the server actually processed (``prompt_tokens -
cached_tokens``, or llama.cpp's ``timings.prompt_n``) and the KV cells and bytes it holds.

    # one command, three systems, P = 1K and 4K, N = 8 and 32 (each started fresh per P, N)
    python -m bench.openai --spawn-mesh "--policy none" \\
        --spawn-llama-server "$(bash ../shared/tools/build-llama-server.sh)" \\
        --spawn-vllm --prefix-tokens 1024,4096 --agents 8,32
    # smoke: mesh on the tiny model, 2 agents x 1 turn of 4 tokens (what the suite runs)
    python -m bench.openai --quick

**P** is mesh's prefix size: the bench starts ``mesh serve --prefix-tokens P`` (the
template fills the prefix with labelled project text up to P tokens), reads the system text
from its ``/v1/prefix`` and sends that text to every system. **N** sets mesh's
``--max-sessions`` (unless ARGS set it), llama-server's ``-np N`` (agent i pinned to slot
i, ``-c N×(P+S)``, ``--cache-ram`` on) and vLLM's ``--max-num-seqs N`` with KV space for
N×(P+S) cells; S (``--session-tokens``) is one agent's conversation, estimated from T and G.
``--mesh``/``--llama-server``/``--vllm URL`` measure running servers instead (one P; start-up
not included; their cold wave is only cold if nothing ran on them before). Prints a table
and writes ``bench/openai/results/openai.json`` (or ``--out``; with ``--quick``, a temporary path:
``QUICK_OUT``). ``--quick`` with no system named spawns mesh as ``QUICK_MESH`` says.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common.agent_workload import (  # re-exported: the tests and bfcl_bench use them here
    Target,
    Wave,
    processed,
    ratio_lines,
    ratios,
    run_target,
    table,
)
from bench.common.servers import (
    Spawned,
    free_port,
    spawn_llama_server,
    spawn_vllm,
    stop,
    vllm_blocks,
    vllm_kv_tokens,
    wait_healthy,
)

__all__ = ["Target", "Wave", "main", "mesh_args", "parse", "processed", "ratio_lines", "ratios",
           "session_tokens", "spawn_mesh", "table"]


DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "openai.json"
QUICK_OUT = Path(tempfile.gettempdir()) / "mesh-bench" / "openai.json"
QUICK: dict[str, Any] = {"agents": [2], "turns": 1, "tokens": 4, "out": QUICK_OUT}
QUICK_MESH = ("--model tiny --policy none --threads 1 --data-dir "
              + shlex.quote(str(QUICK_OUT.parent / "openai-mesh-data")))


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


def mesh_args(args: str, prefix: int | None, agents: int) -> str:
    """``--spawn-mesh ARGS`` for one (P, N): ``--prefix-tokens P`` and ``--max-sessions N``
    added unless ARGS set them."""
    words = shlex.split(args)
    if prefix is not None and "--prefix-tokens" not in words:
        words += ["--prefix-tokens", str(prefix)]
    if "--max-sessions" not in words:
        words += ["--max-sessions", str(agents)]
    return shlex.join(words)


def int_list(text: str) -> list[int]:
    """``"8,32"`` → ``[8, 32]`` (argparse type; each value ≥ 1)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def session_tokens(turns: int, tokens: int) -> int:
    """One agent's conversation after its prefix, generously: the task message and chat
    markup (64), then per turn the reply (G) and a tool result with its markup (96)."""
    return 64 + turns * (tokens + 96)


def bytes_per_cell(gguf: str, elem_bytes: int) -> int | None:
    """KV bytes one cell (one token of one sequence) takes for ``gguf``'s model, at
    ``elem_bytes`` per element (2: f16, 4: f32); None when the GGUF cannot be read."""
    try:
        from mesh.engine.llama import LlamaModel

        vocab = LlamaModel(gguf, vocab_only=True)
        try:
            layers, kv_heads, k, v, _ = vocab.kv_shape()
        finally:
            vocab.close()
    except Exception:  # only a number in the report
        return None
    return layers * kv_heads * (k + v) * elem_bytes


@dataclass
class Run:
    """One (P, N): the system text, its size in tokens, and where logs go."""

    prefix: int | None
    agents: int
    logs: Path
    system: str = ""
    system_tokens: int = 0
    targets: list[Target] = field(default_factory=list)


async def measure(run: Run, a: argparse.Namespace) -> None:
    """Every system asked for, one after the other, at ``run``'s P and N."""
    tag = f"p{run.prefix or 'x'}-n{run.agents}"
    if a.spawn_mesh is not None:
        log = run.logs / f"mesh-{tag}.log"
        proc, url, startup = spawn_mesh(mesh_args(a.spawn_mesh, run.prefix, run.agents), log)
        try:
            pre = httpx.get(url + "/v1/prefix", timeout=30).json()
            run.system, run.system_tokens = pre["system"], int(pre["prefix_tokens"])
            t = Target("mesh", url, startup_s=startup, prefix_tokens=run.prefix,
                       agents=run.agents)
            await run_target(t, run.system, a, pin=False)
            if t.kv_cells and a.cell_bytes_f16:
                t.kv_bytes = t.kv_cells * a.cell_bytes_f16
            run.targets.append(t)
        finally:
            stop(proc)
    elif a.mesh:
        pre = httpx.get(a.mesh.rstrip("/") + "/v1/prefix", timeout=30).json()
        run.system, run.system_tokens = pre["system"], int(pre["prefix_tokens"])
        t = Target("mesh", a.mesh.rstrip("/"), agents=run.agents)
        await run_target(t, run.system, a, pin=False)
        run.targets.append(t)
    if a.system_file:
        run.system = Path(a.system_file).read_text()
        run.system_tokens = -(-len(run.system) // 3)  # no tokenizer here: generous
    if not run.system:
        raise SystemExit("give --spawn-mesh, --mesh or --system-file")
    cells = run.agents * (run.system_tokens + a.session_tokens)
    if a.spawn_llama_server:
        s = spawn_llama_server(a.spawn_llama_server, a.model, slots=run.agents, ctx=cells,
                               log=run.logs / f"llama-server-{tag}.log")
        await run_spawned(run, a, "llama-server", s, cells, a.cell_bytes_f16, pin=True)
    elif a.llama_server:
        t = Target("llama-server", a.llama_server.rstrip("/"), kv_cells=a.llama_server_cells,
                   prefix_tokens=run.prefix, agents=run.agents)
        await run_target(t, run.system, a, pin=a.pin_slots)
        run.targets.append(t)
    if a.spawn_vllm is not None:
        gguf = a.spawn_vllm or a.model
        f32 = (a.cell_bytes_f16 or 0) * 2
        limit = -(-(run.system_tokens + a.session_tokens) // 256) * 256
        s = spawn_vllm(gguf, name="bench", max_model_len=limit, kv_bytes=cells * f32,
                       max_seqs=run.agents, log=run.logs / f"vllm-{tag}.log",
                       blocks=vllm_blocks(run.agents, run.system_tokens + a.session_tokens))
        await run_spawned(run, a, "vLLM", s, vllm_kv_tokens(s.log), f32)
    elif a.vllm:
        t = Target("vLLM", a.vllm.rstrip("/").removesuffix("/v1"), prefix_tokens=run.prefix,
                   agents=run.agents)
        await run_target(t, run.system, a, pin=False)
        run.targets.append(t)
    if a.llama_cpp_server:
        t = Target("llama-cpp-python server", a.llama_cpp_server.rstrip("/"),
                   kv_cells=a.llama_cpp_server_cells, prefix_tokens=run.prefix,
                   agents=run.agents)
        await run_target(t, run.system, a, pin=False)
        run.targets.append(t)


async def run_spawned(run: Run, a: argparse.Namespace, name: str, s: Spawned,
                      cells: int | None, cell_bytes: int | None, *, pin: bool = False) -> None:
    try:
        t = Target(name, s.url, kv_cells=cells, startup_s=s.startup_s,
                   prefix_tokens=run.prefix, agents=run.agents,
                   kv_bytes=cells * cell_bytes if cells and cell_bytes else None)
        await run_target(t, run.system, a, pin=pin)
        run.targets.append(t)
    finally:
        s.close()


async def amain(a: argparse.Namespace) -> int:
    if (a.mesh or a.llama_server or a.vllm) and len(a.prefix_tokens or [0]) > 1:
        raise SystemExit("a running server has one prefix: give one --prefix-tokens value "
                         "with --mesh/--llama-server/--vllm URL, or spawn them")
    a.cell_bytes_f16 = bytes_per_cell(a.model, 2)
    logs = Path(tempfile.mkdtemp(prefix="openai-bench-"))
    runs = [Run(p, n, logs) for p in (a.prefix_tokens or [None]) for n in a.agents]
    for run in runs:
        await measure(run, a)
    targets = [t for r in runs for t in r.targets]
    print(table(targets))
    speed = ratios(targets)
    if speed:
        print(ratio_lines(speed))
    doc = {
        "workload": {"agents": a.agents, "turns": a.turns, "tokens": a.tokens,
                     "prefix_tokens": a.prefix_tokens, "session_tokens": a.session_tokens,
                     "mesh_args": a.spawn_mesh, "model": a.model},
        "runs": [{"prefix_tokens": r.prefix, "agents": r.agents, "system_chars": len(r.system),
                  "system_tokens": r.system_tokens} for r in runs],
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "logs": str(logs),
        "ratios": speed,
        "targets": [{**asdict(t), "waves": [
            {k: v for k, v in asdict(w).items() if k != "latencies"} for w in t.waves]}
            for t in targets],
    }
    out = a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out} (server logs: {logs})")
    return 0 if all(w.errors == 0 for t in targets for w in t.waves) else 1


def default_model(mesh_args: str | None = None) -> str:
    """The GGUF mesh serves: ``--model`` in ``--spawn-mesh ARGS`` resolved as ``mesh serve``
    resolves it (a path, smollm2, gemma, tiny, $MESH_MODEL), else mesh's default."""
    from mesh.engine.models import resolve_model

    words = shlex.split(mesh_args or "")
    spec = words[words.index("--model") + 1] if "--model" in words[:-1] else None
    return str(resolve_model(spec).path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}", description=__doc__.split("\n")[0])
    p.add_argument("--spawn-mesh", metavar="ARGS", default=None,
                   help='start "mesh serve ARGS" per P and N (e.g. "--policy none")')
    p.add_argument("--mesh", metavar="URL", default=None, help="a running mesh serve")
    p.add_argument("--spawn-llama-server", metavar="BIN", default=None,
                   help="start this llama-server binary per P and N (-np N, slots pinned)")
    p.add_argument("--llama-server", metavar="URL", default=None)
    p.add_argument("--llama-server-cells", type=int, default=None, help="its -c")
    p.add_argument("--pin-slots", action="store_true", help="agent i -> llama-server slot i")
    p.add_argument("--spawn-vllm", metavar="GGUF", nargs="?", const="", default=None,
                   help="start vLLM-CPU on this GGUF's weights (default: --model) per P and N "
                        "through ../shared/tools/vllm-cpu-serve.sh")
    p.add_argument("--vllm", metavar="URL", default=None, help="a running vLLM (APC on)")
    p.add_argument("--llama-cpp-server", metavar="URL", default=None)
    p.add_argument("--llama-cpp-server-cells", type=int, default=None, help="its --n_ctx")
    p.add_argument("--model", default=None,
                   help="GGUF the spawned llama-server and vLLM serve, and KV bytes are "
                        "computed for (default: --spawn-mesh's --model, else mesh's default)")
    p.add_argument("--system-file", default=None, help="system text (default: mesh's prefix)")
    p.add_argument("--prefix-tokens", type=int_list, default=None, metavar="P[,P...]",
                   help="mesh's prefix sizes (mesh serve --prefix-tokens), e.g. 1024,4096")
    p.add_argument("--agents", type=int_list, default=[8], metavar="N[,N...]")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--session-tokens", type=int, default=None, metavar="S",
                   help="KV cells one agent needs past the prefix (default: from T and G)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds one request may wait (a cold llama-server at N=32, P=4K "
                        "queues minutes of prefill)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"default: {DEFAULT_OUT} (with --quick: {QUICK_OUT})")
    p.add_argument("--quick", action="store_true",
                   help="2 agents x 1 turn of 4 tokens (and, if no system is named, "
                        f"--spawn-mesh {QUICK_MESH!r}): the suite's run, not a measurement")
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, with the defaults that depend on others filled in."""
    p = parser()
    a = p.parse_args(argv)
    if a.quick:  # the quick sizes become the defaults; flags given still win
        p.set_defaults(**QUICK)
        a = p.parse_args(argv)
        if not (a.mesh or a.llama_server or a.vllm or a.llama_cpp_server
                or a.spawn_llama_server or a.spawn_vllm is not None
                or a.spawn_mesh is not None):
            a.spawn_mesh = QUICK_MESH
    if a.session_tokens is None:
        a.session_tokens = session_tokens(a.turns, a.tokens)
    if a.model is None and (a.spawn_llama_server or a.spawn_vllm is not None
                            or a.spawn_mesh is not None):
        a.model = default_model(a.spawn_mesh)
    if a.spawn_mesh is not None and a.mesh:
        raise SystemExit("give --spawn-mesh or --mesh, not both")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    # A SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so a spawned server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return asyncio.run(amain(a))


if __name__ == "__main__":
    raise SystemExit(main())
