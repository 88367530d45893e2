"""Host overhead of the engine step: the native step (native/) vs the Python step.

    .venv/bin/python -m bench.overhead --model tiny --tokens 32
    .venv/bin/python -m bench.overhead --model default --ns 1,16,32 --tokens 8
    .venv/bin/python -m bench.overhead --model tiny --quick   # N = 1, 4; 8 tokens; once

N sessions share a P-token prefix (P = 512), each with a 16-token private suffix prefilled
before timing; then all N start a greedy turn of T tokens in the same step (inside
``held_steps(pool)``) and are consumed by N asyncio tasks, as the HTTP layers consume them.
Per step, from the pool's own counters:

* ``decode_ms``: inside ``llama_decode``;
* ``host_ms``: the rest of the step (planning, batch filling, sampling, bookkeeping);
* ``other_ms``: wall / steps - host - decode (the engine loop between steps: commands,
  posting pieces to asyncio, waiting for the GIL while consumers run);
* ``share``: (host + other) / wall; ``agg_tps``: N * T / wall.

Every mode's pool is open at once and, for each N, the modes take turns ``--repeat`` times
(default 3); rows are per-field medians, so load drifting on a shared machine hits the
modes alike.

With the tiny model decode is as fast as a GPU's would be, so what is left is the host's
share. Targets (issue 13): host + other <= 0.5 ms per step at N = 128 with the tiny model,
<= 1.5 ms with the default model's vocabulary; aggregate tok/s at N = 128 (tiny) >= 1.3x
the 6,820 measured before the native step. The table goes to stdout, everything to
``bench/overhead/results/overhead.json`` (or ``--out``; with ``--quick``, a temporary path:
``QUICK_OUT``); nothing is asserted.

The counters and the clock are read inside ``held_steps(pool)``, before the hold is released: the
engine steps as soon as it is, so a reading taken after the release would miss the steps run
meanwhile (their tokens counted, their time not: a negative ``other_ms`` on short turns).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mesh.engine.config import EngineConfig, SamplingParams
from mesh.engine.llama import LlamaModel
from mesh.engine.models import resolve_model
from mesh.engine.pool import SharedKVPool, held_steps
from mesh.engine.session import PooledSession
from mesh.template.loader import load_template, sample_project_dir
from mesh.template.prefix import build_prefix

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "overhead.json"
QUICK_OUT = Path(tempfile.gettempdir()) / "mesh-bench" / "overhead.json"
QUICK: dict[str, Any] = {"ns": "1,4", "tokens": 8, "prefix": 64, "repeat": 1, "threads": 1,
                         "out": QUICK_OUT}
BEFORE_TPS_128 = 6820.0  # tiny, N = 128, before the native step (issue 13)
SUFFIX = 16
_WORDS = ("agent", "tool", "file", "module", "test", "build", "cache", "index", "route",
          "queue", "task", "worker", "token", "prefix", "session", "decode", "batch")


def prefix_tokens(model: LlamaModel, n: int, template: str | None = None) -> list[int]:
    """Exactly ``n`` token ids (BOS first when the model adds one): the template's prefix
    for its sample project (``heavy``: 32K tokens and more), else project-like words."""
    if template is not None:
        tpl = load_template(template)
        text = build_prefix(tpl, sample_project_dir(),
                            lambda t: len(model.tokenize(t, add_bos=False)),
                            target_tokens=n).text
        made = model.tokenize(text, add_bos=model.add_bos)
        while len(made) < n:  # the template fell short: repeat its body
            made += made[1 if model.add_bos else 0:]
        return made[:n]
    rng = random.Random(0)
    toks: list[int] = [model.bos] if model.add_bos else []
    while len(toks) < n:
        line = " ".join(rng.choice(_WORDS) for _ in range(12)) + ".\n"
        toks += model.tokenize(line, add_bos=False)
    return toks[:n]


def suffix_tokens(model: LlamaModel, i: int) -> list[int]:
    toks = model.tokenize(f"\nTask {i}: check the {_WORDS[i % len(_WORDS)]} module.\n",
                          add_bos=False)
    while len(toks) < SUFFIX:
        toks += toks
    return toks[:SUFFIX]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, stop_at_eos=False)


@dataclasses.dataclass(frozen=True)
class Reading:
    """The pool's step counters and the clock at one moment."""

    num_steps: int
    host_s: float
    decode_s: float
    sample_s: float | None  # the native step's own counters (None: the Python step)
    gil_wait_s: float | None
    t: float

    @classmethod
    def of(cls, pool: SharedKVPool) -> Reading:
        stepper = pool.parts.runner.stepper
        return cls(pool.stats.num_steps, pool.stats.host_s, pool.stats.decode_s,
                   None if stepper is None else stepper.sample_s,
                   None if stepper is None else stepper.gil_wait_s, time.perf_counter())


async def start_all(pool: SharedKVPool, sessions: list[PooledSession],
                    params: SamplingParams) -> tuple[list[Any], Reading]:
    """Start every turn in the same step; the reading is taken before any of it runs."""
    gens = [s.generate(params) for s in sessions]
    async with held_steps(pool):
        for g in gens:
            await g.start()
        before = Reading.of(pool)  # inside the hold: no step has run yet
    return gens, before


async def consume(g: Any) -> int:
    n = 0
    async for _ in g:
        n += 1
    return n


async def measure(pool: SharedKVPool, tok: LlamaModel, n: int, tokens: int) -> dict[str, Any]:
    sessions = [await pool.attach() for _ in range(n)]
    for i, s in enumerate(sessions):
        s.append_tokens(suffix_tokens(tok, i))
    warm, _ = await start_all(pool, sessions, greedy(1))
    await asyncio.gather(*(consume(g) for g in warm))
    gens, r0 = await start_all(pool, sessions, greedy(tokens))
    got = sum(await asyncio.gather(*(consume(g) for g in gens)))
    r1 = Reading.of(pool)
    wall = r1.t - r0.t
    steps, host, dec = r1.num_steps - r0.num_steps, r1.host_s - r0.host_s, r1.decode_s - r0.decode_s
    sample_ms = gil_ms = None
    if r0.sample_s is not None and r1.sample_s is not None:
        sample_ms = round((r1.sample_s - r0.sample_s) / steps * 1e3, 3)
    if r0.gil_wait_s is not None and r1.gil_wait_s is not None:
        gil_ms = round((r1.gil_wait_s - r0.gil_wait_s) / steps * 1e3, 3)
    for s in sessions:
        await s.detach()
    wall_ms, host_ms, dec_ms = wall / steps * 1e3, host / steps * 1e3, dec / steps * 1e3
    other_ms = wall_ms - host_ms - dec_ms
    return {"N": n, "T": tokens, "steps": steps, "tokens": got,
            "decode_ms": round(dec_ms, 3), "host_ms": round(host_ms, 3),
            "other_ms": round(other_ms, 3), "overhead_ms": round(host_ms + other_ms, 3),
            "share": round((host_ms + other_ms) / wall_ms, 4), "wall_ms": round(wall_ms, 3),
            "agg_tps": round(got / wall, 1),
            # native only, parts of host_ms: sampling in C, waiting for the GIL after it
            "sample_ms": sample_ms, "gil_wait_ms": gil_ms}


async def open_pool(args: argparse.Namespace, model_path: str, tok: LlamaModel,
                    use_native: bool) -> SharedKVPool:
    ns = [int(x) for x in args.ns.split(",")]
    extra: dict[str, Any] = {}
    if "native" in {f.name for f in dataclasses.fields(EngineConfig)}:
        extra["native"] = use_native  # absent before the native step (--label main)
    for flag in ("flash_attn", "kv_type"):
        if getattr(args, flag) is not None:
            extra[flag] = getattr(args, flag)
    cfg = EngineConfig(model_path=model_path, max_sessions=max(ns),
                       session_budget=SUFFIX + args.tokens + 8, n_threads=args.threads,
                       n_batch=max(512, max(ns) + 1), n_gpu_layers=args.gpu_layers, **extra)
    pool = SharedKVPool(cfg, prefix_tokens(tok, args.prefix, args.template))
    await pool.start()
    await measure(pool, tok, min(ns), 4)  # warm-up: first-step allocations
    return pool


def median_row(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-field medians of repeated runs (the machine is shared: single runs are noisy)."""
    row = dict(samples[0])
    for key in ("decode_ms", "host_ms", "other_ms", "overhead_ms", "share", "wall_ms",
                "agg_tps", "sample_ms", "gil_wait_ms"):
        if row.get(key) is not None:
            row[key] = round(statistics.median(r[key] for r in samples), 4)
    row["runs"] = len(samples)
    return row


async def run_all(args: argparse.Namespace, model_path: str, tok: LlamaModel,
                  sink: Callable[[dict[str, Any]], None]) -> dict[str, bool]:
    """Every mode's pool open at once; for each N the modes take turns, ``--repeat``
    times, so drifting load hits them alike. Returns whether each mode ran natively."""
    ns = [int(x) for x in args.ns.split(",")]
    modes = args.modes.split(",")
    pools: dict[str, SharedKVPool] = {}
    try:
        for mode in modes:
            pools[mode] = await open_pool(args, model_path, tok, mode == "native")
        for n in ns:
            samples: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
            for _ in range(args.repeat):
                for mode in modes:
                    samples[mode].append(await measure(pools[mode], tok, n, args.tokens))
            for mode in modes:
                row = median_row(samples[mode])
                row["mode"] = args.label or mode
                sink(row)
                print(f"  {row['mode']:6} N={n:3}: decode {row['decode_ms']:.2f} host "
                      f"{row['host_ms']:.2f} other {row['other_ms']:.2f} ms/step, "
                      f"{row['agg_tps']:.0f} tok/s", file=sys.stderr, flush=True)
    finally:
        used = {m: p.parts.runner.stepper is not None for m, p in pools.items()}
        for p in pools.values():
            await p.aclose()
    return used


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| mode | sessions | decode ms/step | host ms/step | other ms/step | "
            "host+other ms | overhead share | agg tok/s | of host: C sampling / GIL wait |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        parts = ("-" if r.get("sample_ms") is None
                 else f"{r['sample_ms']:.2f} / {r['gil_wait_ms']:.2f}")
        lines.append(f"| {r['mode']} | {r['N']} | {r['decode_ms']:.2f} | {r['host_ms']:.2f} "
                     f"| {r['other_ms']:.2f} | {r['overhead_ms']:.2f} | "
                     f"{r['share'] * 100:.0f} % | {r['agg_tps']:,.0f} | {parts} |")
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]], model: str) -> list[dict[str, Any]]:
    out = []
    at = {(r["mode"], r["N"]): r for r in rows}
    nat = at.get(("native", 128))
    if nat is not None:
        limit = 0.5 if model == "tiny" else 1.5
        out.append({"target": f"native host+other at N=128 <= {limit} ms",
                    "value": nat["overhead_ms"], "ok": nat["overhead_ms"] <= limit})
        if model == "tiny":
            out.append({"target": f"native agg tok/s at N=128 >= 1.3 x {BEFORE_TPS_128:.0f}",
                        "value": nat["agg_tps"],
                        "ok": nat["agg_tps"] >= 1.3 * BEFORE_TPS_128})
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    resolved = resolve_model(None if args.model == "default" else args.model)
    model_path = str(resolved.path)
    tok = LlamaModel(model_path, vocab_only=True)
    rows: list[dict[str, Any]] = []
    used: dict[str, bool] = {}

    def result(done: bool) -> dict[str, Any]:
        return {"meta": meta, "rows": rows, "complete": done,
                "targets": targets(rows, args.model)}

    def sink(row: dict[str, Any]) -> None:  # a run cut by a timeout keeps its rows
        rows.append(row)
        write(args.out, result(False))

    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.overhead", *args.argv]),
        "model": args.model, "model_name": resolved.name, "prefix": args.prefix,
        "template": args.template, "gpu_layers": args.gpu_layers,
        "flash_attn": args.flash_attn, "kv_type": args.kv_type,
        "suffix": SUFFIX, "tokens": args.tokens, "threads": args.threads,
        "repeat": args.repeat,
        "cpus": os.cpu_count(), "machine": platform.machine(),
        "python": platform.python_version(),
        "llama_cpp_python": importlib.metadata.version("llama_cpp_python"),
        "native_used": used,
    }
    print(f"model {resolved.name}: {args.modes}, N = {args.ns}, {args.repeat} runs each",
          file=sys.stderr, flush=True)
    try:
        used.update(await run_all(args, model_path, tok, sink))
    finally:
        tok.close()
    return result(True)


def write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default="tiny", help="tiny | default | a GGUF path")
    p.add_argument("--ns", default="1,16,64,128,255", help="session counts")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per session")
    p.add_argument("--prefix", type=int, default=512, help="prefix tokens")
    p.add_argument("--template", default=None,
                   help="build the prefix from this template (e.g. heavy) instead of words")
    p.add_argument("--gpu-layers", type=int, default=-1, help="layers offloaded (GPU builds)")
    p.add_argument("--flash-attn", default=None, help="auto | on | off")
    p.add_argument("--kv-type", default=None, help="f16 | q8_0 | q4_0")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads")
    p.add_argument("--modes", default="python,native", help="python,native")
    p.add_argument("--repeat", type=int, default=3, help="runs per N and mode (median)")
    p.add_argument("--label", default=None,
                   help="name the rows (e.g. main, to time another checkout's engine)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"default: {DEFAULT_OUT} (with --quick: {QUICK_OUT})")
    p.add_argument("--quick", action="store_true",
                   help="N = 1 and 4, 8 tokens, once: the suite's run, not a measurement")
    args = p.parse_args(argv)
    if args.quick:  # the quick sizes become the defaults; flags given still win
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    result = asyncio.run(main_async(args))
    print(table(result["rows"]))
    for t in result["targets"]:
        print(f"{'PASS' if t['ok'] else 'MISS'} {t['target']}: {t['value']}")
    write(args.out, result)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
