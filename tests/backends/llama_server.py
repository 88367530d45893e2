"""A real third-party OpenAI-compatible server on loopback: ``python -m llama_cpp.server``
(llama-cpp-python's server, from the ``test`` extra) serving the tiny GGUF.

Every wait is bounded; the process is killed at exit, whatever happened inside.
"""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.reliability.serve_proc import free_port

__all__ = ["LlamaServer", "llama_server"]

# What `python -m llama_cpp.server` imports beyond llama-cpp-python itself (its `server`
# extra); checked without importing llama_cpp here (only mesh's adapter imports it).
_SERVER_MODULES = ("fastapi", "sse_starlette", "starlette_context", "pydantic_settings")


@dataclass
class LlamaServer:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    model_id: str

    def output(self, tail: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-tail:]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def llama_server(model: Path, log_dir: Path, *extra: str, n_ctx: int = 2048,
                 timeout: float = 60) -> Iterator[LlamaServer]:
    """Start ``llama_cpp.server`` on a free port and wait until ``GET /v1/models`` answers.

    ``extra`` are more server flags (``--interrupt_requests False`` …). Fails, with the
    server's output, if it exits or does not answer within ``timeout`` seconds.
    """
    missing = [m for m in _SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise AssertionError(f"llama_cpp.server needs {', '.join(missing)}; install the "
                             "test extra: pip install -e '.[test]'")
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"llama-server-{port}.log"
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx),
            "--n_threads", "1", "--n_batch", "256", "--verbose", "False", *extra]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"llama_cpp.server exited {proc.returncode}:\n"
                                     f"{log.read_text(errors='replace')[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(url + "/v1/models", timeout=2)
                if r.status_code == 200:
                    model_id = str(r.json()["data"][0]["id"])
                    break
            if time.monotonic() > deadline:
                raise AssertionError(f"llama_cpp.server did not answer /v1/models within "
                                     f"{timeout:.0f} s:\n"
                                     f"{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        yield LlamaServer(proc, url, log, model_id)
    finally:
        _stop(proc)
