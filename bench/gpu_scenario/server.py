"""llama.cpp's llama-server in the GPU scenario: the process, and agents that talk to it.

Prompts go to ``/completion`` as token ids (the same ids mesh decodes; no chat template,
no tokenizer difference), each agent pinned to its own slot (``id_slot``) with
``cache_prompt``, so a turn prefills only what its slot does not hold yet. Timings are the
client's wall clock; the server's own (``timings.prompt_n``: prompt tokens it processed)
are kept beside them.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["AgentRun", "LlamaServer", "server_agent"]


@dataclass
class AgentRun:
    """One agent's timed tool-loop turns (either system)."""

    generated: int = 0
    wall_s: float = 0.0
    decode_s: float = 0.0  # first to last token of each turn (llama-server: predicted_ms)
    decoded_after_first: int = 0
    prompt_n: int = 0  # prompt tokens the server processed (llama-server only)
    start_s: float = 0.0  # the untimed warm-up turn: its private context prefilled
    start_prompt_n: int = 0  # prompt tokens the server processed in it (llama-server)
    turn_s: list[float] = field(default_factory=list)


class LlamaServer:
    """``llama-server`` on a free loopback port; :meth:`close` stops it (bounded).

    Standard library HTTP only (in a thread per request): the GPU machine reaches no
    package index, and httpx is not among the wheels carried there."""

    def __init__(self, binary: str, model: str, args: Sequence[str], log: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port),
                     *args]
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         env=os.environ.copy())

    def wait(self, limit_s: float) -> float:
        """Seconds until ``/health`` answers 200; RuntimeError with the log's tail when the
        process exits first or ``limit_s`` passes."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"llama-server did not start within {limit_s:.0f} s; see {self.log}")

    def _post(self, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=max(1.0, timeout_s)) as r:
                doc: dict[str, Any] = json.loads(r.read())
                return doc
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"llama-server answered {exc.code}: "
                               f"{exc.read()[:300]!r}") from None

    async def complete(self, prompt: list[int], n_predict: int, slot: int,
                       timeout_s: float) -> tuple[float, dict[str, Any]]:
        """(wall seconds, the server's answer) of one non-streamed completion; ``slot``
        -1 lets the server pick."""
        body = {"prompt": prompt, "n_predict": n_predict, "id_slot": slot,
                "cache_prompt": True, "temperature": 0.0, "ignore_eos": True,
                "return_tokens": True, "stream": False}
        t0 = time.perf_counter()
        doc = await asyncio.to_thread(self._post, body, timeout_s)
        return time.perf_counter() - t0, doc

    async def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait, 10)


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
        run.start_prompt_n = int((doc.get("timings") or {}).get("prompt_n", 0))
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
