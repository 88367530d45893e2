"""The neighbour: a second tenant that comes and goes on the same machine during a run.

A :class:`Neighbour` follows its seeded schedule (:mod:`mesh.sim.schedule`) on a thread of
the harness: at each "on" phase it starts its load, at each "off" phase it stops it, and it
records when it actually did (:class:`~mesh.sim.types.PhaseRecord`, on the run's clock).
Two loads:

* :class:`CpuLoad` — ``cores`` processes, each a busy loop that burns one core for
  ``duty`` of every 100 ms (``duty = 1``: all of it); started at "on", killed at "off";
* :class:`MeshLoad` — a second ``mesh serve`` (policy ``none``, its own port and data
  directory), started once before the run and idle while "off"; at "on" a client process
  (:mod:`mesh.sim.neighbour_load`) streams chat requests at it from ``clients`` loops,
  and at "off" that client is killed (a turn in flight may run on for at most
  ``max_tokens``, so the default is small).

The load runs in child processes, never on the harness's event loop, so the client-side
timestamps of the run under test are not perturbed by the neighbour's own client.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Protocol

from mesh.sim.schedule import iter_phases
from mesh.sim.server import ServerProcess, mesh_executable
from mesh.sim.types import NeighbourConfig, PhaseRecord, SimConfig

__all__ = ["CpuLoad", "Load", "MeshLoad", "Neighbour", "make_load"]

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
            for _ in range(self.cores)
        ]

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
        cmd = [sys.executable, "-m", "mesh.sim.neighbour_load", "--url", self.url,
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

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
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
