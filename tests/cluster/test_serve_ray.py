"""``mesh serve --ray ADDRESS`` on the two-node local cluster: tasks over A2A run on two
pool actors; one pool's process is killed mid-run and every task still ends (its sessions
resume on the other pool), nothing is left "working", and the coordinator stays up."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, cast

import httpx
import ray
from ray.cluster_utils import Cluster

from tests.reliability.serve_proc import (
    ServeProc,
    free_port,
    message,
    running,
    serve_argv,
    serve_env,
    small_project,
)


def scenario_task(n: int, seed: int) -> dict[str, Any]:
    """``n`` subtasks of real decoding (tiny model) with scripted tool latency."""
    msg = message("cluster test")
    msg["parts"].append({"data": {"subtasks": [
        {"instructions": f"deliver {seed}-{i}",
         "params": {"scenario": True, "steps": 4, "tokens_per_step": 8, "seed": seed * 10 + i,
                    "tool_latency_s": {"dist": "fixed", "value": 0.3}}}
        for i in range(n)]}})
    return msg


def send(coord: ServeProc, msg: dict[str, Any]) -> str:
    doc = coord.rpc("SendMessage", {"message": msg, "configuration": {"returnImmediately": True}})
    assert "result" in doc, doc
    task_id: str = doc["result"]["task"]["id"]
    return task_id


def pool_pids() -> dict[str, int]:
    """The pool actors' processes, by actor name (this test is a driver of the cluster)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("mesh-pool-")]
    refs: dict[str, Any] = {n: ray.get_actor(n, namespace="mesh").pid.remote()
                            for n in sorted(names)}
    return {n: cast(int, ray.get(ref, timeout=30)) for n, ref in refs.items()}


def pool_rows(coord: ServeProc) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = httpx.get(coord.url + "/capacity", timeout=10).json()[
        "engine"]["backend"]["pools"]
    return rows


def test_a_pool_killed_mid_run_loses_no_task(ray_cluster: Cluster, tmp_path: Path) -> None:
    project = small_project(tmp_path / "project")
    cache = tmp_path / "cache"
    with running(tmp_path / "data", project, cache, "--simulation", "--policy", "none",
                 "--ray", ray_cluster.address, "--ray-pools", "2",
                 "--max-sessions", "4") as coord:
        assert "Ray 2." in coord.stderr() and "engine: ray:2" in coord.stderr()
        pids = pool_pids()
        assert len(pids) == 2
        tasks = [send(coord, scenario_task(2, seed)) for seed in range(4)]
        deadline = time.monotonic() + 60
        rows = pool_rows(coord)
        while not all(p["sessions"] for p in rows):  # subtasks on both pools
            assert time.monotonic() < deadline, coord.stderr()
            time.sleep(0.05)
            rows = pool_rows(coord)
        victim = max(rows, key=lambda p: p["sessions"])["name"]  # p0 is the actor ...-0
        os.kill(next(pid for n, pid in pids.items() if n.endswith("-" + victim[1:])),
                signal.SIGKILL)
        states = [coord.wait_terminal(t, timeout=180)["status"] for t in tasks]
        assert [s["state"] for s in states] == ["TASK_STATE_COMPLETED"] * 4, states
        backend = httpx.get(coord.url + "/capacity", timeout=10).json()["engine"]["backend"]
        assert sorted(p["alive"] for p in backend["pools"]) == [False, True]
        assert backend["sessionsMoved"] >= 1 and backend["sessionsLost"] == 0, (
            backend, coord.stderr()[-5000:])
        assert "died" in coord.stderr() and "moved from dead pool" in coord.stderr()
        # the coordinator is up, and a new task runs on the pool left
        after = send(coord, scenario_task(1, 9))
        assert coord.wait_terminal(after, timeout=120)["status"]["state"] == (
            "TASK_STATE_COMPLETED")
        assert coord.stop() == 0, coord.stderr()[-3000:]  # one SIGTERM: a clean shutdown
        assert "Application shutdown complete" in coord.stderr()
    assert not [n for n in pool_pids()], "the coordinator's pools outlived it"


def test_an_unreachable_ray_address_fails_in_one_line(tmp_path: Path) -> None:
    argv = serve_argv(tmp_path / "data", small_project(tmp_path / "p"), free_port(),
                      "--ray", f"127.0.0.1:{free_port()}")
    done = subprocess.run(argv, env=serve_env(tmp_path / "cache"), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("mesh serve: --ray 127.0.0.1:") and "no Ray cluster answers" in last
