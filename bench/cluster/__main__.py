"""One pool vs two Ray pools on this machine, on a multi-turn agent workload (issue 43 item 5).

The same workload runs three times through the one engine interface: on one local
:class:`~mesh.engine.pool.SharedKVPool`, on two pools as Ray actors
(:class:`~mesh.cluster.pools.RayPools`, one thread each), and again on two Ray pools with
one pool's process killed (SIGKILL) once a third of the turns are done. N agents each
attach, then run T turns of K greedy tokens with a tool call between turns (a seeded
latency, then a tool result appended).

Reported: wall time and turn p50/p95 for each; for Ray, the **routing overhead per turn**
(a turn's wall time at the coordinator less the pool actor's own time for it: the Ray
hops, the streamed pieces' transfer, the coordinator's side) and the attach time (route
plus the actor call); after the kill, how many agents completed all their turns, how many
sessions moved to the other pool, and how many failed (with their messages). A last run
has one agent take 4T turns alone on two Ray pools: the hop without the N agents' decoding
competing with it for this machine's cores.

    python -m bench.cluster                 # -> bench/cluster/results/cluster.json
    python -m bench.cluster --quick         # the test's run, to a temporary path
    python -m bench.cluster --ray HOST:PORT # on a cluster already running

Without ``--ray`` it starts a local Ray instance of its own (2 CPUs, a small object store)
and stops it at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray

from bench.common.agent_workload import TOOL_RESULT
from mesh.cluster.pools import PoolPlacement, RayPools
from mesh.engine.config import EngineConfig, SamplingParams
from mesh.engine.interface import Engine, EngineError
from mesh.engine.llama import LlamaModel
from mesh.engine.models import resolve_model
from mesh.engine.pool import SharedKVPool

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "cluster.json"
QUICK_OUT = Path(tempfile.gettempdir()) / "mesh-bench" / "cluster.json"  # never a result
PREFIX_LINE = "You are one agent of many; read the project, call tools, answer briefly. "


@dataclass
class Run:
    name: str
    wall_s: float = 0.0
    turns: int = 0
    turn_p50_ms: float = 0.0
    turn_p95_ms: float = 0.0
    agents_completed: int = 0
    agents_failed: int = 0
    failures: list[str] = field(default_factory=list)
    overhead_p50_ms: float | None = None  # Ray: wall - the pool's own time, per turn
    overhead_p95_ms: float | None = None
    attach_p50_ms: float | None = None
    sessions_moved: int | None = None
    killed_after_turns: int | None = None
    last_done_after_kill_s: float | None = None


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


async def workload(engine: Engine, a: argparse.Namespace, run: Run,
                   on_turn: Callable[[int], None] | None = None) -> list[float]:
    """Every agent's turns; returns the attach times (s)."""
    rng = random.Random(a.seed)
    latencies = [[rng.uniform(0.05, 0.3) for _ in range(a.turns)] for _ in range(a.agents)]
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, stop_at_eos=False)
    turn_s: list[float] = []
    attach_s: list[float] = []
    done_at: list[float] = []

    async def agent(i: int) -> None:
        t0 = time.perf_counter()
        session = await engine.attach()
        attach_s.append(time.perf_counter() - t0)
        try:
            session.append(f"Agent {i}: find where parcels are routed and say why.")
            for t in range(a.turns):
                t0 = time.perf_counter()
                async for _ in session.generate(params):
                    pass
                turn_s.append(time.perf_counter() - t0)
                run.turns += 1
                if on_turn is not None:
                    on_turn(run.turns)
                if t < a.turns - 1:
                    await asyncio.sleep(latencies[i][t])
                    session.append("\n" + TOOL_RESULT.format(n=i * 10 + t) + "\n")
            run.agents_completed += 1
            done_at.append(time.perf_counter())
        except EngineError as exc:
            run.agents_failed += 1
            run.failures.append(f"agent {i}: {type(exc).__name__}: {exc}")
        finally:
            await session.detach()

    t0 = time.perf_counter()
    await asyncio.gather(*(agent(i) for i in range(a.agents)))
    run.wall_s = round(time.perf_counter() - t0, 3)
    run.turn_p50_ms = round(pct(turn_s, 0.5) * 1e3, 2)
    run.turn_p95_ms = round(pct(turn_s, 0.95) * 1e3, 2)
    if done_at:
        run.last_done_after_kill_s = max(done_at)  # made relative by the caller
    return attach_s


def config(a: argparse.Namespace, model: str, max_sessions: int) -> EngineConfig:
    return EngineConfig(model_path=model, max_sessions=max_sessions,
                        session_budget=a.budget, n_threads=1)


async def one_pool(a: argparse.Namespace, model: str, prefix: str) -> Run:
    run = Run("one local pool, 1 thread")
    pool = SharedKVPool(config(a, model, a.agents), prefix)
    await pool.start()
    try:
        await workload(pool, a, run)
    finally:
        await pool.aclose()
    run.last_done_after_kill_s = None  # nothing was killed
    return run


async def ray_pools(a: argparse.Namespace, model: str, prefix: str, *, kill: bool = False,
                    alone: bool = False) -> Run:
    name = "two Ray pools, 1 thread each" + (", one killed mid-run" if kill else "")
    if alone:  # the hop itself: one agent, its turns one after another, nothing else running
        name = "two Ray pools, one agent alone (the hop without contention)"
        a = argparse.Namespace(**{**vars(a), "agents": 1, "turns": a.turns * 4,
                                  "budget": a.budget * 4})
    run = Run(name)
    vocab = LlamaModel(model, vocab_only=True)
    pools = RayPools(functools.partial(SharedKVPool, config(a, model, a.agents), prefix),
                     num_pools=2, placement=PoolPlacement(num_cpus=1.0),
                     tokenize=lambda text: vocab.tokenize(text, add_bos=False),
                     on_close=vocab.close)
    await pools.start()
    try:
        on_turn = None
        killed_at: list[float] = []
        if kill:
            pid = await pools.pools[0].actor.pid.remote()
            at = max(1, a.agents * a.turns // 3)

            def on_turn(done: int) -> None:
                if done == at and not killed_at:
                    os.kill(pid, signal.SIGKILL)
                    killed_at.append(time.perf_counter())
                    run.killed_after_turns = done

        attach_s = await workload(pools, a, run, on_turn)
        over = list(pools.turn_overheads)
        run.overhead_p50_ms = round(pct(over, 0.5) * 1e3, 2)
        run.overhead_p95_ms = round(pct(over, 0.95) * 1e3, 2)
        run.attach_p50_ms = round(pct(attach_s, 0.5) * 1e3, 2)
        run.sessions_moved = pools.num_moved
        if killed_at and run.last_done_after_kill_s is not None:
            run.last_done_after_kill_s = round(run.last_done_after_kill_s - killed_at[0], 3)
        else:
            run.last_done_after_kill_s = None
    finally:
        await pools.aclose()
    if not kill:
        run.last_done_after_kill_s = None
    return run


def table(runs: list[Run]) -> str:
    lines = ["| run | wall s | turn p50 / p95 ms | routing overhead per turn p50 / p95 ms "
             "| attach p50 ms | agents completed | sessions moved |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        over = (f"{r.overhead_p50_ms} / {r.overhead_p95_ms}"
                if r.overhead_p50_ms is not None else "—")
        lines.append(f"| {r.name} | {r.wall_s} | {r.turn_p50_ms} / {r.turn_p95_ms} | {over} | "
                     f"{r.attach_p50_ms if r.attach_p50_ms is not None else '—'} | "
                     f"{r.agents_completed} / {r.agents_completed + r.agents_failed} | "
                     f"{r.sessions_moved if r.sessions_moved is not None else '—'} |")
    return "\n".join(lines)


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    model = str(resolve_model(a.model).path)
    vocab = LlamaModel(model, vocab_only=True)
    try:
        line = vocab.tokenize(PREFIX_LINE, add_bos=False)
        prefix = PREFIX_LINE * max(1, a.prefix_tokens // max(1, len(line)))
        prefix_tokens = len(vocab.tokenize(prefix, add_bos=True))
    finally:
        vocab.close()
    runs = [await one_pool(a, model, prefix),
            await ray_pools(a, model, prefix),
            await ray_pools(a, model, prefix, kill=True),
            await ray_pools(a, model, prefix, alone=True)]
    return {"model": model, "prefix_tokens": prefix_tokens, "agents": a.agents,
            "turns": a.turns, "tokens_per_turn": a.tokens, "cpus": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "ray": ray.__version__, "runs": [asdict(r) for r in runs], "table": table(runs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ray", default=None, metavar="HOST:PORT",
                   help="join this cluster (default: start a local one, 2 CPUs)")
    p.add_argument("--quick", action="store_true", help="4 agents x 3 turns x 8 tokens")
    p.add_argument("--out", type=Path, default=None,
                   help=f"default: {DEFAULT_OUT} (with --quick: {QUICK_OUT})")
    a = p.parse_args(argv)
    if a.out is None:
        a.out = QUICK_OUT if a.quick else DEFAULT_OUT
    if a.quick:
        a.agents, a.turns, a.tokens, a.prefix_tokens, a.budget = 4, 3, 8, 256, 512
    if a.ray:
        ray.init(address=a.ray, log_to_driver=False, namespace="mesh-bench")
    else:
        ray.init(address="local", num_cpus=2, object_store_memory=80 * 1024 * 1024,
                 include_dashboard=False, log_to_driver=False, namespace="mesh-bench")
    try:
        doc = asyncio.run(main_async(a))
    finally:
        ray.shutdown()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(doc["table"])
    print(f"-> {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
