"""The multi-turn agent workload of ``bench/openai/``: N agents through one
OpenAI-style ``/v1/chat/completions``, two waves, and what is read off each reply and off
the server's ``/metrics``. No server is started here."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from mesh.backends.openai import parse_prometheus

__all__ = ["COUNTERS", "TOOL_RESULT", "Target", "Wave", "processed", "ratio_lines", "ratios",
           "run_target", "table"]


TOOL_RESULT = ("courier/parcel.py:{n}: def route(parcel, depot): return depot.next_hop("
               "parcel.zone) if parcel.zone in depot.zones else None  # {n} of the log, "
               "status ok, 3 tests passed, 0 failed, elapsed 0.{n}s")
# Counters read off a backend's /metrics before and after each wave (the delta is kept).
COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
            "vllm:prompt_tokens_total", "llamacpp:prompt_tokens_total")


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
    metrics_delta: dict[str, float] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list, repr=False)


@dataclass
class Target:
    name: str
    url: str
    kv_cells: int | None = None
    startup_s: float | None = None
    prefix_tokens: int | None = None  # P asked for (None: the server's own)
    agents: int = 0
    kv_bytes: int | None = None
    waves: list[Wave] = field(default_factory=list)


def processed(body: dict[str, Any]) -> int:
    timings = body.get("timings") or {}
    if "prompt_n" in timings:
        return int(timings["prompt_n"])
    usage = body.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return int(usage.get("prompt_tokens", 0)) - int(cached)


async def chat(client: httpx.AsyncClient, model: str, messages: list[dict[str, str]],
               tokens: int, slot: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": tokens,
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


async def agent(client: httpx.AsyncClient, model: str, system: str, wave: int, i: int,
                turns: int, tokens: int, slot: int | None, out: Wave) -> None:
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": f"Task w{wave}a{i}: find where parcels are routed "
                 f"and explain step {i} of the route."}]
    for t in range(turns):
        t0 = time.monotonic()
        try:
            body = await chat(client, model, messages, tokens, slot)
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


async def counters(client: httpx.AsyncClient) -> dict[str, float]:
    """The :data:`COUNTERS` a backend's /metrics shows (empty without one)."""
    with contextlib.suppress(httpx.HTTPError):
        r = await client.get("/metrics", timeout=10)
        if r.status_code == 200:
            found = parse_prometheus(r.text)
            return {k: found[k] for k in COUNTERS if k in found}
    return {}


async def model_id(client: httpx.AsyncClient) -> str:
    """The first model ``/v1/models`` lists (vLLM refuses any other name)."""
    with contextlib.suppress(httpx.HTTPError, KeyError, IndexError, ValueError):
        return str((await client.get("/v1/models")).json()["data"][0]["id"])
    return "bench"


async def run_target(target: Target, system: str, a: argparse.Namespace, pin: bool) -> None:
    async with httpx.AsyncClient(base_url=target.url, timeout=a.timeout) as client:
        model = await model_id(client)
        for w in range(2):
            wave = Wave()
            before = await counters(client)
            t0 = time.monotonic()
            await asyncio.gather(*(agent(client, model, system, w, i, a.turns, a.tokens,
                                         i if pin else None, wave)
                                   for i in range(target.agents)))
            wave.wall_s = time.monotonic() - t0
            after = await counters(client)
            wave.metrics_delta = {k: after[k] - before.get(k, 0.0) for k in after}
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
    rows = ["| system | P | N | wave | wall s | +start-up s | turn p50 s | turn p95 s | "
            "prompt tok processed | KV cells | KV MiB | errors |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in targets:
        mib = f"{t.kv_bytes / 2**20:,.0f}" if t.kv_bytes else "?"
        for i, w in enumerate(t.waves):
            start = f"{t.startup_s:.1f}" if (i == 0 and t.startup_s is not None) else ""
            rows.append(f"| {t.name} | {t.prefix_tokens or '-'} | {t.agents} | {i + 1} | "
                        f"{w.wall_s:.1f} | {start} | {w.turn_p50_s:.2f} | {w.turn_p95_s:.2f} | "
                        f"{w.prompt_tokens_processed:,} | {t.kv_cells or '?'} | {mib} | "
                        f"{w.errors} |")
    return "\n".join(rows)


def ratios(targets: list[Target]) -> list[dict[str, Any]]:
    """Per (P, N) and other system: how many times mesh's wall time its wave 1 took (start-up
    included on both sides, when measured) and its wave 2 took: issue 29's goals."""
    out: list[dict[str, Any]] = []
    meshes = {(t.prefix_tokens, t.agents): t for t in targets
              if t.name == "mesh" and len(t.waves) == 2}
    for t in targets:
        m = meshes.get((t.prefix_tokens, t.agents))
        if m is None or t is m or len(t.waves) < 2:
            continue

        def cold(x: Target) -> float:
            return x.waves[0].wall_s + (x.startup_s or 0.0)

        out.append({"system": t.name, "prefix_tokens": t.prefix_tokens, "agents": t.agents,
                    "wave1_with_startup": cold(t) / cold(m) if cold(m) else None,
                    "wave1": t.waves[0].wall_s / m.waves[0].wall_s if m.waves[0].wall_s
                    else None,
                    "wave2": t.waves[1].wall_s / m.waves[1].wall_s if m.waves[1].wall_s
                    else None,
                    "kv_bytes": t.kv_bytes / m.kv_bytes if t.kv_bytes and m.kv_bytes
                    else None})
    return out


def ratio_lines(rows: list[dict[str, Any]]) -> str:
    def x(v: float | None) -> str:
        return f"{v:.2f}x" if v is not None else "?"

    return "\n".join(
        f"P={r['prefix_tokens'] or '-'} N={r['agents']}: {r['system']} / mesh wall: wave 1 "
        f"+ start-up {x(r['wave1_with_startup'])}, wave 1 {x(r['wave1'])}, wave 2 "
        f"{x(r['wave2'])}; KV bytes {x(r['kv_bytes'])}" for r in rows)
