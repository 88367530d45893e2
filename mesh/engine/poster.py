"""The poster thread: hands each step's items to the consumers' asyncio loops.

``loop.call_soon_threadsafe`` writes to the loop's wake-up socket, and that write lets the
woken loop take the GIL while the engine thread waits to get it back, so delivery in the
engine thread serialised the consumers' work with the engine's. The engine thread queues
one mapping per step instead (no system call); this thread posts it, one
``call_soon_threadsafe`` per loop per step, once the engine thread lets go of the GIL in
``llama_decode``: the consumers run while the next step decodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from mesh.engine.session import Turn, deliver

__all__ = ["Poster"]

Items = Mapping[asyncio.AbstractEventLoop, Sequence[tuple[Any, Any]]]


class Poster:
    """Delivers in order: a batch queued before another reaches its loops first."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Items | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mesh-poster", daemon=True)
        self._thread.start()

    def post(self, by_loop: Items) -> None:
        """Queue one step's items, grouped by consumer loop (any thread)."""
        self._queue.put(by_loop)

    def post_outbox(self, outbox: list[tuple[Turn, Any]]) -> None:
        """Engine thread: group the outbox by its turns' loops, queue it, empty it (the
        same list object: the turns keep appending to it)."""
        if not outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Turn, Any]]] = {}
        for turn, item in outbox:
            by_loop.setdefault(turn.loop, []).append((turn, item))
        outbox.clear()
        self.post(by_loop)

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            for loop, items in batch.items():
                with contextlib.suppress(RuntimeError):  # a closed loop drops its items
                    loop.call_soon_threadsafe(deliver, list(items))

    def close(self) -> None:
        """Deliver what is queued, then stop the thread (blocks; idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
