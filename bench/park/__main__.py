"""Parking benchmark (issue 28): more agents than the KV cache holds, mostly idle.

    .venv/bin/python -m bench.park                       # default model, P = 4K
    .venv/bin/python -m bench.park --model tiny --quick  # a dry run in seconds

Geometry (the source system's 4-naive / 7-pooled frame, scaled to this machine): a prefix
of ``P`` tokens and a KV budget of ``P + resident x S`` cells (``resident`` = 7 sequence
ids: ``max_sessions``), where ``S`` is the private context one agent reaches by its last
turn. ``N`` agents (7, 14, 28, 56) each run a multi-turn tool loop: append a tool result,
generate ``gen`` tokens, wait an idle gap (exponential, mean ``idle``) as if a tool ran,
``turns`` times, then detach. Each N runs once per mode:

* ``none``: no parking (``max_attached = max_sessions``): an agent that finds no slot
  waits for one (``attach`` refused: retried every 50 ms);
* ``recompute``: parking on (``max_attached = N``), a resumed agent's suffix re-prefilled;
* ``swap``: the same with ``park_memory`` (suffix cells copied to host RAM and back);
* ``llama-server`` (with ``--llama-server BINARY``): llama.cpp's server at the same KV
  memory, ``-np`` = the slots that hold a whole context without a shared prefix,
  ``--cache-ram`` ``--llama-cache-ram`` MiB, the same agents through its OpenAI API
  (:mod:`bench.park.llama_server`; binary: ``bash ../shared/tools/build-llama-server.sh``).

Reported per run: agents served (finished every turn), how many were attached at once at
most, task wall, attach wait p50/p95 (without parking, an agent waits here for a slot),
turn-start latency p50/p95 (time from ``generate`` to its first token:
the turn's own prefill, a resume, a wait for a slot), the same for resumed turns alone,
decode tokens/s per turn p50/min, parks, resumes, re-prefilled tokens and host bytes.

``cost`` measures a resume alone: one agent with a suffix of k tokens, parked, then one
token generated; its first-token time minus an unparked twin's, per 1K suffix tokens, for
recompute and swap (plus the swap's park time): the crossover is where they meet.

Results go to ``bench/park/results/park.json`` (or ``--out``; with ``--quick``, a temporary path:
``QUICK_OUT``); a table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.park.llama_server import llama_server_slots, run_llama_server
from mesh.engine.config import EngineConfig, SamplingParams
from mesh.engine.interface import PoolFull
from mesh.engine.models import resolve_model
from mesh.engine.pool import SharedKVPool
from mesh.engine.session import PooledSession

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "park.json"
QUICK_OUT = Path(tempfile.gettempdir()) / "mesh-bench" / "park.json"
QUICK: dict[str, Any] = {"prefix": 256, "suffix": 256, "agents": "7,14", "turns": 2, "idle": 0.2,
                         "gen": 8, "cost_sizes": "64,192", "out": QUICK_OUT}
WORDS = ("agent", "tool", "file", "module", "test", "build", "cache", "index", "route",
         "queue", "task", "worker", "token", "prefix", "session", "decode", "batch",
         "sample", "model", "layer", "vector", "buffer", "config", "server", "client",
         "request", "response", "stream", "event", "status", "error", "retry", "limit",
         "budget", "window", "report", "table", "user", "project", "package", "import",
         "export", "parse", "render", "check", "commit", "branch", "merge")
MODES = ("none", "recompute", "swap")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def tokens(pool: SharedKVPool, rng: random.Random, n: int) -> list[int]:
    """Exactly ``n`` token ids of word text."""
    out: list[int] = []
    while len(out) < n:
        out += pool.tokenize(" " + words(rng, max(8, n - len(out))))
    return out[:n]


@dataclass
class Geometry:
    prefix: int
    suffix: int  # private tokens one agent holds by its last turn
    resident: int  # sequence ids (max_sessions)
    turns: int
    gen: int
    idle_s: float

    @property
    def tool(self) -> int:
        """Tool-result tokens per turn so that turns x (tool + gen) fills ``suffix``."""
        return max(1, self.suffix // self.turns - self.gen - 1)


@dataclass
class Run:
    mode: str
    agents: int
    served: int = 0
    failed: list[str] = field(default_factory=list)
    max_attached: int = 0
    wall_s: float = 0.0
    turn_start: list[float] = field(default_factory=list)
    attach_wait: list[float] = field(default_factory=list)
    resumed_start: list[float] = field(default_factory=list)
    tps: list[float] = field(default_factory=list)
    load: dict[str, int] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        def q(xs: list[float], p: float) -> float | None:
            if not xs:
                return None
            xs = sorted(xs)
            return xs[min(len(xs) - 1, int(p * len(xs)))]

        return {"mode": self.mode, "agents": self.agents, "served": self.served,
                "failed": self.failed[:5], "max_attached_at_once": self.max_attached,
                "wall_s": self.wall_s,
                "turn_start_p50_s": q(self.turn_start, 0.5),
                "turn_start_p95_s": q(self.turn_start, 0.95),
                "attach_wait_p50_s": q(self.attach_wait, 0.5),
                "attach_wait_p95_s": q(self.attach_wait, 0.95),
                "resumed_turns": len(self.resumed_start),
                "resumed_start_p50_s": q(self.resumed_start, 0.5),
                "resumed_start_p95_s": q(self.resumed_start, 0.95),
                "decode_tps_p50": statistics.median(self.tps) if self.tps else None,
                "decode_tps_min": min(self.tps) if self.tps else None, **self.load}


async def make_pool(model: str, g: Geometry, mode: str, agents: int, threads: int | None,
                    prefix: list[int]) -> SharedKVPool:
    cfg = EngineConfig(model_path=model, max_sessions=g.resident, session_budget=g.suffix,
                       n_ctx=g.prefix + g.resident * g.suffix + 64, n_threads=threads,
                       max_attached=g.resident if mode == "none" else max(agents, g.resident),
                       park_memory=(1 << 40) if mode == "swap" else 0)
    pool = SharedKVPool(cfg, prefix)
    await pool.start()
    return pool


async def agent(pool: SharedKVPool, g: Geometry, i: int, run: Run, seed: int,
                attached: list[int]) -> None:
    rng = random.Random(seed * 1000 + i)
    await asyncio.sleep(rng.uniform(0, g.idle_s))  # arrivals spread over one idle gap
    s: PooledSession | None = None
    asked = time.monotonic()
    while s is None:
        try:
            s = await pool.attach()
        except PoolFull:
            await asyncio.sleep(0.05)
    assert s is not None
    run.attach_wait.append(time.monotonic() - asked)
    attached[0] += 1
    run.max_attached = max(run.max_attached, attached[0])
    params = SamplingParams(max_tokens=g.gen, stop_at_eos=False)
    try:
        for _ in range(g.turns):
            s.append_tokens(tokens(pool, rng, g.tool))
            was_parked = s.parked
            t0 = time.monotonic()
            first = last = None
            n = 0
            async for _piece in s.generate(params):
                last = time.monotonic()
                first = first or last
                n += 1
            if first is None or last is None:
                raise RuntimeError("a turn produced no token")
            run.turn_start.append(first - t0)
            if was_parked:
                run.resumed_start.append(first - t0)
            if n > 1 and last > first:
                run.tps.append((n - 1) / (last - first))
            await asyncio.sleep(rng.expovariate(1.0 / g.idle_s) if g.idle_s > 0 else 0.0)
        run.served += 1
    except Exception as exc:  # counted, not raised: "nothing lost" is a result
        run.failed.append(f"agent {i}: {exc!r}")
    finally:
        attached[0] -= 1
        await s.detach()


async def one_run(model: str, g: Geometry, mode: str, agents: int, threads: int | None,
                  prefix: list[int], seed: int) -> Run:
    pool = await make_pool(model, g, mode, agents, threads, prefix)
    run = Run(mode, agents)
    try:
        attached = [0]
        t0 = time.monotonic()
        await asyncio.gather(*(agent(pool, g, i, run, seed, attached) for i in range(agents)))
        run.wall_s = time.monotonic() - t0
        load = pool.load()
        run.load = {"parks": load.parks, "resumes": load.resumes,
                    "resume_tokens": load.resume_tokens, "swaps": load.swaps,
                    "prefill_tokens": load.prefill_tokens}
    finally:
        await pool.aclose()
    return run


async def resume_cost(model: str, g: Geometry, threads: int | None, prefix: list[int],
                      sizes: list[int]) -> list[dict[str, Any]]:
    """First-token time of a resumed session minus an unparked twin's, per suffix size."""
    rows = []
    one = SamplingParams(max_tokens=1, stop_at_eos=False)
    for mode in ("recompute", "swap"):
        pool = await make_pool(model, g, mode, 2, threads, prefix)
        try:
            for k in sizes:
                rng = random.Random(k)
                a, twin = await pool.attach(), await pool.attach()
                body = tokens(pool, rng, k)
                for s in (a, twin):
                    s.append_tokens(body)
                    _ = [p async for p in s.generate(one)]
                t0 = time.monotonic()
                await pool.park(a)
                park_s = time.monotonic() - t0
                host = pool.load().parked_bytes
                times = []
                for s in (a, twin):
                    s.append_tokens(tokens(pool, rng, 8))
                    t0 = time.monotonic()
                    _ = [p async for p in s.generate(one)]
                    times.append(time.monotonic() - t0)
                extra = times[0] - times[1]
                rows.append({"mode": mode, "suffix_tokens": k, "park_s": park_s,
                             "resume_extra_s": extra, "per_1k_s": extra * 1000 / k,
                             "host_bytes_per_1k": host * 1000 // k})
                await a.detach()
                await twin.detach()
        finally:
            await pool.aclose()
    return rows


def table(runs: list[dict[str, Any]], cost: list[dict[str, Any]]) -> str:
    def f(x: Any, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    out = ["| mode | N | served | at once | wall s | attach wait p50/p95 s | "
           "start p50/p95 s | resumed p50/p95 s | tok/s p50/min | parks | resumes | "
           "re-prefilled |", "|" + "---|" * 12]
    for r in runs:
        out.append(f"| {r['mode']} | {r['agents']} | {r['served']} | "
                   f"{r['max_attached_at_once']} | {f(r['wall_s'], '.1f')} | "
                   f"{f(r['attach_wait_p50_s'])}/{f(r['attach_wait_p95_s'])} | "
                   f"{f(r['turn_start_p50_s'])}/{f(r['turn_start_p95_s'])} | "
                   f"{f(r['resumed_start_p50_s'])}/{f(r['resumed_start_p95_s'])} | "
                   f"{f(r['decode_tps_p50'], '.1f')}/{f(r['decode_tps_min'], '.1f')} | "
                   f"{r.get('parks', 0)} | {r.get('resumes', 0)} | {r.get('resume_tokens', 0)} |")
    out += ["", "| mode | suffix tokens | park s | resume extra s | per 1K s | host B/1K |",
            "|---|---|---|---|---|---|"]
    for c in cost:
        out.append(f"| {c['mode']} | {c['suffix_tokens']} | {f(c['park_s'], '.4f')} | "
                   f"{f(c['resume_extra_s'], '.3f')} | {f(c['per_1k_s'], '.3f')} | "
                   f"{c['host_bytes_per_1k']} |")
    return "\n".join(out)


async def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="tiny, smollm2, gemma or a GGUF path")
    ap.add_argument("--prefix", type=int, default=4096, help="prefix tokens P")
    ap.add_argument("--suffix", type=int, default=1024, help="private tokens per agent S")
    ap.add_argument("--resident", type=int, default=7, help="sequence ids (KV budget)")
    ap.add_argument("--agents", default="7,14,28,56", help="N values, comma separated")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--gen", type=int, default=32, help="tokens generated per turn")
    ap.add_argument("--idle", type=float, default=5.0, help="mean idle gap per turn, s")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--cost-sizes", default="256,1024", help="suffix sizes for the cost")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="P=256, S=256, N=7,14, 2 turns, idle 0.2 s, gen 8")
    ap.add_argument("--llama-server", default=None, metavar="BINARY",
                    help="also run llama-server -np N --cache-ram M on the same workload "
                    "(BINARY: the last line of ../shared/tools/build-llama-server.sh)")
    ap.add_argument("--llama-cache-ram", type=int, default=8192, metavar="MiB",
                    help="llama-server's --cache-ram (default: 8192)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help=f"default: {DEFAULT_OUT} (with --quick: {QUICK_OUT})")
    args = ap.parse_args(argv)
    if args.quick:  # the quick sizes become the defaults; flags given still win
        ap.set_defaults(**QUICK)
        args = ap.parse_args(argv)
    g = Geometry(args.prefix, args.suffix, args.resident, args.turns, args.gen, args.idle)
    model = resolve_model(args.model)
    path = str(model.path)
    probe = await make_pool(path, Geometry(16, 64, 1, 1, 1, 0.0), "none", 1, args.threads,
                            [1] * 16)
    prefix = tokens(probe, random.Random(args.seed), g.prefix)
    await probe.aclose()
    runs = []
    for n in [int(x) for x in args.agents.split(",") if x]:  # --agents "": the cost alone
        for mode in args.modes.split(","):
            print(f"... N={n} {mode}", file=sys.stderr, flush=True)
            run = await one_run(path, g, mode, n, args.threads, prefix, args.seed)
            runs.append(run.row())
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
        if args.llama_server:  # the comparison row: same agents, same KV memory
            print(f"... N={n} llama-server", file=sys.stderr, flush=True)
            run = Run("llama-server", n)
            log = args.out.parent / f"park-llama-server-{n}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            await run_llama_server(args.llama_server, path, g, run, prefix=prefix, words=words,
                                   seed=args.seed, cache_ram_mib=args.llama_cache_ram,
                                   threads=args.threads, log=log)
            runs.append(run.row())
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    sizes = [min(int(x), g.suffix - 16) for x in args.cost_sizes.split(",")]
    cost = await resume_cost(path, g, args.threads, prefix, sizes)
    doc = {"meta": {"when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "model": model.name, "machine": platform.machine(),
                    "argv": sys.argv[1:] if argv is None else argv,
                    "geometry": g.__dict__ | {"tool": g.tool},
                    "kv_cells": g.prefix + g.resident * g.suffix,
                    "llama_server": {"binary": args.llama_server,
                                     "slots": llama_server_slots(g)[0],
                                     "cache_ram_mib": args.llama_cache_ram}
                    if args.llama_server else None},
           "runs": runs, "resume_cost": cost}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(table(runs, cost))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
