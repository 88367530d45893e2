"""Server processes for the benches: a free loopback port, waiting for a health URL, a
bounded stop (SIGTERM, then SIGKILL), and the two baselines the side-by-side starts itself:
llama.cpp's ``llama-server`` and vLLM-CPU (through ``../shared/tools/vllm-cpu-serve.sh``).
Every bench that starts a server goes through here, so none leaves one running."""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["Spawned", "free_port", "llama_server_argv", "spawn_llama_server", "spawn_vllm",
           "stop", "vllm_blocks", "vllm_env", "wait_healthy"]

# The vLLM-CPU launcher (its header says how it installs and what it serves).
VLLM_SCRIPT = Path(os.environ.get("MESH_VLLM_SCRIPT") or (
    Path(__file__).resolve().parents[3] / "shared" / "tools" / "vllm-cpu-serve.sh"))
VLLM_CPU_BLOCK = 128  # vLLM-CPU's KV block (and prefix-cache) granularity, in tokens


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_healthy(url: str, proc: subprocess.Popen[bytes], *, limit_s: float = 120.0,
                 log: Path | None = None, name: str = "the server",
                 poll_s: float = 0.1, path: str = "/healthz") -> float:
    """Seconds until ``url + path`` answered 200; RuntimeError (with the tail of ``log``,
    if given) when ``proc`` exits first or ``limit_s`` passes."""
    t0 = time.monotonic()

    def tail() -> str:
        return f":\n{log.read_text(errors='replace')[-3000:]}" if log and log.exists() else ""

    while time.monotonic() - t0 < limit_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}{tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + path, timeout=2).status_code == 200:
                return time.monotonic() - t0
        time.sleep(poll_s)
    raise RuntimeError(f"{name} did not start within {limit_s:g} s{tail()}")


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 30.0, *, group: bool = False) -> None:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL (no-op when it already exited).
    ``group``: signal the process group ``proc`` leads (started with
    ``start_new_session=True``), so a launcher script's children stop with it."""
    if proc.poll() is not None and not group:
        return

    def send(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)

    send(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
        if group:  # the leader is gone; give its children the same grace, then kill
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and _group_alive(proc.pid):
                time.sleep(0.2)
            send(signal.SIGKILL)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait(timeout=10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class Spawned:
    """A server this bench started: stop it with :meth:`close`."""

    proc: subprocess.Popen[bytes]
    url: str  # base URL, without /v1
    startup_s: float
    log: Path
    group: bool = False

    def close(self) -> None:
        stop(self.proc, group=self.group)


def llama_server_argv(binary: str, model: str, port: int, *, slots: int, ctx: int,
                      cache_ram_mib: int = 8192, threads: int | None = None) -> list[str]:
    """llama-server with ``slots`` slots sharing ``ctx`` cells (each slot gets
    ``ctx // slots``), the prompt cache in RAM on (``--cache-ram``), /metrics on."""
    argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(ctx), "--cache-ram", str(cache_ram_mib), "--metrics",
            "--no-webui"]
    if threads:
        argv += ["-t", str(threads)]
    return argv


def spawn_llama_server(binary: str, model: str, *, slots: int, ctx: int, log: Path,
                       limit_s: float = 600.0) -> Spawned:
    """Start llama-server (see :func:`llama_server_argv`), wait for ``/health``."""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(llama_server_argv(binary, model, port, slots=slots, ctx=ctx),
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        startup = wait_healthy(url, proc, limit_s=limit_s, log=log, name="llama-server",
                               path="/health")
    except RuntimeError as exc:
        stop(proc)
        raise SystemExit(f"{exc}\n(build it with ../shared/tools/build-llama-server.sh)") \
            from None
    return Spawned(proc, url, startup, log)


def vllm_env(max_model_len: int, kv_bytes: int) -> dict[str, str]:
    """The launcher's environment: the context vLLM allows and its KV space in whole GiB
    (``VLLM_CPU_KVCACHE_SPACE``; at least 1)."""
    gib = max(1, math.ceil(kv_bytes / 2**30))
    return {"MAX_MODEL_LEN": str(max_model_len), "VLLM_CPU_KVCACHE_SPACE": str(gib)}


def vllm_blocks(seqs: int, tokens_per_seq: int, block: int = VLLM_CPU_BLOCK) -> int:
    """KV blocks that hold ``seqs`` sequences of ``tokens_per_seq`` tokens (each sequence
    takes whole blocks), plus one: vLLM's ``--num-gpu-blocks-override`` for a KV cache the
    size of llama-server's ``-c N×(P+S)``."""
    return seqs * -(-tokens_per_seq // block) + 1


def spawn_vllm(gguf: str, *, name: str, max_model_len: int, kv_bytes: int, max_seqs: int,
               log: Path, blocks: int | None = None, limit_s: float = 1800.0) -> Spawned:
    """vLLM-CPU on ``gguf``'s weights with automatic prefix caching, through the launcher
    script (its first run installs vLLM and dequantizes the GGUF: minutes); waits for
    ``/health``. Started in its own process group: the script runs vLLM as a child.
    ``blocks``: the KV cache's size in blocks (``--num-gpu-blocks-override``)."""
    if not VLLM_SCRIPT.is_file():
        raise SystemExit(f"{VLLM_SCRIPT} not found; pass --vllm URL of a running vLLM")
    port = free_port()
    argv = ["bash", str(VLLM_SCRIPT), gguf, str(port), name, "--max-num-seqs", str(max_seqs),
            "--enable-prompt-tokens-details"]
    if blocks is not None:
        argv += ["--num-gpu-blocks-override", str(blocks)]
    env = {**os.environ, **vllm_env(max_model_len, kv_bytes)}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        startup = wait_healthy(url, proc, limit_s=limit_s, log=log, name="vLLM", poll_s=0.5,
                               path="/health")
    except RuntimeError as exc:
        stop(proc, group=True)
        raise SystemExit(str(exc)) from None
    return Spawned(proc, url, startup, log, group=True)


_VLLM_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


def vllm_kv_tokens(log: Path) -> int | None:
    """The KV cache size vLLM logged at start (``... KV cache size: 43,680 tokens``)."""
    m = _VLLM_TOKENS.search(log.read_text(errors="replace")) if log.exists() else None
    return int(m.group(1).replace(",", "")) if m else None
