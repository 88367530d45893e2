"""llama.cpp's llama-server in the GPU scenario: the process, and agents that talk to it.

Prompts go to ``/completion`` as token ids (the same ids mesh decodes; no chat template,
no tokenizer difference), each agent pinned to its own slot (``id_slot``) with
``cache_prompt``, so a turn prefills only what its slot does not hold yet. Timings are the
client's wall clock; the server's own (``timings.prompt_n``: prompt tokens it processed)
are kept beside them.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.servers import free_port, stop, wait_healthy

__all__ = ["AgentRun", "LlamaServer", "server_agent"]


@dataclass
class AgentRun:
    """One agent's timed tool-loop turns (either system)."""

    generated: int = 0
    wall_s: float = 0.0
    decode_s: float = 0.0  # first to last token of each turn, summed (mesh only)
    decoded_after_first: int = 0
    prompt_n: int = 0  # prompt tokens the server processed (llama-server only)
    start_s: float = 0.0  # the untimed warm-up turn: its private context prefilled
    turn_s: list[float] = field(default_factory=list)


class LlamaServer:
    """``llama-server`` on a free loopback port; :meth:`close` stops it (bounded)."""

    def __init__(self, binary: str, model: str, args: Sequence[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port),
                     *args]
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         env=os.environ.copy())
        self.client = httpx.AsyncClient(base_url=self.url, timeout=None)

    def wait(self, limit_s: float) -> float:
        return wait_healthy(self.url, self.proc, limit_s=limit_s, log=self.log,
                            name="llama-server", poll_s=0.25)

    async def complete(self, prompt: list[int], n_predict: int, slot: int,
                       timeout_s: float) -> tuple[float, dict[str, Any]]:
        """(wall seconds, the server's answer) of one non-streamed completion."""
        body = {"prompt": prompt, "n_predict": n_predict, "id_slot": slot,
                "cache_prompt": True, "temperature": 0.0, "ignore_eos": True,
                "return_tokens": True, "stream": False}
        t0 = time.perf_counter()
        r = await self.client.post("/completion", json=body, timeout=max(1.0, timeout_s))
        wall = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"llama-server answered {r.status_code}: {r.text[:300]}")
        doc: dict[str, Any] = r.json()
        return wall, doc

    async def close(self) -> None:
        await self.client.aclose()
        stop(self.proc)


def tokens_of(doc: dict[str, Any]) -> list[int]:
    toks = doc.get("tokens")
    if not isinstance(toks, list):
        raise RuntimeError("llama-server returned no token ids (is return_tokens supported?)")
    return [int(t) for t in toks]


async def server_agent(server: LlamaServer, slot: int, prompt: list[int],
                       tools: Sequence[list[int]], gen: int, barrier: asyncio.Barrier,
                       deadline: float) -> AgentRun:
    """Warm-up turn (prefix + private context, 1 token), then one timed turn per tool
    result: history + tool tokens in, ``gen`` tokens out."""
    run = AgentRun()
    try:
        run.start_s, doc = await server.complete(prompt, 1, slot, deadline - time.monotonic())
        history = prompt + tokens_of(doc)
    except BaseException:
        await barrier.abort()  # the others must not wait for it forever
        raise
    await barrier.wait()
    t0 = time.perf_counter()
    for tool in tools:
        history += tool
        wall, doc = await server.complete(history, gen, slot, deadline - time.monotonic())
        out = tokens_of(doc)
        history += out
        run.generated += len(out)
        run.turn_s.append(wall)
        timings = doc.get("timings") or {}
        run.prompt_n += int(timings.get("prompt_n", 0))
        if timings.get("predicted_n", 0) > 1:
            run.decode_s += float(timings.get("predicted_ms", 0.0)) / 1e3
            run.decoded_after_first += int(timings["predicted_n"])
    run.wall_s = time.perf_counter() - t0
    return run
