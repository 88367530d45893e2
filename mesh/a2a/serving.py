"""Serve an app on one event loop, from its start-up to its close.

:func:`run_server` runs three things on one loop, in order: the app's lifespan start-up
(which builds what the app serves, see :func:`mesh.a2a.app.create_app`), uvicorn on the
socket, then the lifespan's shutdown. uvicorn's own lifespan and signal handling are off
here: this module owns both, so every object is built, used and closed on the loop that
serves it, and a signal closes everything once.

A signal (SIGINT or SIGTERM), by phase:

* start-up: the start-up is cancelled and what it built so far is closed; the exit status
  is ``128 + signal`` (130 for Ctrl-C);
* serving: uvicorn stops accepting, gives open streams ``graceful_s`` seconds, then the
  app closes (running tasks are cancelled and recorded as failed "interrupted by
  restart", sessions freed, the store closed); exit status 0. A second SIGINT cuts the
  graceful wait short, as in uvicorn;
* closing: ignored (closing is already under way and bounded).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

__all__ = ["run_server", "serve_app"]

logger = logging.getLogger(__name__)
# uvicorn's own lifespan lines, written where it would write them (operators and tests read
# "Application startup complete." and "Application shutdown complete."); none before the
# start-up, whose error is then the only line.
lifespan_log = logging.getLogger("uvicorn.error")

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handling: :class:`_Stop` handles the signals
    for the whole life (uvicorn's would re-raise a signal after serving, before the app
    is closed: a SIGTERM then killed the process with the pool still open)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _Stop:
    """What a signal does in the current phase (see the module docstring)."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task[Any]) -> None:
        self.server = server
        self.task = task
        self.phase = "starting"
        self.signal: int | None = None
        self.cancelled = False

    def __call__(self, sig: int) -> None:
        if self.signal is None:
            self.signal = sig
        if self.phase == "starting":
            if not self.cancelled:
                self.cancelled = True
                self.task.cancel()
        elif self.phase == "serving":
            self.server.handle_exit(sig, None)
        else:
            logger.info("signal %d while closing: already stopping", sig)


@contextlib.contextmanager
def _handlers(loop: asyncio.AbstractEventLoop, stop: _Stop) -> Iterator[None]:
    """Route SIGINT/SIGTERM to ``stop`` while serving (main thread only; elsewhere, e.g. a
    test's server thread, the caller stops the server through ``should_exit``)."""
    before: dict[signal.Signals, Any] = {}
    # asyncio routes signals only on a Unix loop in the main thread.
    routable = sys.platform != "win32" and threading.current_thread() is threading.main_thread()
    try:
        for sig in HANDLED_SIGNALS if routable else ():
            previous = signal.getsignal(sig)
            loop.add_signal_handler(sig, stop, sig)
            before[sig] = previous
        yield
    finally:
        for sig, previous in before.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, previous)  # the caller's handler, not asyncio's default


async def serve_app(app: Any, config: uvicorn.Config,
                    sock: socket.socket | None = None) -> int:
    """Start ``app``'s lifespan, serve it with uvicorn (``config.lifespan`` must be
    ``"off"``: the lifespan runs here), close it; on the running loop. Returns the exit
    status (see the module docstring; 1 if uvicorn could not start). Exceptions of the
    app's start-up propagate (the CLI turns them into one line)."""
    if config.lifespan != "off":
        raise ValueError("serve_app runs the app's lifespan itself: pass "
                         "uvicorn.Config(..., lifespan='off')")
    server = _Server(config)
    task = asyncio.current_task()
    assert task is not None
    stop = _Stop(server, task)
    with _handlers(asyncio.get_running_loop(), stop):
        try:
            async with app.router.lifespan_context(app):
                lifespan_log.info("Application startup complete.")
                stop.phase = "serving"
                try:
                    await server.serve(sockets=[sock] if sock is not None else None)
                finally:
                    stop.phase = "closing"
                    lifespan_log.info("Waiting for application shutdown.")
            lifespan_log.info("Application shutdown complete.")
        except asyncio.CancelledError:
            if not stop.cancelled:
                raise
            task.uncancel()
            assert stop.signal is not None
            return 128 + stop.signal
    return 0 if server.started else 1


def run_server(
    app: Any,
    host: str,
    port: int,
    *,
    log_level: str = "info",
    graceful_s: int = 5,
    sock: socket.socket | None = None,
) -> int:
    """Serve ``app`` until SIGINT/SIGTERM on a new event loop (:func:`serve_app`);
    returns an exit status.

    ``sock``: an already bound, listening socket to serve on (``mesh serve`` binds the port
    before its slow start-up, so a port in use fails at once); without it uvicorn binds
    ``host:port`` itself.
    """
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=graceful_s)
    factory = getattr(config, "get_loop_factory", None)  # uvicorn >= 0.36
    with asyncio.Runner(loop_factory=factory() if factory is not None else None) as runner:
        return runner.run(serve_app(app, config, sock))
