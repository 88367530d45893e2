"""Starting the coordinator subprocess: its command line and its failure modes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mesh.sim.processes import ServerError, ServerProcess, serve_command
from mesh.sim.scenario import SimConfig


def test_serve_command_passes_every_setting(tmp_path: Path) -> None:
    config = SimConfig(
        template="heavy",
        floor_tps=6.0,
        policy="static:3",
        pool="naive",
        model="tiny",
        serve_args=("--threads", "1"),
    )
    cmd = serve_command(config, 8123, tmp_path)
    joined = " ".join(cmd)
    assert cmd[cmd.index("serve") + 1 :][:4] == ["--host", "127.0.0.1", "--port", "8123"]
    for flag in (
        "--template heavy",
        "--policy static:3",
        "--pool naive",
        "--floor-tps 6",
        "--model tiny",
        f"--data-dir {tmp_path}",
        "--threads 1",
    ):
        assert flag in joined


def test_the_server_default_floor_is_left_alone(tmp_path: Path) -> None:
    assert "--floor-tps" not in serve_command(SimConfig(), 1, tmp_path)


def test_a_server_that_exits_reports_its_stderr() -> None:
    def command(port: int, data_dir: Path) -> list[str]:
        return [sys.executable, "-c", "import sys; sys.stderr.write('no such model'); sys.exit(3)"]

    with (
        pytest.raises(ServerError, match=r"(?s)status 3.*no such model"),
        ServerProcess(SimConfig(), command=command),
    ):
        pass


def test_a_silent_server_times_out_and_is_stopped() -> None:
    def command(port: int, data_dir: Path) -> list[str]:
        return [
            sys.executable,
            "-c",
            "import sys, time; print('warming', file=sys.stderr, flush=True); time.sleep(60)",
        ]

    server = ServerProcess(SimConfig(startup_timeout_s=0.5), command=command, grace_s=5.0)
    with pytest.raises(ServerError, match=r"(?s)did not answer.*warming"):
        server.start()
    assert server.stop() is None  # already stopped by the failed start
