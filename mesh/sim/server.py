"""Start ``mesh serve`` as a subprocess for one run, and stop it afterwards.

The server listens on 127.0.0.1 at a free port with its own data directory. Startup is done
when the agent card answers; a server that exits or stays silent past the timeout raises
:class:`ServerError` with the tail of its stderr. Stopping sends SIGTERM, then SIGKILL after
a grace period, so no server outlives the run.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import httpx

from mesh.a2a_names import CARD_PATH
from mesh.sim.types import SimConfig

__all__ = [
    "CARD_PATH",
    "ServerCommand",
    "ServerError",
    "ServerProcess",
    "free_port",
    "mesh_executable",
    "parking_args",
    "serve_command",
]

_TAIL_CHARS = 3000


# (port, data dir) -> argv: how a server is started (default: :func:`serve_command`).
ServerCommand = Callable[[int, Path], list[str]]


class ServerError(RuntimeError):
    """The coordinator did not start (or answer) in time; the message has its stderr tail."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mesh_executable() -> list[str]:
    exe = Path(sys.executable).with_name("mesh")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("mesh")
    return [found] if found else [sys.executable, "-m", "mesh"]


def serve_command(config: SimConfig, port: int, data_dir: Path) -> list[str]:
    """The ``mesh serve`` command line for ``config``."""
    cmd = [*mesh_executable(), "serve", "--host", "127.0.0.1", "--port", str(port)]
    # "floor-auto": the floor policy finding its own floor (--floor-tps auto); the run's
    # floor_tps then stays the reference its windows are measured against.
    auto = config.policy == "floor-auto"
    policy = "floor" if auto else config.policy
    cmd += ["--template", config.template, "--policy", policy, "--pool", config.pool]
    cmd += ["--data-dir", str(data_dir)]
    if auto:
        cmd += ["--floor-tps", "auto"]
    elif config.floor_tps is not None:
        cmd += ["--floor-tps", f"{config.floor_tps:g}"]
    if config.model is not None:
        cmd += ["--model", config.model]
    return [*cmd, *parking_args(config), *config.serve_args]


def parking_args(config: SimConfig) -> list[str]:
    """``--scenario idle-agents``: fewer resident slots than agents, room for every agent
    to stay attached, and parking of idle sessions (none for other scenarios). The run's
    ``serve_args`` come after, so ``--serve-arg`` may override any of them."""
    if not config.idle_agents:
        return []
    idle = config.idle
    agents = config.packages if config.packages is not None else idle.default_agents()
    args = ["--max-sessions", str(idle.resident),
            "--max-attached", str(max(agents, idle.resident)),
            "--park-idle", f"{idle.park_idle_s:g}"]
    if idle.park_memory_gib is not None:
        args += ["--park-memory", f"{idle.park_memory_gib:g}"]
    return args


class ServerProcess:
    """``with ServerProcess(config) as url:`` a running coordinator at ``url``."""

    def __init__(
        self,
        config: SimConfig,
        *,
        command: ServerCommand | None = None,
        grace_s: float = 10.0,
    ) -> None:
        self._config = config
        self._command = command
        self._grace_s = grace_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.url = ""

    def start(self) -> str:
        self._tmp = tempfile.TemporaryDirectory(prefix="mesh-sim-")
        tmp = Path(self._tmp.name)
        port = free_port()
        if self._command is not None:
            cmd = self._command(port, tmp / "data")
        else:
            cmd = serve_command(self._config, port, tmp / "data")
        self.url = f"http://127.0.0.1:{port}"
        self._stderr = (tmp / "stderr.log").open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=self._stderr, stdin=subprocess.DEVNULL, env=env
        )
        try:
            self._wait_ready(cmd)
        except BaseException:
            self.stop()
            raise
        return self.url

    def stderr_tail(self) -> str:
        if self._tmp is None:
            return ""
        self._stderr.flush()
        data = (Path(self._tmp.name) / "stderr.log").read_bytes()
        return data[-_TAIL_CHARS:].decode("utf-8", "replace")

    def _wait_ready(self, cmd: list[str]) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self._config.startup_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise ServerError(
                        f"`{' '.join(cmd)}` exited with status {code} before answering\n"
                        f"--- its stderr (tail) ---\n{self.stderr_tail()}"
                    )
                try:
                    if client.get(self.url + CARD_PATH).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"`{' '.join(cmd)}` did not answer {CARD_PATH} within "
                        f"{self._config.startup_timeout_s:g} s\n"
                        f"--- its stderr (tail) ---\n{self.stderr_tail()}"
                    )
                time.sleep(0.1)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after the grace period. Returns the exit status."""
        code: int | None = None
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(self._grace_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            code = proc.returncode
        if self._tmp is not None:
            self._stderr.close()
            self._tmp.cleanup()
            self._tmp = None
        return code

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
