"""Server processes for the benches: a free loopback port, waiting for ``/healthz``, and a
bounded stop (SIGTERM, then SIGKILL). Every bench that starts a server goes through here,
so none leaves one running."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path

import httpx

__all__ = ["free_port", "stop", "wait_healthy"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_healthy(url: str, proc: subprocess.Popen[bytes], *, limit_s: float = 120.0,
                 log: Path | None = None, name: str = "the server",
                 poll_s: float = 0.1) -> float:
    """Seconds until ``url/healthz`` answered 200; RuntimeError (with the tail of ``log``,
    if given) when ``proc`` exits first or ``limit_s`` passes."""
    t0 = time.monotonic()

    def tail() -> str:
        return f":\n{log.read_text(errors='replace')[-3000:]}" if log and log.exists() else ""

    while time.monotonic() - t0 < limit_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}{tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return time.monotonic() - t0
        time.sleep(poll_s)
    raise RuntimeError(f"{name} did not start within {limit_s:g} s{tail()}")


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL (no-op when it already exited)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
