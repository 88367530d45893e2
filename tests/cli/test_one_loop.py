"""One composition root and one event loop (issue 26 item 3): what ``mesh serve`` builds is
built in the app's lifespan on the loop that serves it, and a signal closes it there, once.

In-process, on this (main) thread: ``run_server`` installs its signal handlers on the
loop it runs, and a helper thread sends this process the signal that stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mesh.a2a.app import AppParts, create_app, run_server
from mesh.a2a.config import CoordinatorConfig
from mesh.cli import serve as serve_cli
from tests.reliability.serve_proc import small_project
from tests.support.coord_helpers import POOL_INFO, FakeAdmission, Probe, ScriptedWorker

pytestmark = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                reason="signal handlers need the main thread")


class _SignalEscaped(Exception):
    pass


@pytest.fixture(autouse=True)
def _signals_stay_inside() -> Iterator[None]:
    """A signal the server let through fails the test instead of ending pytest. After
    the test, sse-starlette's process-wide "uvicorn is exiting" flag (set by uvicorn's
    ``handle_exit``, which a signal calls) is cleared: later servers in this process
    would otherwise end every event stream at once."""
    from sse_starlette.sse import AppStatus

    def escaped(sig: int, frame: Any) -> None:
        raise _SignalEscaped(f"signal {sig} reached the process: the server did not handle it")

    before = {sig: signal.signal(sig, escaped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        AppStatus.should_exit = False


def _listener() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


@contextlib.contextmanager
def _then_signal(url: str, paths: tuple[str, ...], sig: int,
                 got: dict[str, int]) -> Iterator[None]:
    """A thread that waits (bounded) for ``url`` to answer, GETs each path, then sends
    this process ``sig``."""
    def client() -> None:
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                        break
                time.sleep(0.05)
            for path in paths:
                got[path] = httpx.get(url + path, timeout=30).status_code
        finally:
            os.kill(os.getpid(), sig)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(timeout=60)


def test_parts_are_built_used_and_closed_on_the_serving_loop(tmp_path: Path) -> None:
    loops: dict[str, list[asyncio.AbstractEventLoop]] = {}

    def seen(what: str) -> None:
        loops.setdefault(what, []).append(asyncio.get_running_loop())

    async def where(request: Request) -> Response:
        seen("request")
        return JSONResponse({})

    async def compose(stack: AsyncExitStack) -> AppParts:
        seen("built")

        async def close() -> None:
            seen("closed")

        stack.push_async_callback(close)
        return AppParts(worker_factory=lambda: ScriptedWorker(Probe()),
                        admission=FakeAdmission(), pool_info=POOL_INFO,
                        extra_routes=[Route("/where", where)])

    sock = _listener()
    port = sock.getsockname()[1]
    app = create_app(CoordinatorConfig(port=port, data_dir=str(tmp_path / "data")), compose)
    got: dict[str, int] = {}
    with _then_signal(f"http://127.0.0.1:{port}", ("/where",), signal.SIGTERM, got):
        rc = run_server(app, "127.0.0.1", port, sock=sock, log_level="warning")
    sock.close()
    assert rc == 0 and got == {"/where": 200}
    assert set(loops) == {"built", "request", "closed"}, loops
    (built,) = loops["built"]
    assert loops["request"] == [built] and loops["closed"] == [built]  # one loop, closed once


def test_a_signal_during_start_up_closes_what_was_built(tmp_path: Path) -> None:
    started = threading.Event()
    closed: list[str] = []

    async def compose(stack: AsyncExitStack) -> AppParts:
        async def close() -> None:
            closed.append("pool")

        stack.push_async_callback(close)
        started.set()
        await asyncio.Event().wait()  # a start-up that only a signal ends
        raise AssertionError("not reached")

    def interrupt() -> None:
        if started.wait(timeout=60):
            os.kill(os.getpid(), signal.SIGINT)

    sock = _listener()
    app = create_app(CoordinatorConfig(data_dir=str(tmp_path / "data")), compose)
    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    rc = run_server(app, "127.0.0.1", sock.getsockname()[1], sock=sock, log_level="warning")
    thread.join(timeout=10)
    sock.close()
    assert rc == 128 + signal.SIGINT
    assert closed == ["pool"]


def test_mesh_serve_builds_pool_and_gate_on_the_loop_that_serves_them(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real ``mesh serve`` (tiny model, in-process): the pool and the gate are built,
    asked and closed on one loop; SIGTERM closes the pool once and exits 0."""
    import mesh.cli.compose as engines
    import mesh.gate.admission as gate_pkg

    loops: dict[str, list[asyncio.AbstractEventLoop]] = {}

    def seen(what: str) -> None:
        loops.setdefault(what, []).append(asyncio.get_running_loop())

    real_build: Callable[..., Any] = engines.build_engine

    def build_engine(*args: Any, **kwargs: Any) -> Any:
        seen("pool built")
        pool = real_build(*args, **kwargs)
        real_close = pool.aclose

        async def aclose() -> None:
            seen("pool closed")
            await real_close()

        pool.aclose = aclose
        return pool

    class Gate(gate_pkg.FloorGate):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            seen("gate built")
            super().__init__(*args, **kwargs)

        def capacity(self) -> dict[str, Any]:
            seen("gate asked")
            return super().capacity()

    monkeypatch.setattr(engines, "build_engine", build_engine)
    monkeypatch.setattr(gate_pkg, "FloorGate", Gate)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    parser = argparse.ArgumentParser(prog="mesh")
    serve_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args([
        "serve", "--model", str(tiny_model_path), "--threads", "1", "--policy", "none",
        "--port", str(port), "--data-dir", str(tmp_path / "data"), "--prefix-tokens", "256",
        "--project", str(small_project(tmp_path / "project")),
    ])
    got: dict[str, int] = {}
    with _then_signal(f"http://127.0.0.1:{port}", ("/capacity",), signal.SIGTERM, got):
        rc = serve_cli.run(args)
    assert rc == 0 and got == {"/capacity": 200}
    assert set(loops) == {"pool built", "gate built", "gate asked", "pool closed"}, loops
    (serving,) = set(loops["pool built"])
    assert all(loop is serving for seen_on in loops.values() for loop in seen_on), loops
    assert len(loops["pool closed"]) == 1  # closed once
