"""``mesh demo``: build a pool on the default model, run N sessions at once, show the gain."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from mesh.engine.config import EngineConfig, SamplingParams

_PREFIX = (
    "You are a courier dispatcher for a city logistics company. Every package has an id, "
    "a pickup address, a drop-off address and a deadline. Answer briefly and precisely.\n"
)
_TASKS = [
    "Package 17 goes from the harbour to the old town. Plan the route:",
    "Package 4 is late. Write a short apology to the customer:",
    "List three checks before a van leaves the depot:",
    "Package 9 needs a signature. Explain the hand-over:",
    "Summarise today's deliveries in one sentence:",
    "Package 23 is fragile. How should it be packed?",
    "A driver is sick. Reassign the morning route:",
    "Estimate the time from the station to the university:",
]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="run N pooled sessions on the default model and report")
    p.add_argument("--model", default=None,
                   help="GGUF path, or smollm2, gemma, tiny (default: smollm2)")
    p.add_argument("--sessions", type=int, default=8, help="sessions decoding together")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per session")
    p.add_argument("--prefix-repeat", type=int, default=12, help="prefix size knob")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_demo(args))


async def _demo(args: argparse.Namespace) -> int:
    from mesh.engine.models import resolve_model
    from mesh.engine.pool import SharedKVPool

    model = resolve_model(args.model)
    print(f"model: {model.name} ({model.source}) at {model.path}")
    cfg = EngineConfig(model_path=str(model.path), max_sessions=max(args.sessions, 1),
                       session_budget=256 + args.tokens, n_threads=args.threads)
    pool = SharedKVPool(cfg, _PREFIX * args.prefix_repeat)

    def progress(done: int, total: int) -> None:
        print(f"\rprefix: {done}/{total} tokens", end="", file=sys.stderr, flush=True)

    info = await pool.start(progress)
    print(f"\nprefix: {info.prefix_tokens} tokens, sha256 {info.prefix_hash[:12]}…, "
          f"built in {info.build_s:.2f}s")
    sessions = [await pool.attach() for _ in range(args.sessions)]
    params = SamplingParams(max_tokens=args.tokens)
    done = [0] * len(sessions)
    t0 = time.monotonic()

    async def one(i: int) -> str:
        s = sessions[i]
        s.append(_TASKS[i % len(_TASKS)])
        gen = s.generate(params)
        async for _ in gen:
            done[i] += 1
            total = sum(done)
            print(f"\rgenerated {total}/{len(sessions) * args.tokens} tokens "
                  f"({total / (time.monotonic() - t0):.1f} tok/s)", end="", file=sys.stderr,
                  flush=True)
        assert gen.result is not None
        return gen.result.text

    texts = await asyncio.gather(*(one(i) for i in range(len(sessions))))
    wall = time.monotonic() - t0
    load = pool.load()
    print(file=sys.stderr)
    for i, text in enumerate(texts[:3]):
        print(f"[{sessions[i].id}] {_TASKS[i % len(_TASKS)]}{text.strip()[:120]!r}")
    print()
    print("| sessions | wall s | agg tok/s | per-session tok/s | KV cells pooled | naive "
          "| reduction |")
    print("|---|---|---|---|---|---|---|")
    total = sum(done)
    per = total / wall / len(sessions)
    print(f"| {len(sessions)} | {wall:.2f} | {total / wall:.1f} | {per:.1f} "
          f"| {load.cells_used} | {load.naive_cells} | {load.reduction:.2f}× |")
    for s in sessions:
        await s.detach()
    await pool.aclose()
    return 0
