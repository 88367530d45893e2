"""The source system's scenario on one GPU: mesh's pool against llama-server, same model.

A shared prefix of P tokens (32K, then 128K), agents with up to S = 128K private tokens,
a KV budget of ~1M cells: how many agents fit (mesh pooled vs a copy of the prefix per
agent), how fast a new agent gets its first token (prefix decoded vs not), and agents in
multi-turn tool loops (turns of: a tool result in, G tokens out) at N = 1, 4, 7 (and 16, 32
with a shorter private context): per-agent and aggregate tokens/s. Prompts are token ids
(random ids of the model's vocabulary: a random-weight model's compute does not depend on
them), so both systems decode exactly the same tokens.

    python -m bench.gpu_scenario --model /tmp/llama-3.1-8b.gguf --out DIR \\
        [--llama-server BIN] [--deadline-s 420]        # bench/gpu_scenario/run.sh runs this

Every row lands in ``DIR/gpu_scenario.json`` (and ``.md``) as soon as it finishes; past
``--deadline-s`` the remaining rows are recorded as skipped. ``agents that fit`` is the
pool's own admission accounting (cells promised to each agent's S tokens, nothing
prefilled: filling 7 x 128K tokens would take longer than the GPU budget) for mesh and
mesh without sharing (``share_prefix=False``); for llama-server, which gives each slot its
own copy of the prefix, it is the same arithmetic, ``budget // (P + S)``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.gpu_scenario.report import Report
from bench.gpu_scenario.server import AgentRun, LlamaServer, server_agent
from mesh.engine.config import EngineConfig, KVShape, SamplingParams
from mesh.engine.interface import ContextOverflow, PoolFull
from mesh.engine.llama import LlamaModel
from mesh.engine.models import vocabulary_size
from mesh.engine.pool import MAX_SEQUENCES, SharedKVPool, held_steps

GIB = 1 << 30


class Clock:
    """The run's deadline: rows check what is left before they start."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.reserve = 0.0  # seconds held back for the sections after this one

    def left(self) -> float:
        return self.deadline - self.reserve - time.monotonic()


class Tokens:
    """Deterministic random token ids of the base vocabulary (BOS first in a prefix)."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.lo, self.hi = 3 + 256, vocabulary_size()  # past <unk> <s> </s> and bytes

    def ids(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(self.lo, self.hi, n)]

    def prefix(self, n: int) -> list[int]:
        return [1, *self.ids(n - 1)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, stop_at_eos=False)


def summarize(runs: Sequence[AgentRun]) -> dict[str, Any]:
    gen = sum(r.generated for r in runs)
    wall = max(r.wall_s for r in runs)
    agent = [r.generated / r.wall_s for r in runs if r.wall_s > 0]
    dec = [r.decoded_after_first / r.decode_s for r in runs if r.decode_s > 0]
    return {"agent_tps": round(statistics.mean(agent), 2) if agent else None,
            "decode_tps": round(statistics.mean(dec), 2) if dec else None,
            "aggregate_tps": round(gen / wall, 2) if wall > 0 else None,
            "wall_s": round(wall, 3), "generated": gen,
            "turn_p50_s": round(statistics.median([t for r in runs for t in r.turn_s]), 4),
            "start_s_max": round(max(r.start_s for r in runs), 3),
            "prompt_n": sum(r.prompt_n for r in runs) or None,
            "warmup_prompt_n": sum(r.start_prompt_n for r in runs) or None}


class Scenario:
    def __init__(self, a: argparse.Namespace, report: Report, clock: Clock) -> None:
        self.a, self.report, self.clock = a, report, clock
        self.tok = Tokens(a.seed)
        self.rows: list[tuple[int, int]] = ([(n, a.private) for n in a.ns]
                                            + [(n, a.short_private) for n in a.short_ns])
        self.loop_cells = a.turns * (a.tool_tokens + a.gen) + 2  # a timed agent's growth

    def row(self, **kw: Any) -> None:
        self.report.add(kw)

    def config(self, P: int, share: bool = True) -> EngineConfig:
        a = self.a
        most = max([n for n, _ in self.rows] + [(a.kv_budget - P) // a.agent_budget + 1])
        slots = min(MAX_SEQUENCES - 1, most)
        # Resident agents: parking (attach parks an idle session) is off, so "agents that
        # fit" is what the KV cache holds at once, as the source system counts it.
        return EngineConfig(model_path=a.model, max_sessions=slots, max_attached=slots,
                            session_budget=a.agent_budget, n_ctx=a.kv_budget,
                            n_batch=a.n_batch, prefill_chunk=a.n_batch,
                            flash_attn=a.flash_attn, kv_type=a.kv_type, share_prefix=share,
                            n_threads=a.threads or None)

    # ------------------------------------------------------------------ mesh

    async def mesh(self, P: int, prefix: list[int]) -> None:
        marks: list[float] = []
        t0 = time.perf_counter()
        pool = SharedKVPool(self.config(P), prefix)
        await pool.start(lambda done, total: marks.append(time.perf_counter()))
        start_s = time.perf_counter() - t0
        # Marks land after each chunk; the first chunk's own time is not seen, so the
        # second one's stands in for it (one chunk: the whole start, load included).
        prefill = (min(start_s, marks[-1] - marks[0] + marks[1] - marks[0])
                   if len(marks) > 1 else start_s)
        self.row(section="build", system="mesh", P=P, start_s=round(start_s, 3),
                 prefill_s=round(prefill, 3), prefill_tps=round(P / prefill, 1),
                 n_ctx=pool.info.n_ctx)
        try:
            await self.capacity(pool, P, "mesh")
            warm = await self.mesh_ttft(pool, P)
            self.row(section="ttft", system="mesh", P=P, case="prefix not decoded: prefix "
                     "prefill + a new agent", ttft_s=round(prefill + warm, 3), runs=1,
                     prompt_n=P + self.a.task_tokens)
            for n, s in self.rows:
                await self.decode_row("mesh", P, n, s, self.mesh_agents(pool, n, s))
        finally:
            await pool.aclose()

    async def capacity(self, pool: SharedKVPool, P: int, system: str) -> None:
        """Agents admitted with S private cells each, by the ledger (nothing decoded)."""
        S = self.a.agent_budget
        filler = self.tok.ids(S)
        admitted, reason = [], ""
        async with held_steps(pool):
            while True:
                try:
                    s = await pool.attach()
                except PoolFull as exc:
                    reason = str(exc)
                    break
                if pool.load().num_parked:  # it fit only by parking an idle agent
                    reason = "the KV cache is full: the next agent attaches by parking one"
                    await s.detach()
                    break
                try:
                    s.append_tokens(filler)
                except ContextOverflow as exc:
                    reason = str(exc)
                    await s.detach()
                    break
                admitted.append(s)
            for s in admitted:
                await s.detach()
        self.row(section="capacity", system=system, P=P, S=S, kv_cells=pool.info.n_ctx,
                 agents=len(admitted), how="pool admission accounting", refusal=reason[:160])

    async def mesh_ttft(self, pool: SharedKVPool, P: int) -> float:
        times = []
        for _ in range(self.a.ttft_runs):
            t0 = time.perf_counter()
            s = await pool.attach()
            s.append_tokens(self.tok.ids(self.a.task_tokens))
            t1 = t0
            async for _piece in s.generate(greedy(1)):
                t1 = time.perf_counter()
            await s.detach()
            times.append(t1 - t0)
        ttft = statistics.median(times)
        self.row(section="ttft", system="mesh", P=P, case="new agent, prefix decoded",
                 ttft_s=round(ttft, 4), runs=len(times), prompt_n=self.a.task_tokens,
                 all_s=[round(t, 4) for t in times])
        return ttft

    async def mesh_agents(self, pool: SharedKVPool, n: int, s: int) -> list[AgentRun]:
        barrier = asyncio.Barrier(n)
        a = self.a

        async def agent() -> AgentRun:
            run = AgentRun()
            try:
                sess = await pool.attach()
            except BaseException:
                await barrier.abort()  # the others must not wait for it forever
                raise
            try:
                try:
                    sess.append_tokens(self.tok.ids(s))
                    t0 = time.perf_counter()
                    async for _ in sess.generate(greedy(1)):
                        pass
                    run.start_s = time.perf_counter() - t0
                except BaseException:
                    await barrier.abort()
                    raise
                await barrier.wait()
                t0 = time.perf_counter()
                for _turn in range(a.turns):
                    sess.append_tokens(self.tok.ids(a.tool_tokens))
                    t1 = time.perf_counter()
                    stamps = [time.perf_counter() async for _ in sess.generate(greedy(a.gen))]
                    run.turn_s.append(time.perf_counter() - t1)
                    run.generated += len(stamps)
                    if len(stamps) > 1:
                        run.decode_s += stamps[-1] - stamps[0]
                        run.decoded_after_first += len(stamps) - 1
                run.wall_s = time.perf_counter() - t0
            finally:
                await sess.detach()
            return run

        return list(await asyncio.gather(*(agent() for _ in range(n))))

    async def mesh_naive(self, P: int, prefix: list[int]) -> None:
        """Capacity without sharing: the same engine with a prefix copy per session."""
        pool = SharedKVPool(self.config(P, share=False), prefix)
        await pool.start()
        try:
            await self.capacity(pool, P, "mesh naive")
        finally:
            await pool.aclose()

    # ------------------------------------------------------------------ shared steps

    async def decode_row(self, system: str, P: int, n: int, s: int,
                         run: Coroutine[Any, Any, list[AgentRun]], copies: bool = False,
                         slots: int | None = None) -> None:
        """Run ``run`` (N agents' tool loops) within what is left of the budget, unless
        the row does not fit the KV budget; its row, or why there is none."""
        a = self.a
        base = dict(section="decode", system=system, P=P, N=n, S=s, turns=a.turns, G=a.gen)
        need = (n * (P + s) if copies else P + n * s) + n * self.loop_cells
        if need > a.kv_budget or (slots is not None and n > slots):
            run.close()
            self.row(**base, note=f"does not fit: needs {need:,} cells of {a.kv_budget:,}")
            return
        left = self.clock.left()
        if left < a.min_row_s:
            run.close()
            self.row(**base, error=f"skipped: {left:.0f} s left of the budget")
            return
        try:
            runs = await asyncio.wait_for(run, timeout=left - 5)
        except TimeoutError:
            self.row(**base, error="out of time during the row")
            return
        except Exception as exc:  # one row's failure must not lose the others
            self.row(**base, error=f"{type(exc).__name__}: {exc}"[:300])
            return
        self.row(**base, **summarize(runs))

    # ------------------------------------------------------------------ llama-server

    def server_args(self) -> list[str]:
        a = self.a
        slots = max(n for n, _ in self.rows)
        return ["-c", str(a.kv_budget), "-np", str(slots), "--kv-unified", "--cache-ram",
                str(a.cache_ram_mib), "-fa", a.flash_attn, "-ctk", a.kv_type, "-ctv",
                a.kv_type, "-ngl", "999", "-b", str(a.n_batch), "-ub", str(a.n_batch),
                "--no-webui", *(["-t", str(a.threads)] if a.threads else []),
                *a.server_extra.split()]

    async def server(self, P: int, prefix: list[int]) -> None:
        a = self.a
        if self.clock.left() < a.min_row_s:
            self.row(section="ttft", system="llama-server", P=P, case="-",
                     error="skipped: out of time before start")
            return
        log = Path(a.out) / f"llama-server-P{P}.log"
        srv = LlamaServer(a.llama_server, a.model, self.server_args(), log)
        try:
            start_s = await asyncio.to_thread(srv.wait, min(300.0, self.clock.left()))
            self.row(section="build", system="llama-server", P=P, start_s=round(start_s, 3),
                     prefill_s=None, prefill_tps=None)
            slots = max(n for n, _ in self.rows)
            cold, holds = await self.server_ttft(srv, P, prefix)
            naive = a.kv_budget // (P + a.agent_budget)
            self.row(section="capacity", system="llama-server", P=P, S=a.agent_budget,
                     kv_cells=a.kv_budget, agents=min(naive, slots),
                     how="budget // (P + S): a prefix copy per slot")
            for n, s in self.rows:
                # slots that do not hold the prefix yet prefill it (or load it from
                # --cache-ram) in the untimed warm-up: skip rows that cannot finish.
                warmup = max(0, n - holds) * cold
                if warmup + a.min_row_s > self.clock.left():
                    self.row(section="decode", system="llama-server", P=P, N=n, S=s,
                             turns=a.turns, G=a.gen, error=f"skipped: warm-up of ~{warmup:.0f}"
                             f" s (cold prefills) exceeds the {self.clock.left():.0f} s left")
                    continue
                await self.decode_row("llama-server", P, n, s,
                                      self.server_agents(srv, prefix, n, s), copies=True,
                                      slots=slots)
                holds = max(holds, n)
        except Exception as exc:
            self.row(section="ttft", system="llama-server", P=P, case="-",
                     error=f"{type(exc).__name__}: {exc}"[:400])
        finally:
            await srv.close()

    async def server_ttft(self, srv: LlamaServer, P: int,
                          prefix: list[int]) -> tuple[float, int]:
        """A cold slot (slot 0, pinned: the prefix is decoded from scratch), then new agents
        the server places itself (``id_slot`` -1: it picks the slot whose prompt matches
        best, or loads the prefix from ``--cache-ram``); returns (cold seconds, slots that
        hold the prefix)."""
        a = self.a
        wall, doc = await srv.complete(prefix + self.tok.ids(a.task_tokens), 1, 0,
                                       self.clock.left())
        self.row(section="ttft", system="llama-server", P=P, case="cold slot (prefix not "
                 "decoded)", ttft_s=round(wall, 4), runs=1,
                 prompt_n=(doc.get("timings") or {}).get("prompt_n"))
        times, processed, slots = [], [], []
        for _ in range(max(1, a.ttft_runs - 1)):
            w, d = await srv.complete(prefix + self.tok.ids(a.task_tokens), 1, -1,
                                      self.clock.left())
            times.append(w)
            processed.append((d.get("timings") or {}).get("prompt_n"))
            slots.append(d.get("id_slot"))
        self.row(section="ttft", system="llama-server", P=P, case="new agent, prefix "
                 "decoded (server picks the slot)", ttft_s=round(statistics.median(times), 4),
                 runs=len(times), prompt_n=processed[0], all_s=[round(t, 4) for t in times],
                 all_prompt_n=processed, slots=slots)
        return wall, len({0, *(x for x in slots if isinstance(x, int))})

    async def server_agents(self, srv: LlamaServer, prefix: list[int], n: int,
                            s: int) -> list[AgentRun]:
        a = self.a
        barrier = asyncio.Barrier(n)
        deadline = self.clock.deadline
        return list(await asyncio.gather(*(server_agent(
            srv, i, prefix + self.tok.ids(s), [self.tok.ids(a.tool_tokens)
                                               for _ in range(a.turns)],
            a.gen, barrier, deadline) for i in range(n))))


def device() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.free",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20, check=True).stdout.strip()
        return out or "no GPU"
    except (OSError, subprocess.SubprocessError):
        return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def free_gpu_bytes() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=20, check=True).stdout.split()
        return int(out[0]) * (1 << 20)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def kv_budget(a: argparse.Namespace, kv: KVShape) -> tuple[int, str]:
    """``--kv-budget`` cells, or for ``auto`` what fits the free GPU memory (less the
    model and a headroom), capped at ``--kv-cap``."""
    if a.kv_budget != "auto":
        return int(a.kv_budget), "as given"
    free = free_gpu_bytes()
    if free is None:
        return a.kv_cap, "no nvidia-smi: the cap"
    room = free - os.path.getsize(a.model) - a.headroom_gib * GIB
    cells = int(room // kv.cell_bytes(a.kv_type)) // 256 * 256
    return max(256, min(a.kv_cap, cells)), (f"free {free / GIB:.1f} GiB - model - "
                                            f"{a.headroom_gib} GiB headroom")


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


async def amain(a: argparse.Namespace) -> int:
    clock = Clock(a.deadline_s)
    # one thread per in-flight llama-server request (the default pool has cores + 4)
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=80))
    probe = LlamaModel(a.model, vocab_only=True)
    layers, kv_heads, head_k, head_v, n_ctx_train = probe.kv_shape()
    name = probe.meta("general.name") or Path(a.model).stem
    probe.close()
    kv = KVShape(layers, kv_heads, head_k, head_v)
    a.kv_budget, how = kv_budget(a, kv)
    meta = {"geometry": name, "model": a.model, "weights": Path(a.model).stem.split("-")[-1],
            "device": device(), "kv_type": a.kv_type, "kv_budget": a.kv_budget,
            "kv_budget_how": how, "kv_gib": round(a.kv_budget * kv.cell_bytes(a.kv_type) / GIB,
                                                  2),
            "n_ctx_train": n_ctx_train, "started": datetime.datetime.now(
                datetime.UTC).isoformat(timespec="seconds"),
            "dry_run": a.dry_run, "args": vars(a).copy(), "llama_server_args": None,
            "notes": ["agents that fit: mesh rows by the pool's admission accounting; "
                      "llama-server by arithmetic (each slot holds its own prefix copy)",
                      "decode rows: warm-up turn (private context prefilled) untimed; "
                      "then `turns` tool-loop turns timed for all N agents at once"]}
    report = Report(Path(a.out) / "gpu_scenario.json", meta)
    sc = Scenario(a, report, clock)
    if a.llama_server:
        meta["llama_server_args"] = " ".join(["llama-server", *sc.server_args()])
    for i, P in enumerate(a.prefixes):
        # what later prefixes need is held back from this one's rows
        clock.reserve = a.reserve_s * (len(a.prefixes) - 1 - i)
        if clock.left() < a.min_row_s:
            sc.row(section="build", system="mesh", P=P, error="skipped: out of time")
            continue
        prefix = sc.tok.prefix(P)
        for step in (sc.mesh, sc.mesh_naive):
            try:
                await step(P, prefix)
            except Exception as exc:
                sc.row(section="build", system=step.__name__, P=P,
                       error=f"{type(exc).__name__}: {exc}"[:400])
        if a.llama_server:
            await sc.server(P, prefix)
    report.flush()
    print(Path(a.out, "gpu_scenario.md").read_text())
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="folder for gpu_scenario.json/.md and logs")
    p.add_argument("--llama-server", default=None, help="the llama-server binary (omit: "
                   "mesh rows only)")
    p.add_argument("--prefixes", type=ints, default=ints("32768,131072"))
    p.add_argument("--agent-budget", type=int, default=131072, help="S: private cells per "
                   "agent, for the capacity rows")
    p.add_argument("--kv-budget", default="auto", help="cells, or auto (free GPU memory)")
    p.add_argument("--kv-cap", type=int, default=1 << 20, help="most cells auto picks")
    p.add_argument("--headroom-gib", type=float, default=8.0)
    p.add_argument("--kv-type", default="q8_0", choices=("f16", "q8_0", "q4_0"))
    p.add_argument("--flash-attn", default="on", choices=("on", "off", "auto"))
    p.add_argument("--ns", type=ints, default=ints("1,4,7"))
    p.add_argument("--short-ns", type=ints, default=ints("16,32"))
    p.add_argument("--private", type=int, default=1024, help="private tokens per agent "
                   "before its tool loop (rows --ns)")
    p.add_argument("--short-private", type=int, default=256, help="the same, rows --short-ns")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--gen", type=int, default=32, help="G: tokens generated per turn")
    p.add_argument("--tool-tokens", type=int, default=64, help="tool result per turn")
    p.add_argument("--task-tokens", type=int, default=64, help="a new agent's task")
    p.add_argument("--ttft-runs", type=int, default=3)
    p.add_argument("--n-batch", type=int, default=2048)
    p.add_argument("--cache-ram-mib", type=int, default=65536)
    # Without it (llama.cpp's default with --cache-ram), a --kv-unified server saves every
    # idle slot to the RAM cache and clears it when another task starts, and a pinned
    # slot then prefills its whole context again each turn (the CPU dry run: 6,792 prompt
    # tokens for 4 agents x 2 turns at P = 2,048). Kept resident, it is the stronger
    # baseline; --cache-ram still serves slot switches.
    p.add_argument("--server-extra", default="--no-cache-idle-slots",
                   help="more llama-server flags (\"\" for llama.cpp's defaults)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--deadline-s", type=float, default=420.0)
    p.add_argument("--min-row-s", type=float, default=15.0)
    p.add_argument("--reserve-s", type=float, default=300.0, help="seconds held back from "
                   "each prefix's rows for every later prefix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="label the results a CPU dry run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(amain(parse(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
