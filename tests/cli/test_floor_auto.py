"""``mesh serve --floor-tps auto``: the decode gate finds the knee; /capacity says so."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.reliability.serve_proc import running, serve_argv, serve_env, small_project


def test_floor_auto_serves_and_capacity_shows_the_floor_it_holds(tmp_path: Path) -> None:
    project = small_project(tmp_path / "project")
    with running(tmp_path / "data", project, tmp_path / "cache", "--floor-tps", "auto",
                 "--plan", "never") as srv:
        cap = httpx.get(srv.url + "/capacity", timeout=10).json()
        assert cap["floor_mode"] == "auto"
        assert "floor auto" in srv.stderr()
        task = srv.send("What does add return?")
        assert task["status"]["state"] == "TASK_STATE_COMPLETED", task["status"]
        deadline = time.monotonic() + 10
        while True:  # the decode gate answered at least once and says why in words
            cap = httpx.get(srv.url + "/capacity", timeout=10).json()
            if cap["turns"]["why"]:
                break
            assert time.monotonic() < deadline, cap["turns"]
            time.sleep(0.1)
        assert "auto" in cap["turns"]["why"] and cap["floor_tps"] > 0


def test_floor_auto_with_another_policy_is_refused_in_one_line(tmp_path: Path) -> None:
    argv = serve_argv(tmp_path / "data", small_project(tmp_path / "p"), 8799,
                      "--floor-tps", "auto", "--policy", "legacy")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                          env=serve_env(tmp_path / "cache"))
    assert done.returncode != 0
    assert "--floor-tps auto needs --policy floor" in done.stderr
    bad = subprocess.run([sys.executable, "-m", "mesh", "serve", "--floor-tps", "fast"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "'auto'" in bad.stderr
