"""Benchmark of the shared KV pool: cells, capacity, attach, warm start, batched decode.

    .venv/bin/python -m bench.pool          # default model, full run (~100 s, 2 cores)
    .venv/bin/python -m bench.pool --quick --model tiny

Every section runs in the same process, so the comparisons are ratios measured minutes
apart on the same (noisy, shared) machine. The table goes to stdout, a live progress line
to stderr, and everything (with ``meta`` and pass/fail ``targets``) to
``bench/pool/results/pool.json`` or ``--out``.

What is measured, and how:

* ``reduction``: N sessions attached to one prefix (P tokens), each with S private tokens
  decoded. ``pooled_cells`` is the pool's own accounting (``load().cells_used``); it must
  equal the cell count derived from llama.cpp's ``seq_pos_min/max`` per sequence and the
  number of cells in llama.cpp's serialized cache (``native_cells``; asserted).
* ``capacity``: a real pool of 8,192 cells with max_sessions 255, attached and prefilled
  until it refuses. llama.cpp allows 256 sequences (the prefix holds one), so the count
  stops at 255 (``limit == "seq_limit"``); ``pooled`` is the cell arithmetic
  ``(8192 - P) // S``, validated by the measured count plus the free cells left after it.
  ``naive`` is ``8192 // (P + S)``, validated by the engine's own admission accounting in a
  ``share_prefix=False`` pool (``naive_admitted``; no prefill, attaches inside ``held()``).
* ``attach``: time from ``attach()`` until the first piece of ``generate(max_tokens=1)``
  after appending a 25-token suffix, on a pool that holds the prefix; vs the same call on
  a ``share_prefix=False`` pool, where the session prefills prefix + suffix itself (same
  engine, same step loop: "from scratch").
* ``warm_start``: ``restore_s`` times ``mesh.engine.build.restore_snapshot`` of the snapshot that a
  cold pool saved, into a bare context shaped like the pool's; ``prefill_s`` times the same
  chunked prefill the pool does, on that context. Neither includes model loading. The
  end-to-end ``start()`` times of the cold and warm pools are reported beside them.
* ``decode``: N sessions, each generating T tokens greedy, started together inside
  ``held_steps(pool)``; vs the same N generations one after another on the same pool (fresh
  sessions with the same suffixes). Suffix prefill is done before timing in both cases.
* ``overhead``: ``pool.stats.host_s``/``decode_s``/``num_steps`` deltas over the batched runs.
  ``untracked_ms`` is wall time per step outside both counters (the engine loop between
  steps, delivery to asyncio).
"""

from __future__ import annotations

import argparse
import asyncio
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mesh.engine.config import EngineConfig, SamplingParams
from mesh.engine.interface import PoolFull
from mesh.engine.llama import LlamaContext, LlamaModel
from mesh.engine.models import resolve_model
from mesh.engine.pool import MAX_SEQUENCES, SharedKVPool, held_steps
from mesh.engine.session import PooledSession

QUICK_OUT = Path(tempfile.gettempdir()) / "mesh-bench" / "pool.json"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "pool.json"

_WORDS = (
    "agent", "tool", "file", "module", "test", "build", "cache", "index", "route", "queue",
    "task", "worker", "token", "prefix", "session", "decode", "batch", "sample", "model", "layer",
    "vector", "buffer", "config", "server", "client", "request", "response", "stream", "event",
    "status", "error", "retry", "limit", "budget", "window", "report", "table", "plot", "user",
    "project", "package", "import", "export", "parse", "render", "check", "commit", "branch",
    "merge", "review", "deploy",
)


# --------------------------------------------------------------------------- helpers


class Live:
    """A live progress line on stderr (one line per phase when stderr is not a TTY)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._phase = ""
        self._last = 0.0

    def __call__(self, phase: str, detail: str = "", force: bool = False) -> None:
        now = time.perf_counter()
        if self.tty:
            if not force and phase == self._phase and now - self._last < 0.1:
                return
            sys.stderr.write(f"\r\033[K[{now - self.t0:6.1f}s] {phase} {detail}")
            sys.stderr.flush()
        elif phase != self._phase:
            sys.stderr.write(f"[{now - self.t0:6.1f}s] {phase}\n")
            sys.stderr.flush()
        self._phase, self._last = phase, now

    def done(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
        sys.stderr.write(f"[{time.perf_counter() - self.t0:6.1f}s] done\n")


def prefix_tokens(model: LlamaModel, n: int, seed: int = 0) -> list[int]:
    """Exactly ``n`` token ids (BOS first when the model adds one) of project-like text."""
    rng = random.Random(seed)
    words = n * 2
    while True:
        lines = ["System: you are a worker agent. The project follows.\n"]
        while sum(len(line.split()) for line in lines) < words:
            a, b = rng.choice(_WORDS), rng.choice(_WORDS)
            body = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 14)))
            lines.append(f"src/{a}_{b}.py: {body}.\n")
        tokens = model.tokenize("".join(lines), add_bos=model.add_bos)
        if len(tokens) >= n:
            return tokens[:n]
        words *= 2


def suffix_tokens(model: LlamaModel, i: int, n: int) -> list[int]:
    """``n`` private tokens for session ``i`` (distinct per ``i``)."""
    text = f"\nTask {i}: check the {_WORDS[i % len(_WORDS)]} module and report.\n"
    toks = model.tokenize(text, add_bos=False)
    while len(toks) < n:
        toks += toks
    return toks[:n]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_at_eos=False)


async def run_turns(sessions: Sequence[PooledSession], pool: SharedKVPool,
                    params: SamplingParams) -> list[list[int]]:
    """Start one turn per session in the same step (inside ``held()``), run them all."""
    gens = [s.generate(params) for s in sessions]
    async with held_steps(pool):
        for g in gens:
            await g.start()
    return list(await asyncio.gather(*(collect(g) for g in gens)))


async def collect(gen: Any) -> list[int]:
    return [p.token async for p in gen]


def cells_from_ranges(ranges: dict[int, tuple[int, int]]) -> int:
    """Distinct cells implied by llama.cpp's per-sequence position ranges: the prefix
    sequence's cells plus each session's positions past the prefix. Asserts every session
    starts at the prefix's first position (it shares the prefix)."""
    lo0, hi0 = ranges[0]
    total = hi0 + 1
    for seq, (lo, hi) in ranges.items():
        if seq == 0:
            continue
        assert lo == lo0, f"sequence {seq} starts at {lo}, the prefix at {lo0}"
        total += hi - hi0
    return total


async def native_cells(pool: SharedKVPool) -> tuple[int, int] | None:
    """llama.cpp's own count of occupied cells (and sequence references)."""
    census = await pool.call(pool.parts.cell_census)
    return None if census is None else (census.cells, census.seq_refs)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


# --------------------------------------------------------------------------- sections


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick: bool = args.quick
        resolved = resolve_model(args.model)
        self.model_path = str(resolved.path)
        self.model_name = resolved.name
        self.threads: int = args.threads or os.cpu_count() or 1
        self.live = Live()
        t0 = time.perf_counter()
        self.tok = LlamaModel(self.model_path)  # tokenizer, and the bare-context model
        self.model_load_s = time.perf_counter() - t0
        self.tmp = tempfile.TemporaryDirectory(prefix="pool-bench-")

    def config(self, **kw: Any) -> EngineConfig:
        return EngineConfig(model_path=self.model_path, n_threads=self.threads, **kw)

    async def pool(self, prefix: list[int], label: str, **kw: Any) -> SharedKVPool:
        pool = SharedKVPool(self.config(**kw), prefix)
        await pool.start(lambda d, t: self.live(label, f"prefix {d}/{t}"))
        return pool

    # ------------------------------------------------------------ reduction + decode

    async def reduction_and_decode(self) -> tuple[dict[str, Any], dict[str, Any],
                                                  dict[str, Any]]:
        P, S = 875, 20
        T = 8 if self.quick else 32
        s_dec = 16
        ns = (1, 2, 4, 8, 16)
        dec_ns = (1, 8, 16) if self.quick else ns
        prefix = prefix_tokens(self.tok, P)
        pool = await self.pool(prefix, "reduction: build prefix", max_sessions=16,
                               session_budget=s_dec + T + 2 + S)
        try:
            reduction = await self._reduction(pool, P, S, ns)
            decode, overhead = await self._decode(pool, P, s_dec, T, dec_ns)
        finally:
            await pool.aclose()
        return reduction, decode, overhead

    async def _reduction(self, pool: SharedKVPool, P: int, S: int,
                         ns: Sequence[int]) -> dict[str, Any]:
        rows = []
        sessions: list[PooledSession] = []
        for n in ns:
            self.live("reduction", f"N={n}")
            fresh = [await pool.attach() for _ in range(n - len(sessions))]
            for s in fresh:
                s.append_tokens(suffix_tokens(self.tok, len(sessions), S))
                sessions.append(s)
            # max_tokens=1 decodes the S-th token; the sampled one is not decoded (it goes
            # back to the session's queue), so each session holds exactly S private cells.
            await run_turns(fresh, pool, greedy(1))
            load = pool.load()
            ranges = await pool.call(pool.parts.seq_pos_ranges)
            by_ranges = cells_from_ranges(ranges)
            native = await native_cells(pool)
            pooled = load.cells_used
            naive, ideal = n * (P + S), P + n * S
            assert pooled == by_ranges, f"pool says {pooled} cells, llama.cpp {by_ranges}"
            assert native is None or native[0] == pooled, f"native cells {native} != {pooled}"
            assert load.naive_cells == naive, (load.naive_cells, naive)
            rows.append({"N": n, "P": P, "S": S, "pooled_cells": pooled, "naive_cells": naive,
                         "ideal_cells": ideal, "ratio": round(naive / pooled, 3),
                         "range_cells": by_ranges,
                         "native_cells": native[0] if native else None,
                         "native_seq_refs": native[1] if native else None})
        for s in sessions:
            await s.detach()
        return {"rows": rows}

    async def _decode(self, pool: SharedKVPool, P: int, s_dec: int, T: int,
                      ns: Sequence[int]) -> tuple[dict[str, Any], dict[str, Any]]:
        rows, over = [], []
        params = greedy(T)

        async def fresh(n: int) -> list[PooledSession]:
            ss = [await pool.attach() for _ in range(n)]
            for i, s in enumerate(ss):
                s.append_tokens(suffix_tokens(self.tok, 100 + i, s_dec))
            await run_turns(ss, pool, greedy(1))  # suffix prefill, not timed
            return ss

        def counters() -> tuple[int, float, float]:
            return pool.stats.num_steps, pool.stats.host_s, pool.stats.decode_s

        for n in ns:
            # Batched: all N turns start in the same step.
            ss = await fresh(n)
            gens = [s.generate(params) for s in ss]
            done = [0]

            async def consume(g: Any, label: str, done: list[int] = done,
                              total: int = n * T) -> None:
                async for _ in g:
                    done[0] += 1
                    self.live(label, f"{done[0]}/{total} tokens")

            async with held_steps(pool):
                for g in gens:
                    await g.start()
                c0 = counters()
                t0 = time.perf_counter()
            await asyncio.gather(*(consume(g, f"decode N={n} batched") for g in gens))
            wall = time.perf_counter() - t0
            c1 = counters()
            for s in ss:
                await s.detach()
            steps = c1[0] - c0[0]
            host, dec = c1[1] - c0[1], c1[2] - c0[2]
            # Sequential: the same N generations, one after another.
            ss = await fresh(n)
            done[0] = 0
            seq_wall = 0.0
            for s in ss:
                g = s.generate(params)
                await g.start()
                t0 = time.perf_counter()
                await consume(g, f"decode N={n} sequential")
                seq_wall += time.perf_counter() - t0
            for s in ss:
                await s.detach()
            agg = n * T / wall
            seq_agg = n * T / seq_wall
            rows.append({"N": n, "T": T, "step_ms": round((host + dec) / steps * 1e3, 2),
                         "agg_tps": round(agg, 2), "per_session_tps": round(agg / n, 2),
                         "sequential_agg_tps": round(seq_agg, 2),
                         "speedup": round(agg / seq_agg, 3), "wall_s": round(wall, 3),
                         "sequential_wall_s": round(seq_wall, 3), "steps": steps})
            wall_ms = wall / steps * 1e3
            over.append({"N": n, "host_ms": round(host / steps * 1e3, 3),
                         "decode_ms": round(dec / steps * 1e3, 3),
                         "host_share": round(host / (host + dec), 4),
                         "wall_ms": round(wall_ms, 3),
                         "untracked_ms": round(wall_ms - (host + dec) / steps * 1e3, 3)})
        return {"P": P, "suffix": s_dec, "T": T, "rows": rows}, {"rows": over}

    # ------------------------------------------------------------ capacity

    async def capacity(self) -> dict[str, Any]:
        P, S, buf = 875, 24, 8192
        prefix = prefix_tokens(self.tok, P)
        max_sessions = MAX_SEQUENCES - 1
        pool = await self.pool(prefix, "capacity: build prefix", max_sessions=max_sessions,
                               session_budget=S, n_ctx=buf)
        try:
            n_ctx = pool.info.n_ctx
            sessions: list[PooledSession] = []
            refusal = ""
            while True:
                self.live("capacity: attach", f"{len(sessions)} sessions")
                try:
                    s = await pool.attach()
                except PoolFull as exc:
                    refusal = str(exc)
                    break
                s.append_tokens(suffix_tokens(self.tok, len(sessions), S))
                sessions.append(s)
            limit = "seq_limit" if pool.load().free_seq_ids == 0 else "cells"
            self.live("capacity: prefill", f"{len(sessions)} sessions")
            # The session budget is S: the sampled token finds no room ("context_full"),
            # and every session holds exactly its S appended tokens.
            await run_turns(sessions, pool, greedy(1))
            load = pool.load()
            ranges = await pool.call(pool.parts.seq_pos_ranges)
            by_ranges = cells_from_ranges(ranges)
            native = await native_cells(pool)
            # Sessions past the cache's sequence ids are attached parked (their cells off
            # the cache): the cells in use are the prefix and the resident sessions'.
            attached, measured = len(sessions), load.num_resident
            assert load.cells_used == P + measured * S == by_ranges, (
                load.cells_used, by_ranges, P, measured, S)
            assert native is None or native[0] == load.cells_used, native
            by_cells = (n_ctx - P) // S
            more = (n_ctx - load.cells_used) // S
            for s in sessions:
                await s.detach()
        finally:
            await pool.aclose()
        naive_admitted = await self._naive_admitted(prefix, S, buf)
        return {
            "buffer_cells": n_ctx, "P": P, "S": S,
            "pooled": by_cells, "naive": buf // (P + S),
            "pooled_measured": measured, "pooled_attached": attached,
            "pooled_by_cells": by_cells, "limit": limit,
            "refusal": refusal, "cells_used": load.cells_used, "native_cells":
            native[0] if native else None, "cells_free_after": n_ctx - load.cells_used,
            "validated": limit == "cells" or measured + more == by_cells,
            "naive_admitted": naive_admitted,
        }

    async def _naive_admitted(self, prefix: list[int], S: int, buf: int) -> int:
        """Sessions a share_prefix=False pool admits into ``buf`` cells: its admission
        accounting only (inside held(), no step runs, nothing is prefilled)."""
        self.live("capacity: naive accounting")
        pool = await self.pool(prefix, "capacity: naive", max_sessions=32, session_budget=S,
                               n_ctx=buf, share_prefix=False)
        admitted: list[PooledSession] = []
        try:
            async with held_steps(pool):
                while True:
                    try:
                        s = await pool.attach()
                        s.append_tokens(suffix_tokens(self.tok, len(admitted), S))
                    except PoolFull:
                        break
                    admitted.append(s)
                for s in admitted:
                    await s.detach()
        finally:
            await pool.aclose()
        return len(admitted)

    # ------------------------------------------------------------ attach + warm start

    async def first_piece_s(self, pool: SharedKVPool, suffix: list[int]) -> float:
        """attach + append ``suffix`` + generate(max_tokens=1): seconds to the piece."""
        t0 = time.perf_counter()
        s = await pool.attach()
        s.append_tokens(suffix)
        t1 = t0
        async for _ in s.generate(greedy(1)):
            t1 = time.perf_counter()
        await s.detach()
        return t1 - t0

    async def attach_and_warm(self) -> tuple[dict[str, Any], dict[str, Any]]:
        S = 25
        sizes = (900,) if self.quick else (900, 4096)
        rows = []
        warm: dict[str, Any] = {}
        for P in sizes:
            prefix = prefix_tokens(self.tok, P)
            suffix = suffix_tokens(self.tok, 7, S)
            cache = Path(self.tmp.name) / f"cache-{P}"
            kw: dict[str, Any] = {"max_sessions": 2, "session_budget": 64}
            t0 = time.perf_counter()
            pool = await self.pool(prefix, f"attach P={P}: build prefix",
                                   cache_dir=str(cache) if sizes[0] == P else None, **kw)
            cold_start_s = time.perf_counter() - t0
            try:
                att = []
                for r in range(2 if self.quick else 3):
                    self.live(f"attach P={P}", f"rep {r + 1}")
                    att.append(await self.first_piece_s(pool, suffix))
                if sizes[0] == P:
                    warm = await self._warm(pool, prefix, cache, cold_start_s, kw)
            finally:
                await pool.aclose()
            naive = await self.pool(prefix, f"attach P={P}: scratch pool", share_prefix=False,
                                    **kw)
            try:
                scr = []
                for r in range(1 if self.quick or P > 1024 else 2):
                    self.live(f"attach P={P}: scratch", f"rep {r + 1}")
                    scr.append(await self.first_piece_s(naive, suffix))
            finally:
                await naive.aclose()
            a, b = min(att), min(scr)
            rows.append({"P": P, "S": S, "attach_s": round(a, 4), "scratch_s": round(b, 3),
                         "ratio": round(b / a, 1), "attach_samples": [round(x, 4) for x in att],
                         "scratch_samples": [round(x, 3) for x in scr]})
        return {"rows": rows, "stat": "min of samples"}, warm

    async def _warm(self, cold: SharedKVPool, prefix: list[int], cache: Path,
                    cold_start_s: float, kw: dict[str, Any]) -> dict[str, Any]:
        P = len(prefix)
        suffix = suffix_tokens(self.tok, 3, 12)
        self.live("warm start: generate on cold pool")
        s = await cold.attach()
        s.append_tokens(suffix)
        cold_tokens = [p.token async for p in s.generate(greedy(8))]
        await s.detach()
        snaps = sorted(cache.glob("prefix-*.kv"))
        assert len(snaps) == 1, f"expected one snapshot in {cache}, found {snaps}"
        snap = snaps[0]
        t0 = time.perf_counter()
        warm_pool = await self.pool(prefix, "warm start: restore", cache_dir=str(cache), **kw)
        warm_start_s = time.perf_counter() - t0
        try:
            warm_started = warm_pool.info.warm_started
            s = await warm_pool.attach()
            s.append_tokens(suffix)
            warm_tokens = [p.token async for p in s.generate(greedy(8))]
            await s.detach()
        finally:
            await warm_pool.aclose()
        # Model-load-free numbers on a bare context shaped like the pool's.
        info = cold.info
        from mesh.engine.build import restore_snapshot
        from mesh.engine.llama import Batch

        ctx = LlamaContext(self.tok, n_ctx=info.n_ctx, n_seq_max=info.n_seq_max,
                           n_batch=cold.config.n_batch, n_outputs_max=info.n_seq_max,
                           n_threads=self.threads, swa_full=cold.config.swa_full)
        batch = Batch(cold.config.n_batch)
        try:
            self.live("warm start: bare prefill")
            chunk = cold.config.prefill_chunk
            t0 = time.perf_counter()
            for start in range(0, P, chunk):  # the pool's own prefix prefill, chunk by chunk
                batch.clear()
                for i, tok in enumerate(prefix[start : start + chunk]):
                    batch.add(tok, start + i, 0, False)
                assert ctx.decode(batch) == 0
            prefill_s = time.perf_counter() - t0
            restores = []
            for r in range(3 if self.quick else 5):
                self.live("warm start: bare restore", f"rep {r + 1}")
                ctx.seq_remove(0)
                t0 = time.perf_counter()
                ok = restore_snapshot(ctx, snap, 0, prefix)
                restores.append(time.perf_counter() - t0)
                assert ok, "the pool's snapshot did not restore"
        finally:
            batch.close()
            ctx.close()
        restore_s = median(restores)
        return {
            "P": P, "restore_s": round(restore_s, 5), "prefill_s": round(prefill_s, 3),
            "ratio": round(prefill_s / restore_s, 1),
            "restore_samples": [round(x, 5) for x in restores],
            "snapshot_bytes": snap.stat().st_size,
            "cold_start_s": round(cold_start_s, 3), "warm_start_s": round(warm_start_s, 3),
            "model_load_s": round(self.model_load_s, 3), "warm_started": warm_started,
            "tokens_match": cold_tokens == warm_tokens,
            "method": "restore_s: median of restore_snapshot() of the cold pool's snapshot into a "
                      "bare context shaped like the pool's; prefill_s: the pool's chunked "
                      "prefix prefill on that context; neither includes model load",
        }


# --------------------------------------------------------------------------- report


def _row(r: dict[str, Any], key: str, n: int) -> dict[str, Any] | None:
    return next((x for x in r[key]["rows"] if x.get("N", x.get("P")) == n), None)


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Pass/fail per target; a row a quick run did not measure is ``None``, not a fail."""
    out: list[dict[str, Any]] = []

    def add(name: str, target: str, value: Any, ok: Any) -> None:
        out.append({"name": name, "target": target, "value": value,
                    "pass": None if value is None else bool(ok)})

    def value(key: str, n: int, field: str) -> Any:
        row = _row(r, key, n)
        return None if row is None else row[field]

    red = r["reduction"]["rows"]
    ideal = all(x["pooled_cells"] == x["ideal_cells"] for x in red)
    add("reduction.pooled_is_ideal", "pooled_cells == ideal_cells for every N", ideal, ideal)
    v = value("reduction", 8, "ratio")
    add("reduction.ratio@8", ">= 6.9", v, v is not None and v >= 6.9)
    cap = r["capacity"]
    add("capacity.pooled", ">= 300 (validated)", cap["pooled"],
        cap["pooled"] >= 300 and cap["validated"])
    add("capacity.naive", "== 9 (== naive_admitted)", cap["naive"],
        cap["naive"] == 9 == cap["naive_admitted"])
    for p, lim in ((900, 20.0), (4096, 80.0)):
        v = value("attach", p, "ratio")
        add(f"attach.ratio@{p}", f">= {lim:g}", v, v is not None and v >= lim)
    w = r["warm_start"]
    add("warm_start.ratio", ">= 500 (and same tokens)", w["ratio"],
        w["ratio"] >= 500 and w["tokens_match"])
    for n, lim in ((8, 1.3), (16, 1.4)):
        v = value("decode", n, "speedup")
        add(f"decode.speedup@{n}", f">= {lim}", v, v is not None and v >= lim)
    v = value("overhead", 16, "host_share")
    add("overhead.host_share@16", "<= 0.05", v, v is not None and v <= 0.05)
    return out


def table(title: str, rows: list[dict[str, Any]], cols: Sequence[str]) -> str:
    lines = [f"\n### {title}\n", "| " + " | ".join(cols) + " |",
             "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in cols) + " |")
    return "\n".join(lines)


def render(r: dict[str, Any]) -> str:
    m = r["meta"]
    parts = [f"## pool bench: {m['model']} ({m['threads']} threads, {m['cpu']}"
             f"{', quick' if m['quick'] else ''})"]
    parts.append(table("KV cells: pooled vs naive", r["reduction"]["rows"],
                       ("N", "P", "S", "pooled_cells", "naive_cells", "ideal_cells", "ratio",
                        "native_cells", "native_seq_refs")))
    cap = r["capacity"]
    parts.append(table(f"Capacity of a {cap['buffer_cells']}-cell buffer", [cap],
                       ("P", "S", "pooled", "pooled_measured", "limit", "cells_free_after",
                        "validated", "naive", "naive_admitted")))
    parts.append(table("Attach vs prefill from scratch", r["attach"]["rows"],
                       ("P", "S", "attach_s", "scratch_s", "ratio")))
    parts.append(table("Warm start (model load excluded)", [r["warm_start"]],
                       ("P", "restore_s", "prefill_s", "ratio", "cold_start_s",
                        "warm_start_s", "model_load_s", "tokens_match")))
    parts.append(table("Batched decode vs one after another", r["decode"]["rows"],
                       ("N", "step_ms", "agg_tps", "per_session_tps", "sequential_agg_tps",
                        "speedup")))
    parts.append(table("Host time per step", r["overhead"]["rows"],
                       ("N", "host_ms", "decode_ms", "host_share", "wall_ms",
                        "untracked_ms")))
    marks = {True: "pass", False: "FAIL", None: "not measured"}
    parts.append(table("Targets", [{**t, "pass": marks[t["pass"]]} for t in r["targets"]],
                       ("name", "target", "value", "pass")))
    return "\n".join(parts)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    bench = Bench(args)
    try:
        reduction, decode, overhead = await bench.reduction_and_decode()
        capacity = await bench.capacity()
        attach, warm = await bench.attach_and_warm()
    finally:
        bench.tok.close()
        bench.tmp.cleanup()
    bench.live.done()
    result: dict[str, Any] = {
        "meta": {
            "model": bench.model_name, "model_path": bench.model_path,
            "threads": bench.threads, "cpu": cpu_name(), "cpu_count": os.cpu_count(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "quick": bench.quick,
            "llama_cpp_python": importlib.metadata.version("llama-cpp-python"),
            "python": platform.python_version(),
            "elapsed_s": round(time.perf_counter() - bench.live.t0, 1),
        },
        "reduction": reduction, "capacity": capacity, "attach": attach,
        "warm_start": warm, "decode": decode, "overhead": overhead,
    }
    result["targets"] = targets(result)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                 description="Benchmark of the shared KV pool.")
    ap.add_argument("--model", default="gemma",
                    help="GGUF path, or smollm2, gemma, tiny (default: gemma, the model of "
                         "the README's figures)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and sizes")
    ap.add_argument("--threads", type=int, default=None, help="default: every core")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"default: {DEFAULT_OUT} (with --quick: {QUICK_OUT}, so a quick "
                         "run never replaces the committed result)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = QUICK_OUT if args.quick else DEFAULT_OUT
    result = asyncio.run(main_async(args))
    print(render(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
