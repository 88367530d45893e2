"""The processes a run starts: the coordinator under test (``mesh serve``), the
neighbour's load client (``python -m mesh.sim.processes``), and the neighbour tenant.

**The coordinator** listens on 127.0.0.1 at a free port with its own data directory; it is
up when the agent card answers; one that exits or stays silent past the timeout raises
:class:`ServerError` with its stderr tail. Stopping is SIGTERM, then SIGKILL after a grace.

**The neighbour's client** (``--url URL``): ``--clients`` loops, each streaming
``/v1/chat/completions`` requests of ``--max-tokens`` one after another (a 429 waits its
``Retry-After``, another error a second), until killed or its ``--parent`` is gone.

**The neighbour** (:class:`Neighbour`) follows its seeded schedule (:mod:`mesh.sim.scenario`)
on a thread, starting its load at each "on" phase and stopping it at each "off" one, and
records when it did (:class:`~mesh.sim.scenario.PhaseRecord`). :class:`CpuLoad`: ``cores``
busy-loop processes, each busy ``duty`` of every 100 ms; :class:`MeshLoad`: a second
``mesh serve`` (policy ``none``) started before the run, driven while "on" by the client
above (killed at "off": a turn in flight may run on for ``max_tokens``). The load runs in
child processes, never on the harness's event loop, so the run's timestamps stay clean.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import httpx

from mesh.a2a_names import CARD_PATH
from mesh.sim.scenario import NeighbourConfig, PhaseRecord, SimConfig, iter_phases

__all__ = [
    "CpuLoad", "Load", "MeshLoad", "Neighbour", "ServerCommand", "ServerError", "ServerProcess",
    "free_port", "main", "make_load", "mesh_executable", "parking_args", "serve_command"
]


# -------------------- the coordinator process ---------------------------------

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
    cmd += ["--template", config.template, "--policy", policy, "--pool", config.pool,
            "--data-dir", str(data_dir)]
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

    def __init__(self, config: SimConfig, *, command: ServerCommand | None = None,
                 grace_s: float = 10.0) -> None:
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
        cmd = (self._command(port, tmp / "data") if self._command is not None
               else serve_command(self._config, port, tmp / "data"))
        self.url = f"http://127.0.0.1:{port}"
        self._stderr = (tmp / "stderr.log").open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._stderr,
                                      stdin=subprocess.DEVNULL, env=env)
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
            while (code := self._proc.poll()) is None:
                with contextlib.suppress(httpx.TransportError):
                    if client.get(self.url + CARD_PATH).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    why = f"did not answer {CARD_PATH} within {self._config.startup_timeout_s:g} s"
                    break
                time.sleep(0.1)
            else:
                why = f"exited with status {code} before answering"
        raise ServerError(f"`{' '.join(cmd)}` {why}\n"
                          f"--- its stderr (tail) ---\n{self.stderr_tail()}")

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after the grace period. Returns the exit status."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _kill([proc], self._grace_s)
        if self._tmp is not None:
            self._stderr.close()
            self._tmp.cleanup()
            self._tmp = None
        return proc.returncode if proc is not None else None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

# -------------------- the neighbour's client ----------------------------------

_TOPICS = ("a sorting routine", "a build script", "a log parser", "a cache", "a queue",
           "a retry policy", "a config loader", "a test harness")


async def _client(http: httpx.AsyncClient, url: str, index: int, max_tokens: int,
                  seed: int) -> None:
    rng = random.Random(seed * 1000 + index)
    n = 0
    while True:
        n += 1
        body = {"model": "neighbour",
                "messages": [{"role": "user", "content": f"Request {index}.{n}: explain "
                              f"{rng.choice(_TOPICS)} in a few sentences."}],
                "max_tokens": max_tokens, "temperature": 0.8, "seed": rng.getrandbits(31),
                "stream": True}
        try:
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if r.status_code == 429:
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                    continue
                if r.status_code != 200:
                    await asyncio.sleep(1.0)
                    continue
                async for _ in r.aiter_lines():
                    pass
        except (httpx.HTTPError, ValueError):
            await asyncio.sleep(1.0)


async def _orphaned(parent: int | None) -> None:
    """Return once the parent (the harness) is gone: a killed harness leaves no load."""
    while parent is None or os.getppid() == parent:
        await asyncio.sleep(0.5)


async def run(url: str, clients: int, max_tokens: int, seed: int,
              parent: int | None = None) -> None:
    timeout = httpx.Timeout(30.0, read=None)
    async with httpx.AsyncClient(timeout=timeout) as http:
        loops = [asyncio.ensure_future(_client(http, url.rstrip("/"), i, max_tokens, seed))
                 for i in range(clients)]
        await _orphaned(parent)
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parent", type=int, default=None, help="exit when this pid is gone")
    args = p.parse_args(argv)
    print(json.dumps({"neighbour_load": vars(args)}), file=sys.stderr, flush=True)
    asyncio.run(run(args.url, args.clients, args.max_tokens, args.seed, args.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())

# -------------------- the neighbour -------------------------------------------

# One core, busy for DUTY of every PERIOD seconds; it ends itself when its parent (the
# harness) is gone, so a killed harness leaves no core burning.
_BUSY = """
import os, sys, time
duty, period, parent = float(sys.argv[1]), 0.1, int(sys.argv[2])
while os.getppid() == parent:
    end = time.monotonic() + duty * period
    while time.monotonic() < end:
        pass
    if duty < 1.0:
        time.sleep(period * (1.0 - duty))
"""
NEIGHBOUR_DATA_DIR = Path(tempfile.gettempdir()) / "mesh-sim-neighbour"


class Load(Protocol):
    """What a neighbour does: ``setup`` once, ``start``/``stop`` per phase, ``close``."""

    def setup(self) -> None: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def close(self) -> None: ...


def _kill(procs: list[subprocess.Popen[bytes]], grace_s: float = 2.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class CpuLoad:
    """``cores`` busy-loop processes while on."""

    def __init__(self, cores: int, duty: float) -> None:
        self.cores = cores
        self.duty = duty
        self._procs: list[subprocess.Popen[bytes]] = []

    def setup(self) -> None:
        pass

    def start(self) -> None:
        self._procs = [
            subprocess.Popen([sys.executable, "-c", _BUSY, f"{self.duty:g}", str(os.getpid())],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            for _ in range(self.cores)]

    def stop(self) -> None:
        procs, self._procs = self._procs, []
        _kill(procs)

    def close(self) -> None:
        self.stop()


class MeshLoad:
    """A second ``mesh serve`` and, while on, a client process that keeps it busy."""

    def __init__(self, config: NeighbourConfig, model: str | None, seed: int,
                 startup_timeout_s: float = 300.0, data_dir: Path | None = None) -> None:
        self.config = config
        self.data_dir = data_dir if data_dir is not None else NEIGHBOUR_DATA_DIR
        self.model = config.model if config.model is not None else model
        self.seed = seed
        self.startup_timeout_s = startup_timeout_s
        self.url = ""
        self._server: ServerProcess | None = None
        self._client: subprocess.Popen[bytes] | None = None

    def command(self, port: int, data_dir: Path) -> list[str]:
        """Its ``mesh serve`` line. The data directory is kept across runs (so its gate's
        seed is measured once per model), not the per-run one ``data_dir`` offers."""
        del data_dir
        cmd = [*mesh_executable(), "serve", "--host", "127.0.0.1", "--port", str(port),
               "--policy", "none", "--data-dir", str(self.data_dir),
               "--max-sessions", str(max(4, 2 * self.config.clients))]
        if self.model is not None:
            cmd += ["--model", self.model]
        if self.config.threads is not None:
            cmd += ["--threads", str(self.config.threads)]
        return cmd

    def setup(self) -> None:
        if self._server is not None:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        server = ServerProcess(SimConfig(startup_timeout_s=self.startup_timeout_s),
                               command=self.command)
        self.url = server.start()
        self._server = server

    def start(self) -> None:
        if not self.url:
            raise RuntimeError("MeshLoad.start before setup; call Neighbour.setup first")
        cmd = [sys.executable, "-m", "mesh.sim.processes", "--url", self.url,
               "--clients", str(self.config.clients), "--max-tokens",
               str(self.config.max_tokens), "--seed", str(self.seed),
               "--parent", str(os.getpid())]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._client = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, env=env)

    def stop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            _kill([client])

    def close(self) -> None:
        self.stop()
        server, self._server = self._server, None
        if server is not None:
            server.stop()


def make_load(config: NeighbourConfig, model: str | None, seed: int,
              startup_timeout_s: float = 300.0) -> Load:
    if config.kind == "cpu":
        return CpuLoad(config.cores, config.duty)
    if config.kind == "mesh":
        return MeshLoad(config, model, seed, startup_timeout_s)
    raise ValueError(f"no load for neighbour {config.kind!r}")


class Neighbour:
    """``with Neighbour(cfg, seed, model) as n:`` — ``n.begin(t0)`` when the run's clock
    starts (``t0`` on ``time.monotonic``), ``n.end()`` when it ends: the "on" spans.

    ``setup`` (the mesh neighbour's server start) happens on entry, before the run, so a
    comparison can keep one neighbour for all of its runs; each run replays the same
    schedule from its own start.
    """

    def __init__(self, config: NeighbourConfig, seed: int, model: str | None = None, *,
                 load: Load | None = None, startup_timeout_s: float = 300.0) -> None:
        config.validate()
        self.config = config
        self.seed = config.seed if config.seed is not None else seed
        self.load = load if load is not None else make_load(config, model, self.seed,
                                                            startup_timeout_s)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._records: list[PhaseRecord] = []
        self._error: BaseException | None = None

    def setup(self) -> None:
        self.load.setup()

    def close(self) -> None:
        self.end()
        self.load.close()

    def __enter__(self) -> Neighbour:
        try:
            self.setup()
        except BaseException:
            self.load.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def begin(self, t0: float) -> None:
        """Follow the schedule from ``t0`` on a thread until :meth:`end`."""
        if self._thread is not None:
            raise RuntimeError("the neighbour is already running; call end() first")
        self._stop.clear()
        self._records = []
        self._error = None
        self._thread = threading.Thread(target=self._follow, args=(t0,),
                                        name="mesh-sim-neighbour", daemon=True)
        self._thread.start()

    def end(self) -> list[PhaseRecord]:
        """Stop following (the load is stopped) and return the "on" spans recorded."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the neighbour failed: {error}") from error
        return list(self._records)

    def _follow(self, t0: float) -> None:
        try:
            for phase in iter_phases(self.config.schedule, self.seed):
                if not phase.on:
                    continue
                if self._stop.wait(max(0.0, t0 + phase.start - time.monotonic())):
                    return
                self.load.start()
                start = time.monotonic() - t0
                try:
                    self._stop.wait(max(0.0, t0 + phase.end - time.monotonic()))
                finally:
                    self.load.stop()
                    self._records.append(
                        PhaseRecord(round(start, 4), round(time.monotonic() - t0, 4)))
                if self._stop.is_set():
                    return
        except BaseException as exc:  # reported by end()
            self._error = exc
