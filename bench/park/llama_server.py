"""park_bench's comparison row: the same agents on llama.cpp's ``llama-server -np N
--cache-ram M`` through its OpenAI API (``/v1/completions``, streamed).

Same KV memory: llama-server gives each of its ``-np`` slots ``-c / np`` cells and shares
no prefix between concurrent slots, so with ``-c = P + resident x S`` (park_bench's budget)
only ``(P + resident x S) // (P + S)`` slots hold an agent's whole context: that is ``N``
(at least 1). An agent whose turn finds every slot busy waits in llama-server's queue; an
idle agent's prompt leaves its slot for ``--cache-ram`` (host RAM, M MiB) and is found
again by prefix match on its next turn. Agents are not pinned to slots.

Each agent sends the prefix and its own growing suffix as token ids (the same counts as
park_bench's pool agents: ``tool`` tokens of tool result, then ``gen`` tokens generated
with ``ignore_eos``, then an idle gap); the reply is appended re-tokenized by the server's
``/tokenize``. Rows have park_bench's ``Run.row()`` shape, mode ``llama-server``.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import httpx

from bench.common.servers import Spawned, free_port, llama_server_argv, stop, wait_healthy

__all__ = ["llama_server_slots", "run_llama_server"]


class _Geometry(Protocol):
    prefix: int
    suffix: int
    resident: int
    turns: int
    gen: int
    idle_s: float

    @property
    def tool(self) -> int: ...


class _Run(Protocol):
    agents: int
    served: int
    failed: list[str]
    max_attached: int
    wall_s: float
    turn_start: list[float]
    attach_wait: list[float]
    tps: list[float]
    load: dict[str, int]


def llama_server_slots(g: _Geometry) -> tuple[int, int]:
    """``(slots, ctx)``: the slots whose whole context fits park_bench's KV budget."""
    ctx = g.prefix + g.resident * g.suffix + 64
    return max(1, ctx // (g.prefix + g.suffix + 64)), ctx


def spawn(binary: str, model: str, g: _Geometry, *, cache_ram_mib: int,
          threads: int | None, log: Path) -> Spawned:
    slots, ctx = llama_server_slots(g)
    port = free_port()
    argv = llama_server_argv(binary, model, port, slots=slots, ctx=ctx,
                             cache_ram_mib=cache_ram_mib, threads=threads)
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        startup = wait_healthy(url, proc, limit_s=600.0, log=log, name="llama-server",
                               path="/health")
    except RuntimeError as exc:
        stop(proc)
        raise SystemExit(f"{exc}\n(build it with ../shared/tools/build-llama-server.sh)") \
            from None
    return Spawned(proc, url, startup, log)


async def _tokenize(client: httpx.AsyncClient, text: str) -> list[int]:
    r = await client.post("/tokenize", json={"content": text, "add_special": False})
    r.raise_for_status()
    return [int(t) for t in r.json()["tokens"]]


Words = Callable[[random.Random, int], str]  # park_bench.words: n words of tool-ish text


async def _tokens(client: httpx.AsyncClient, words: Words, rng: random.Random, n: int
                  ) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        out += await _tokenize(client, " " + words(rng, max(8, n - len(out))))
    return out[:n]


async def _turn(client: httpx.AsyncClient, prompt: list[int], gen: int
                ) -> tuple[str, float | None, float | None, int]:
    """One streamed completion: (text, first token time, last token time, chunks)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": gen, "temperature": 0,
            "stream": True, "ignore_eos": True, "cache_prompt": True}
    text, first, last, n = "", None, None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0].get("text") or ""
            if piece:
                last = time.monotonic()
                first = first or last
                n += 1
                text += piece
    return text, first, last, n


async def _agent(client: httpx.AsyncClient, g: _Geometry, i: int, run: _Run, seed: int,
                 prefix: list[int], words: Words, live: list[int]) -> None:
    rng = random.Random(seed * 1000 + i)  # park_bench's agent seeds
    await asyncio.sleep(rng.uniform(0, g.idle_s))
    run.attach_wait.append(0.0)  # nothing to attach: a turn waits in the server's queue
    live[0] += 1
    run.max_attached = max(run.max_attached, live[0])
    suffix: list[int] = []
    try:
        for _ in range(g.turns):
            suffix += await _tokens(client, words, rng, g.tool)
            t0 = time.monotonic()
            text, first, last, n = await _turn(client, prefix + suffix, g.gen)
            if first is None or last is None:
                raise RuntimeError("a turn produced no token")
            run.turn_start.append(first - t0)
            if n > 1 and last > first:
                run.tps.append((n - 1) / (last - first))
            suffix += await _tokenize(client, text)
            await asyncio.sleep(rng.expovariate(1.0 / g.idle_s) if g.idle_s > 0 else 0.0)
        run.served += 1
    except Exception as exc:  # counted, not raised: "nothing lost" is a result
        run.failed.append(f"agent {i}: {exc!r}")
    finally:
        live[0] -= 1


async def run_llama_server(binary: str, model: str, g: _Geometry, run: _Run, *,
                           prefix: list[int], words: Words, seed: int, cache_ram_mib: int,
                           threads: int | None, log: Path) -> None:
    """Fill ``run`` (mode ``llama-server``) with ``run.agents`` agents on a fresh server."""
    server = await asyncio.to_thread(spawn, binary, model, g, cache_ram_mib=cache_ram_mib,
                                     threads=threads, log=log)
    slots, ctx = llama_server_slots(g)
    try:
        timeout = httpx.Timeout(30.0, read=None)  # a queued turn is silent for long
        limits = httpx.Limits(max_connections=run.agents + 4)
        async with httpx.AsyncClient(base_url=server.url, timeout=timeout,
                                     limits=limits) as client:
            live = [0]
            t0 = time.monotonic()
            await asyncio.gather(*(_agent(client, g, i, run, seed, prefix, words, live)
                                   for i in range(run.agents)))
            run.wall_s = time.monotonic() - t0
        run.load = {"slots": slots, "ctx": ctx, "cache_ram_mib": cache_ram_mib}
    finally:
        await asyncio.to_thread(server.close)
