"""The pool's engine thread, its command queue and its poster.

One thread owns the llama.cpp context. Callers hand it functions through
:class:`~mesh.engine.commands.Commands` (:meth:`EngineThread.call`); between commands it
runs engine steps (:meth:`mesh.engine.parts.Parts.step`) while there is work, and after
each it hands the step's items to the :class:`~mesh.engine.poster.Poster`, which delivers
them to the consumers' loops once the snapshot they should see is published.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

from mesh.engine.commands import Commands
from mesh.engine.parts import Parts
from mesh.engine.poster import Poster
from mesh.engine.types import SessionFailed

__all__ = ["EngineThread"]

T = TypeVar("T")


class EngineThread:
    """Runs one pool's commands and steps on a thread of its own."""

    def __init__(self) -> None:
        self._commands = Commands()
        self._poster: Poster | None = None  # started with the thread
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.held = False  # no step while True (commands still run): see SharedKVPool.held

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, parts: Parts) -> None:
        self._poster = Poster()
        self._thread = threading.Thread(target=self._run, args=(parts,), name="mesh-engine",
                                        daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the thread, then deliver every item it posted (awaits both)."""
        self._stopping = True
        self.wake()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self._poster is not None:
            await asyncio.to_thread(self._poster.close)  # every posted item is delivered
            self._poster = None

    def wake(self) -> None:
        self._commands.wake()

    async def call(self, fn: Callable[[], T], undo: Callable[[T], None] | None = None) -> T:
        """Run ``fn`` on the engine thread and await its result; ``undo`` runs there on a
        result whose caller was cancelled (:meth:`Commands.call`)."""
        if self._thread is None or self._stopping:
            raise SessionFailed("the pool is not running")
        return await self._commands.call(fn, undo)

    def _run(self, parts: Parts) -> None:
        sched = parts.scheduler
        while not self._stopping:
            try:
                self._commands.drain(block=not self._has_work(parts))
                sched.park_idle()
                if not self._stopping and self._has_work(parts):
                    parts.step()
            except Exception as exc:  # the engine thread must survive anything
                sched.release_turns(reason=f"engine error: {exc!r}")
            self._flush(parts)
        self._flush(parts)

    def _has_work(self, parts: Parts) -> bool:
        return not self.held and parts.scheduler.has_work()

    def _flush(self, parts: Parts) -> None:
        """Post the step's items after the snapshot is published, so a consumer that sees
        a turn end also sees the pool after it."""
        assert self._poster is not None, "the engine thread runs only while the poster does"
        self._poster.post_outbox(parts.scheduler.take_items())
