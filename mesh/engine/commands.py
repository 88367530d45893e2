"""The engine thread's command queue: callers hand it functions, the thread runs them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
from collections.abc import Callable
from typing import TypeVar

__all__ = ["Commands"]

T = TypeVar("T")


class Commands:
    """Functions to run on the engine thread, in order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    def wake(self) -> None:
        self._queue.put(lambda: None)

    async def call(self, fn: Callable[[], T]) -> T:
        """Queue ``fn`` and await its result (or its exception)."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

        self._queue.put(run)
        return await asyncio.wrap_future(fut)

    def drain(self, block: bool) -> None:
        """Engine thread: run every queued command (waiting up to 0.25 s for one if
        ``block``)."""
        try:
            cmd = self._queue.get(timeout=0.25) if block else self._queue.get_nowait()
        except queue.Empty:
            return
        cmd()
        while True:
            try:
                self._queue.get_nowait()()
            except queue.Empty:
                return
