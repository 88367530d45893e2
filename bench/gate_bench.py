"""Gate benchmark: decision latency, projection error, floor honoured.

    python bench/gate_bench.py [--model default|tiny|PATH] [--floor F] [--out FILE]

* Decision latency (pure): µs per ``decide`` on synthetic snapshots of 0, 4 and 16 sessions.
* Projection error (real pool): admit workers one by one under the floor; before each
  admission record ``projected_tps_next``, then measure the per-worker tokens/s once the
  new worker runs. Target: median absolute error ≤ 15 %.
* Floor honoured (real pool): more requests than fit, each a few turns with simulated tool
  waits; sample every decoding worker's tokens/s. Target: ≤ 10 % of samples below floor.

The engine parts need ``mesh.engine.pool.SharedKVPool`` and llama.cpp; without them they are
reported as skipped and the JSON still carries the latency part.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from mesh.engine.types import Engine, PoolLoad, SamplingParams, SessionLoad, SessionState
from mesh.gate import FloorGate, GateConfig, GateInput, ThroughputModel, decide
from mesh.gate.calibrate import micro_benchmark

PREFIX = (
    "You are a careful software agent working on a shared project. Read the task, plan, "
    "call tools when needed and answer briefly.\n"
) * 12


def synthetic_load(n: int, max_sessions: int = 32) -> PoolLoad:
    states = list(SessionState)
    sessions = tuple(
        SessionLoad(f"s{i}", states[i % 3], 300 + i, 1200 + i, 8.0 + i, 0.5, 10.0, 100)
        for i in range(n)
    )
    return PoolLoad(
        taken_at=0.0, sessions=sessions, step_ms=90.0, agg_tps=40.0,
        cells_used=900 + 300 * n, cells_total=900 + max_sessions * 2048, prefix_cells=900,
        naive_cells=1200 * n, free_seq_ids=max_sessions - n, max_sessions=max_sessions,
        session_budget=2048,
    )  # fmt: skip


def bench_latency(iterations: int = 20_000) -> dict[str, Any]:
    config = GateConfig.create(floor_tps=4.0)
    model = ThroughputModel()
    out: dict[str, Any] = {}
    for n in (0, 4, 16):
        inp = GateInput(load=synthetic_load(n), num_tickets=n)
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(iterations):
                decide(inp, config, model, 0.0)
            runs.append((time.perf_counter() - t0) / iterations * 1e6)
        out[f"sessions_{n}"] = {"us_per_decide_median": statistics.median(runs), "runs_us": runs}
    return out


async def open_pool(spec: str | None, max_sessions: int) -> Engine:
    from mesh.engine.models import resolve_model
    from mesh.engine.pool import SharedKVPool
    from mesh.engine.types import EngineConfig

    model = resolve_model(spec)
    config = EngineConfig(model_path=str(model.path), max_sessions=max_sessions,
                          session_budget=1024, n_batch=512)  # fmt: skip
    pool = SharedKVPool(config, PREFIX)
    await pool.start()
    return pool


async def busy_worker(engine: Engine, stop: anyio.Event, idle_s: float = 0.0) -> None:
    """Turn after turn until ``stop``; ``idle_s`` simulates a tool call between turns."""
    session = await engine.attach()
    try:
        session.append("Task: list ten prime numbers, one per line.")
        params = SamplingParams(max_tokens=24, stop_at_eos=False)
        while not stop.is_set():
            async for _ in session.generate(params):
                if stop.is_set():
                    break
            if idle_s:
                await anyio.sleep(idle_s)
            if session.context_len > engine.info.prefix_tokens + 900:
                break
            session.append(" Continue.")
    finally:
        with anyio.CancelScope(shield=True):
            await session.detach()


async def step_times(engine: Engine, num_decode: int, window_s: float) -> list[float]:
    """Wall times of the steps in which exactly ``num_decode`` sessions decoded."""
    seen: set[int] = set()
    keep: list[object] = []  # holds the samples so their ids stay unique
    times: list[float] = []
    deadline = anyio.current_time() + window_s
    while anyio.current_time() < deadline:
        await anyio.sleep(0.5)
        for s in engine.load().recent_steps:
            if id(s) not in seen:
                seen.add(id(s))
                keep.append(s)
                if s.num_decode == num_decode:
                    times.append(s.step_s)
    return times


async def bench_projection(
    engine: Engine, model: ThroughputModel, floor: float, max_workers: int, settle_s: float
) -> Any:
    """Projected tokens/s per worker (before admitting) vs the median step with every
    worker decoding (after): what a decoding worker actually gets."""
    gate = FloorGate(engine, GateConfig.create(floor_tps=floor, max_workers=max_workers), model)
    stop = anyio.Event()
    rows: list[dict[str, Any]] = []
    num_workers = 0
    async with anyio.create_task_group() as tg:
        while True:
            d = gate.decide_now()
            if not d.admitted:
                break
            projected = d.projection.tps_next
            await gate.admit(f"w{num_workers}")
            num_workers += 1
            tg.start_soon(busy_worker, engine, stop)
            await anyio.sleep(settle_s)
            times = await step_times(engine, num_workers, 2 * settle_s)
            gate.decide_now()  # let the model learn from the steps meanwhile
            if not times:
                continue
            tps = 1.0 / statistics.median(times)
            rows.append({"workers": num_workers, "projected_tps": projected,
                         "measured_tps": tps, "num_steps": len(times),
                         "abs_error": abs(projected - tps) / tps})  # fmt: skip
        stop.set()
    errors = [r["abs_error"] for r in rows]
    return {
        "floor_tps": floor,
        "rows": rows,
        "median_abs_error": statistics.median(errors) if errors else None,
        "target": 0.15,
        "model": model.describe(),
    }


async def bench_floor(
    engine: Engine, model: ThroughputModel, floor: float, num_requests: int, run_s: float
) -> Any:
    config = GateConfig.create(floor_tps=floor, max_queue=num_requests)
    gate = FloorGate(engine, config, model)
    stop = anyio.Event()
    below = total = 0
    peak_workers = 0
    decoding_counts: list[int] = []

    async def request(i: int) -> None:
        ticket = await gate.admit(f"r{i}")
        try:
            await busy_worker(engine, stop, idle_s=0.5 + (i % 3) * 0.5)
        finally:
            await ticket.release()

    async with anyio.create_task_group() as tg:
        for i in range(num_requests):
            tg.start_soon(request, i)
        deadline = anyio.current_time() + run_s
        while anyio.current_time() < deadline:
            await anyio.sleep(0.1)
            load = engine.load()
            peak_workers = max(peak_workers, len(load.sessions))
            decoding_counts.append(load.count(SessionState.DECODING))
            for s in load.sessions:
                if s.state is SessionState.DECODING and s.decode_tps is not None:
                    total += 1
                    below += s.decode_tps < floor
        stop.set()
    return {
        "floor_tps": floor,
        "requests": num_requests,
        "admitted": gate.num_admitted,
        "peak_workers": peak_workers,
        "mean_decoding": statistics.mean(decoding_counts) if decoding_counts else None,
        "samples": total,
        "share_below_floor": below / total if total else None,
        "target": 0.10,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0]},
        "decide_latency": bench_latency(args.iterations),
    }
    try:
        engine = await open_pool(None if args.model == "default" else args.model, args.workers)
    except Exception as exc:  # no llama.cpp, no pool module, or no model: report and go on
        reason = f"engine unavailable: {type(exc).__name__}: {exc}"
        print(f"engine parts skipped ({reason})")
        result["projection"] = result["floor_honoured"] = {"skipped": reason}
        return result
    try:
        result["model"] = engine.info.model_name
        model = ThroughputModel()  # seeded once, then shared: the gate keeps learning
        model.seed(await micro_benchmark(engine))
        result["projection"] = await bench_projection(
            engine, model, args.floor, args.workers, args.settle
        )
        result["floor_honoured"] = await bench_floor(
            engine, model, args.floor, args.workers * 2, args.run_s
        )
    finally:
        await engine.aclose()
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"{'decide latency':<24}{'µs (median of 5)':>18}")
    for name, row in result["decide_latency"].items():
        print(f"  {name:<22}{row['us_per_decide_median']:>18.1f}")
    proj = result["projection"]
    if "rows" in proj:
        print(f"{'workers':>8}{'projected':>12}{'measured':>10}{'error':>8}   tokens/s per worker")
        for r in proj["rows"]:
            print(f"{r['workers']:>8}{r['projected_tps']:>12.2f}{r['measured_tps']:>10.2f}"
                  f"{r['abs_error']:>8.1%}")  # fmt: skip
        print(f"median abs error: {proj['median_abs_error']} (target ≤ 15 %)")
    floor = result["floor_honoured"]
    if "samples" in floor:
        print(
            f"share below floor: {floor['share_below_floor']} of {floor['samples']} samples "
            f"(peak {floor['peak_workers']} workers, {floor['mean_decoding']} decoding on average)"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="default | tiny | PATH to a GGUF")
    p.add_argument("--floor", type=float, default=4.0, help="floor tokens/s per worker")
    p.add_argument("--workers", type=int, default=8, help="most workers to admit")
    p.add_argument("--settle", type=float, default=3.0, help="seconds before measuring")
    p.add_argument("--run-s", type=float, default=30.0, help="floor-honoured run length")
    p.add_argument("--iterations", type=int, default=20_000)
    p.add_argument("--out", type=Path, default=Path("bench/results/gate.json"))
    args = p.parse_args()
    result = anyio.run(main_async, args)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
