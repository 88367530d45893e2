"""The mesh neighbour's client: ``python -m mesh.sim.neighbour_load --url URL``.

``--clients`` loops, each streaming ``/v1/chat/completions`` requests of ``--max-tokens``
tokens one after another (a 429 waits its ``Retry-After``; any other error waits a
second), until the process is killed or its ``--parent`` is gone.
:class:`~mesh.sim.neighbour.MeshLoad` kills it at the end of each "on" phase; a turn in
flight then may run on for at most ``--max-tokens`` tokens (hence the small default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys

import httpx

__all__ = ["main"]

_TOPICS = ("a sorting routine", "a build script", "a log parser", "a cache", "a queue",
           "a retry policy", "a config loader", "a test harness")


async def _client(http: httpx.AsyncClient, url: str, index: int, max_tokens: int,
                  seed: int) -> None:
    rng = random.Random(seed * 1000 + index)
    n = 0
    while True:
        n += 1
        body = {
            "model": "neighbour",
            "messages": [{"role": "user", "content": f"Request {index}.{n}: explain "
                          f"{rng.choice(_TOPICS)} in a few sentences."}],
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "seed": rng.getrandbits(31),
            "stream": True,
        }
        try:
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if r.status_code == 429:
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                    continue
                if r.status_code != 200:
                    await asyncio.sleep(1.0)
                    continue
                async for _ in r.aiter_lines():
                    pass
        except (httpx.HTTPError, ValueError):
            await asyncio.sleep(1.0)


async def _orphaned(parent: int | None) -> None:
    """Return once the parent (the harness) is gone: a killed harness leaves no load."""
    while parent is None or os.getppid() == parent:
        await asyncio.sleep(0.5)


async def run(url: str, clients: int, max_tokens: int, seed: int,
              parent: int | None = None) -> None:
    timeout = httpx.Timeout(30.0, read=None)
    async with httpx.AsyncClient(timeout=timeout) as http:
        loops = [asyncio.ensure_future(_client(http, url.rstrip("/"), i, max_tokens, seed))
                 for i in range(clients)]
        await _orphaned(parent)
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parent", type=int, default=None, help="exit when this pid is gone")
    args = p.parse_args(argv)
    print(json.dumps({"neighbour_load": vars(args)}), file=sys.stderr, flush=True)
    asyncio.run(run(args.url, args.clients, args.max_tokens, args.seed, args.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
