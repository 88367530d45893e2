"""The engine thread's command queue: callers hand it functions, the thread runs them.

Cancellation contract: a caller cancelled while its command waits in the queue takes the
command with it (it never runs); a caller cancelled while its command runs cannot stop
it, so a command that creates something (a session) names its ``undo``, which the engine
thread runs on the result nobody will receive. Without that, an attach that lands just
after its task was cancelled would hold a session (cells, a sequence id) for ever.
"""

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

    def submit(self, fn: Callable[[], None]) -> None:
        """Queue ``fn`` with nobody awaiting it (any thread; never blocks)."""
        self._queue.put(fn)

    async def call(self, fn: Callable[[], T], undo: Callable[[T], None] | None = None) -> T:
        """Queue ``fn`` and await its result (or its exception). If the caller is
        cancelled after ``fn`` ran (or while it runs), ``undo(result)`` runs on the engine
        thread instead of the result being lost (see the module docstring)."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return  # the caller left before it ran: nothing was done, nothing to undo
            try:
                result = fn()
            except BaseException as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self._queue.put(run)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            if undo is not None:
                def orphaned(done: concurrent.futures.Future[T]) -> None:
                    if not done.cancelled() and done.exception() is None:
                        result = done.result()
                        self._queue.put(lambda: undo(result))

                fut.add_done_callback(orphaned)  # runs now if fn already finished
            raise

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
