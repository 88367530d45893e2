"""Gate benchmark that can fail: the floor as a client sees it, with more workers than fit.

    python -m bench.gate [--model tiny|default|PATH] [--slots 32] [--floor auto|F]
                               [--policies floor,none] [--run-s 25] [--out FILE]
                               [--neighbour cpu|mesh [--neighbour-schedule SPEC] ...]

* Decision latency (pure): µs per ``decide`` on synthetic snapshots of 0, 4 and 16 sessions.
* Floor at the client (real pool): the pool has ``--slots`` session slots, well above what
  the floor admits, and ``--requests`` workers (default: all the slots) ask for one at once.
  Each worker runs turns of ``--turn-tokens`` tokens separated by tool calls (an idle gap of
  0.2–1.2 s, then a tool result of 40–160 words appended and prefilled: duty cycle < 1).
  Every token's arrival time is taken *at the client*; a worker's tokens/s is measured
  over each window of ``--window`` consecutive inter-token gaps within a turn (the gap to a
  turn's first token is its own prefill, not a stall, and is left out). Reported: the share
  of windows under the floor and under half the floor, per policy. Nothing bounds this by
  construction: the slot count does not bind, and a stall behind another worker's prefill
  or a wrong projection shows up as a slow window.
* Projection error per admitted count: at each admission the gate's ``projected_tps_next``
  (with the idle-gap estimate when a duty cycle is measured) against the median client
  window while exactly that many workers held tickets.
* Cells term: step time with ``n`` decoding sessions while idle sessions hold 0 or
  ``--idle-private`` private tokens, measured vs projected with and without the
  rows × cells-used term.

* Neighbour (``--neighbour cpu|mesh``, the flags of ``mesh simulate``): a second tenant
  started and stopped on a seeded schedule, the same for every policy (each policy's run
  replays it from its own start; a mesh neighbour's server is started once, before the
  first). Every figure above is also given per phase (neighbour off / on), with each
  turn's decode-gate wait (``TurnResult.wait_s``), tokens/s over all workers and the
  workers holding tickets; the phases are in ``runs[].neighbour_on``, and issue 25's goals
  (:mod:`mesh.sim.compare`, 5 % of windows) in ``goals``.

``--floor auto`` sets the floor at the seeded model's per-worker rate with a quarter of
the slots decoding, so that the floor, not the slots, is what binds.

``--quick`` (4 slots, 3 s a policy, 2 turns of 8 tokens) runs every section in seconds: the
suite's run, not a measurement. Writes ``bench/gate/results/gate.json`` (or ``--out``; with
``--quick``, a temporary path: ``QUICK_OUT``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio

from mesh.engine.config import SamplingParams
from mesh.engine.interface import Engine, PoolLoad, SessionLoad, SessionState
from mesh.gate.admission import FloorGate
from mesh.gate.config import POLICIES, GateConfig
from mesh.gate.decide import GateInput, decide
from mesh.gate.model import ThroughputModel, micro_benchmark
from mesh.sim.compare import goals, goals_markdown
from mesh.sim.policies import parse_rule
from mesh.sim.processes import Neighbour
from mesh.sim.report import percentile, phase_of, spans_from
from mesh.sim.scenario import PhaseRecord, add_neighbour_args, neighbour_config

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gate.json"
QUICK_OUT = Path(tempfile.gettempdir()) / "mesh-bench" / "gate.json"
QUICK: dict[str, Any] = {"slots": 4, "run_s": 3.0, "turns": 2, "turn_tokens": 8,
                         "iterations": 200, "idle_private": 64, "session_budget": 512,
                         "out": QUICK_OUT}
PREFIX = (
    "You are a careful software agent working on a shared project. Read the task, plan, "
    "call tools when needed and answer briefly.\n"
) * 12
WORDS = ("the", "file", "read", "write", "test", "code", "list", "main", "run", "build", "check",
         "open", "line", "value", "name")


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


def bench_latency(iterations: int) -> dict[str, Any]:
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


async def open_pool(spec: str, slots: int, session_budget: int) -> Engine:
    from mesh.engine.config import EngineConfig
    from mesh.engine.models import resolve_model
    from mesh.engine.pool import SharedKVPool

    model = resolve_model(None if spec == "default" else spec)
    config = EngineConfig(model_path=str(model.path), max_sessions=slots,
                          session_budget=session_budget, n_batch=512)  # fmt: skip
    pool = SharedKVPool(config, PREFIX)
    await pool.start()
    return pool


@dataclass
class Trace:
    """Client-side record of one policy run."""

    windows: list[tuple[float, float, int]] = field(default_factory=list)  # (t, tps, tickets)
    admissions: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    waits: list[tuple[float, float]] = field(default_factory=list)  # (turn asked at, wait_s)
    token_times: list[float] = field(default_factory=list)
    load: list[tuple[float, int, float | None]] = field(default_factory=list)  # t, tickets, running


def tool_result(rng: random.Random) -> str:
    return " Tool result: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 160)))


async def worker(engine: Engine, gate: FloorGate, trace: Trace, i: int, args: argparse.Namespace,
                 stop: anyio.Event) -> None:  # fmt: skip
    """Admit, then turns separated by tool calls until ``stop`` or ``--turns`` turns."""
    rng = random.Random(args.seed * 1000 + i)
    before = gate.decide_now(queue_ahead=0)
    ticket = await gate.admit(f"w{i}")
    # If it waited, the projection when it was let in is the head's last look.
    proj = before.projection if before.admitted else gate.decide_now(queue_ahead=0).projection
    trace.admissions.append({"t": anyio.current_time(), "tickets": gate.num_tickets,
                             "projected_tps_next": proj.tps_next,
                             "idle_estimate": proj.idle_estimate})  # fmt: skip
    params = SamplingParams(max_tokens=args.turn_tokens, stop_at_eos=False, seed=i)
    try:
        session = await engine.attach()
        try:
            session.append(f"Task {i}: list the files to change, one per line.")
            for _ in range(args.turns):
                if stop.is_set():
                    break
                stamps: list[float] = []
                asked = time.monotonic()
                generation = session.generate(params)
                async for _ in generation:
                    stamps.append(time.monotonic())
                    if stop.is_set():
                        break
                trace.turns += 1
                trace.token_times += stamps
                result = getattr(generation, "result", None)
                if result is not None:
                    trace.waits.append((asked, float(getattr(result, "wait_s", 0.0))))
                gaps = [b - a for a, b in itertools.pairwise(stamps)]
                for k in range(0, len(gaps) - args.window + 1, args.window):
                    span = sum(gaps[k : k + args.window])
                    if span > 0:
                        trace.windows.append((stamps[k], args.window / span, gate.num_tickets))
                await anyio.sleep(rng.uniform(0.2, 1.2))  # the tool call
                if session.context_len + 200 + args.turn_tokens > engine.info.session_budget \
                        + engine.info.prefix_tokens:  # fmt: skip
                    break
                session.append(tool_result(rng))
        finally:
            with anyio.CancelScope(shield=True):
                await session.detach()
    finally:
        await ticket.release()


def _phase_figures(trace: Trace, t0: float, wall: float, floor: float,
                   records: list[PhaseRecord]) -> dict[str, Any]:
    """Per phase (``all``, and ``off`` / ``on`` with a neighbour): the client windows,
    turn waits, tokens/s over every worker and workers holding tickets."""
    cut = spans_from(records, wall)
    out: dict[str, Any] = {}
    for phase in ("all", "off", "on") if cut else ("all",):

        def inside(t: float, phase: str = phase) -> bool:
            return phase == "all" or phase_of(cut, t - t0) == phase

        time_s = wall if phase == "all" else sum(s.end - s.start for s in cut
                                                 if s.state == phase)
        tps = [w[1] for w in trace.windows if inside(w[0])]
        waits = [w for t, w in trace.waits if inside(t)]
        load = [x for x in trace.load if inside(x[0])]
        running = [x[2] for x in load if x[2] is not None]
        n = len(tps)
        out[phase] = {
            "time_s": round(time_s, 3),
            "windows": n,
            "p50_tps": statistics.median(tps) if tps else None,
            "share_below_floor": sum(t < floor for t in tps) / n if n else None,
            "share_below_half_floor": sum(t < floor / 2 for t in tps) / n if n else None,
            "turn_wait_p50_s": percentile(waits, 50),
            "turn_wait_p95_s": percentile(waits, 95),
            "agg_tps": sum(1 for t in trace.token_times if inside(t)) / time_s
            if time_s > 0 else None,
            "mean_workers": statistics.mean(x[1] for x in load) if load else None,
            "max_workers": max((x[1] for x in load), default=None),
            "mean_running": statistics.mean(running) if running else None,
        }
    return out


async def run_policy(engine: Engine, model: ThroughputModel, policy: str, floor: float,
                     args: argparse.Namespace,
                     neighbour: Neighbour | None = None) -> dict[str, Any]:  # fmt: skip
    rule = None if policy in POLICIES else parse_rule(policy)
    config = GateConfig.create(policy=rule.name if rule else policy, floor_tps=floor,
                               max_queue=args.requests)
    gate = FloorGate(engine, config, model, rule=rule)
    budget = gate.pool_budget()
    gate.install()  # as `mesh serve` does: floor's turns wait for their step
    trace = Trace()
    stop = anyio.Event()
    peak = 0
    started = anyio.current_time()
    t0 = time.monotonic()
    records: list[PhaseRecord] = []
    if neighbour is not None:
        neighbour.begin(t0)
    try:
        async with anyio.create_task_group() as tg:
            for i in range(args.requests):
                tg.start_soon(worker, engine, gate, trace, i, args, stop)
            while anyio.current_time() - started < args.run_s:
                await anyio.sleep(0.2)
                peak = max(peak, len(engine.load().sessions))
                # what /capacity shows (and, as its polling does in `mesh serve`, a refresh
                # of the gate's model from the steps just measured)
                turns = gate.capacity().get("turns") or {}
                running = turns.get("running")
                trace.load.append((time.monotonic(), gate.num_tickets,
                                   float(running) if running is not None else None))
            stop.set()
    finally:
        if neighbour is not None:
            records = neighbour.end()
    wall = time.monotonic() - t0
    engine.set_prefill_budget(None)
    engine.set_turn_admission(None)
    tps = [w[1] for w in trace.windows]
    n = len(tps)
    rows: list[dict[str, Any]] = []
    for adm in sorted(trace.admissions, key=lambda a: a["tickets"]):
        k = adm["tickets"]
        if any(r["workers"] == k for r in rows):
            continue
        seen = [w[1] for w in trace.windows if w[2] == k]
        if len(seen) < 3:
            continue
        measured = statistics.median(seen)
        rows.append({"workers": k, "projected_tps": adm["projected_tps_next"],
                     "measured_p50_tps": measured, "windows": len(seen),
                     "idle_estimate": adm["idle_estimate"],
                     "error": (adm["projected_tps_next"] - measured) / measured})  # fmt: skip
    errors = [abs(r["error"]) for r in rows]
    return {
        "policy": policy,
        "floor_tps": floor,
        "prefill_budget": budget is not None,
        "requests": args.requests,
        "admitted": gate.num_admitted,
        "peak_workers": peak,
        "turns": trace.turns,
        "windows": n,
        "p50_tps": statistics.median(tps) if tps else None,
        "p05_tps": statistics.quantiles(tps, n=20)[0] if n >= 20 else None,
        "share_below_floor": sum(t < floor for t in tps) / n if n else None,
        "share_below_half_floor": sum(t < floor / 2 for t in tps) / n if n else None,
        "projection": rows,
        "median_abs_projection_error": statistics.median(errors) if errors else None,
        "neighbour_on": [{"start": r.start, "end": r.end} for r in records],
        "phases": _phase_figures(trace, t0, wall, floor, records),
    }


def bench_goals(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 25's goals (:mod:`mesh.sim.compare`) over the policies' per-phase windows."""
    phases = [{phase: {"windows_under_floor": f["share_below_floor"], "agg_tps": f["agg_tps"]}
               for phase, f in r["phases"].items()} for r in runs]
    whole = [{"windows_under_floor": r["share_below_floor"],
              "windows_under_half_floor": r["share_below_half_floor"]} for r in runs]
    return goals([r["policy"] for r in runs], phases, whole, hold=0.05)


async def bench_cells(engine: Engine, model: ThroughputModel, decoding: int, idle: int,
                      private: int) -> list[dict[str, Any]]:  # fmt: skip
    """Step time with ``decoding`` sessions decoding beside ``idle`` idle ones holding
    0 or ``private`` tokens: measured vs projected with and without the cells term."""
    out = []
    params = SamplingParams(max_tokens=24, stop_at_eos=False)
    for held in (0, private):
        idlers = [await engine.attach() for _ in range(idle)]
        busy = [await engine.attach() for _ in range(decoding)]
        try:
            for s in idlers:
                if held:
                    s.append(" ".join(WORDS[j % len(WORDS)] for j in range(held)))
                    async for _ in s.generate(SamplingParams(max_tokens=1)):
                        pass
            mark = engine.load().recent_steps
            last = mark[-1] if mark else None
            async with anyio.create_task_group() as tg:
                for s in busy:
                    s.append("Count:")
                    tg.start_soon(_drain, s, params)
            steps = list(engine.load().recent_steps)
            if last is not None and any(x is last for x in steps):
                steps = steps[[x is last for x in steps].index(True) + 1 :]
            full = [x for x in steps if x.num_decode == decoding and x.num_prefill_tokens == 0]
            if not full:
                continue
            measured = statistics.median(x.step_s for x in full)
            ref = full[len(full) // 2]
            cells = ref.cells_used or engine.load().cells_used
            cost = model.params
            with_e = cost.step_s(decoding, ref.sum_context, 0, cells)
            without = replace(cost, e=0.0).step_s(decoding, ref.sum_context, 0, cells)
            out.append({"decoding": decoding, "idle": idle, "idle_private_tokens": held,
                        "cells_used": cells, "measured_step_ms": measured * 1e3,
                        "projected_ms_with_cells_term": with_e * 1e3,
                        "projected_ms_without": without * 1e3,
                        "error_with": (with_e - measured) / measured,
                        "error_without": (without - measured) / measured})  # fmt: skip
        finally:
            with anyio.CancelScope(shield=True):
                for s in idlers + busy:
                    await s.detach()
    return out


async def _drain(session: Any, params: SamplingParams) -> None:
    async for _ in session.generate(params):
        pass


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "command": " ".join(["python -m bench.gate", *args.argv]),
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0]},
        "decide_latency": bench_latency(args.iterations),
    }
    neighbour: Neighbour | None = None
    if args.neighbour_config.enabled:
        # The mesh neighbour's server starts before this pool (its own start-up is not the
        # run's) and serves every policy's run.
        neighbour = Neighbour(args.neighbour_config, args.seed,
                              None if args.model == "default" else args.model)
        await anyio.to_thread.run_sync(neighbour.setup)
    try:
        return await _bench(args, result, neighbour)
    finally:
        if neighbour is not None:
            await anyio.to_thread.run_sync(neighbour.close)


async def _bench(args: argparse.Namespace, result: dict[str, Any],
                 neighbour: Neighbour | None) -> dict[str, Any]:
    engine = await open_pool(args.model, args.slots, args.session_budget)
    try:
        result["model"] = engine.info.model_name
        seed = await micro_benchmark(engine)
        model = ThroughputModel()
        model.seed(seed)
        result["seed_model"] = model.describe()
        if args.floor == "auto":
            load = engine.load()
            n = max(2, args.slots // 4)
            cells = load.prefix_cells + n * 400
            floor = round(1.0 / model.step_s(n, n * (load.prefix_cells + 400), 0, cells), 1)
        else:
            floor = float(args.floor)
        result["floor_tps"] = floor
        result["runs"] = []
        result["neighbour"] = asdict(args.neighbour_config) if neighbour is not None else None
        for policy in args.policies.split(","):
            m = ThroughputModel()  # every policy starts from the same seed
            m.seed(seed)
            result["runs"].append(await run_policy(engine, m, policy, floor, args, neighbour))
            model = m if policy == "floor" else model
        result["goals"] = bench_goals(result["runs"])
        result["cells_term"] = await bench_cells(engine, model, args.slots // 4,
                                                 args.slots // 2, args.idle_private)
        result["model_after"] = model.describe()
    finally:
        await engine.aclose()
    return result


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(result: dict[str, Any]) -> None:
    print(f"model {result.get('model')}, floor {result.get('floor_tps')} tok/s")
    print(f"{'decide latency':<24}{'µs (median of 5)':>18}")
    for name, row in result["decide_latency"].items():
        print(f"  {name:<22}{row['us_per_decide_median']:>18.1f}")
    print(f"{'policy':<10}{'budget':>7}{'req':>5}{'adm':>5}{'peak':>5}{'windows':>8}"
          f"{'p50 t/s':>9}{'p05 t/s':>9}{'<floor':>8}{'<floor/2':>9}{'proj err':>9}")
    for r in result.get("runs", []):
        print(f"{r['policy']:<10}{'yes' if r['prefill_budget'] else 'no':>7}{r['requests']:>5}"
              f"{r['admitted']:>5}{r['peak_workers']:>5}{r['windows']:>8}"
              f"{_f(r['p50_tps'], '.1f'):>9}{_f(r['p05_tps'], '.1f'):>9}"
              f"{_f(r['share_below_floor'], '.1%'):>8}{_f(r['share_below_half_floor'], '.1%'):>9}"
              f"{_f(r['median_abs_projection_error'], '.1%'):>9}")  # fmt: skip
    phases = [p for p in ("all", "off", "on") if any(p in r["phases"] for r in result["runs"])]
    print(f"{'policy':<12}{'phase':<6}{'time s':>8}{'windows':>8}{'<floor':>8}{'<floor/2':>9}"
          f"{'wait p50':>9}{'wait p95':>9}{'agg t/s':>8}{'workers':>8}")
    for r in result.get("runs", []):
        for phase in phases:
            f = r["phases"].get(phase)
            if f is None:
                continue
            print(f"{r['policy']:<12}{phase:<6}{f['time_s']:>8.1f}{f['windows']:>8}"
                  f"{_f(f['share_below_floor'], '.1%'):>8}"
                  f"{_f(f['share_below_half_floor'], '.1%'):>9}"
                  f"{_f(f['turn_wait_p50_s'], '.3f'):>9}{_f(f['turn_wait_p95_s'], '.3f'):>9}"
                  f"{_f(f['agg_tps'], '.1f'):>8}{_f(f['mean_workers'], '.2f'):>8}")  # fmt: skip
    if result.get("goals"):
        print(goals_markdown(result["goals"]))
    for r in result.get("runs", []):
        if r["projection"]:
            print(f"projection, policy {r['policy']}: workers projected measured error idle-est")
            for p in r["projection"]:
                print(f"  {p['workers']:>7}{p['projected_tps']:>10.1f}{p['measured_p50_tps']:>9.1f}"
                      f"{p['error']:>+7.1%}  {p['idle_estimate']}")  # fmt: skip
    for c in result.get("cells_term", []):
        print(f"cells: {c['decoding']} decoding + {c['idle']} idle x {c['idle_private_tokens']} "
              f"private ({c['cells_used']} cells): measured {c['measured_step_ms']:.1f} ms, "
              f"projected {c['projected_ms_with_cells_term']:.1f} ms with the cells term "
              f"({c['error_with']:+.1%}), {c['projected_ms_without']:.1f} ms without "
              f"({c['error_without']:+.1%})")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny | default | PATH to a GGUF")
    p.add_argument("--slots", type=int, default=32, help="pool session slots")
    p.add_argument("--requests", type=int, default=None, help="workers (default: --slots)")
    p.add_argument("--floor", default="auto", help="floor tokens/s per worker, or auto")
    p.add_argument("--policies", default="floor,none")
    p.add_argument("--turn-tokens", type=int, default=32)
    p.add_argument("--turns", type=int, default=6, help="turns per worker before it leaves")
    p.add_argument("--window", type=int, default=4, help="inter-token gaps per tps sample")
    p.add_argument("--run-s", type=float, default=25.0, help="seconds per policy")
    p.add_argument("--session-budget", type=int, default=1536)
    p.add_argument("--idle-private", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iterations", type=int, default=5_000)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"default: {DEFAULT_OUT} (with --quick: {QUICK_OUT})")
    p.add_argument("--quick", action="store_true",
                   help="4 slots, 3 s a policy: the suite's run, not a measurement")
    add_neighbour_args(p)
    args = p.parse_args(argv)
    if args.quick:  # the quick sizes become the defaults; flags given still win
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args.neighbour_config = neighbour_config(args)
    except ValueError as exc:
        p.error(str(exc))
    if args.requests is None:
        args.requests = args.slots
    result = anyio.run(main_async, args)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
