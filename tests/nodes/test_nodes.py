"""Three real processes: a coordinator (``mesh serve --node A --node B``) and two
``mesh serve --model tiny`` nodes, over A2A on loopback.

Scenario subtasks (``--simulation``: real decoding on the tiny model, scripted tool
latency) make each subtask last long enough that a node can be killed while it runs one.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.nodes.conftest import simulate
from tests.reliability.serve_proc import (
    TERMINAL,
    ServeProc,
    free_port,
    message,
    running,
    serve_argv,
    serve_env,
    small_project,
    text_of,
)


def scenario_task(n: int, steps: int = 2, latency_s: float = 0.3) -> dict[str, Any]:
    msg = message("nodes test")
    msg["parts"].append({"data": {"subtasks": [
        {"instructions": f"deliver {i}",
         "params": {"scenario": True, "steps": steps, "tokens_per_step": 8, "seed": i,
                    "tool_latency_s": {"dist": "fixed", "value": latency_s}}}
        for i in range(n)]}})
    return msg


def send(coord: ServeProc, msg: dict[str, Any]) -> str:
    doc = coord.rpc("SendMessage", {"message": msg, "configuration": {"returnImmediately": True}})
    assert "result" in doc, doc
    task_id: str = doc["result"]["task"]["id"]
    return task_id


def statuses(coord: ServeProc, task_id: str) -> list[str]:
    task = coord.rpc("GetTask", {"id": task_id, "historyLength": 1000})["result"]
    return [text_of(m.get("parts", [])) for m in task.get("history", [])]


@pytest.fixture
def fleet(tmp_path: Path, cache: Path, project: Path,
          request: pytest.FixtureRequest) -> Iterator[tuple[ServeProc, list[ServeProc]]]:
    """Two nodes, then the coordinator over them (node args: the test's ``node_args``)."""
    node_args: tuple[str, ...] = getattr(request, "param", ())
    with ExitStack() as stack:
        nodes = [stack.enter_context(running(tmp_path / f"n{i}" / "data", project, cache,
                                             "--simulation", *node_args))
                 for i in range(2)]
        coord = stack.enter_context(running(
            tmp_path / "coord" / "data", project, cache, "--simulation",
            *(a for n in nodes for a in ("--node", n.url))))
        yield coord, nodes


def test_a_node_with_another_prefix_is_refused_at_start(tmp_path: Path, cache: Path,
                                                        project: Path) -> None:
    other = small_project(tmp_path / "other")
    (other / "NOTES.md").write_text("another project, so another prefix\n")
    with running(tmp_path / "n" / "data", project, cache) as node:
        card = httpx.get(node.url + "/.well-known/agent-card.json", timeout=10).json()
        node_hash = card["capabilities"]["extensions"][0]["params"]["prefix_hash"]
        argv = serve_argv(tmp_path / "c" / "data", other, free_port(), "--node", node.url)
        done = subprocess.run(argv, env=serve_env(cache), capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"node {node.url} serves prefix {node_hash[:16]}, this coordinator " in done.stderr
    assert "same --model, --template, --project and --prefix-tokens" in done.stderr


def test_subtasks_are_routed_over_both_nodes(
        fleet: tuple[ServeProc, list[ServeProc]], tmp_path: Path, cache: Path) -> None:
    coord, nodes = fleet
    card = httpx.get(coord.url + "/.well-known/agent-card.json", timeout=10).json()
    params = card["capabilities"]["extensions"][0]["params"]
    assert params["engine"] == "nodes:2"
    node_card = httpx.get(nodes[0].url + "/.well-known/agent-card.json", timeout=10).json()
    assert params["prefix_hash"] == node_card["capabilities"]["extensions"][0]["params"][
        "prefix_hash"]
    ids = [send(coord, scenario_task(4)) for _ in range(2)]
    for task_id in ids:
        task = coord.wait_terminal(task_id, timeout=180)
        assert task["status"]["state"] == "TASK_STATE_COMPLETED", task["status"]
        answer = next(a for a in task["artifacts"] if a["name"] == "answer")
        assert all(f"[s{i + 1}]" in text_of(answer["parts"]) for i in range(4))
    assert any("routed to node http://127.0.0.1:" in s for s in statuses(coord, ids[0]))
    cap = httpx.get(coord.url + "/capacity", timeout=10).json()
    assert cap["total"]["routed"] == 8 and cap["admitted_total"] == 8
    assert {n["url"] for n in cap["nodes"]} == {n.url for n in nodes}
    assert all(n["routed"] > 0 for n in cap["nodes"]), cap["nodes"]
    assert all(n["up"] and n["verdict"] in ("admit", "wait") for n in cap["nodes"])
    # Each node ran what the coordinator says it routed there.
    for row in cap["nodes"]:
        node_cap = httpx.get(row["url"] + "/capacity", timeout=10).json()
        assert node_cap["admitted_total"] == row["routed"]
    # The dashboard's feed carries every node's own /capacity.
    with httpx.stream("GET", coord.url + "/dashboard/events", timeout=10) as r:
        line = next(x for x in r.iter_lines() if x.startswith("data: "))
    frame = json.loads(line.removeprefix("data: "))
    assert [n["url"] for n in frame["nodes"]] == [n.url for n in nodes]
    assert all(n["capacity"]["engine"]["name"] == "llama.cpp" for n in frame["nodes"])
    assert frame["capacity"]["total"]["routed"] == 8
    # The simulation harness drives the node coordinator like any coordinator.
    assert simulate(coord.url, tmp_path / "sim", cache) == 0


@pytest.mark.parametrize("fleet", [("--policy", "static:2")], indirect=True)
def test_kill_9_of_a_node_mid_run_loses_no_task(
        fleet: tuple[ServeProc, list[ServeProc]]) -> None:
    """Two slots per node, 12 subtasks: the coordinator queues, both nodes run; one node
    is SIGKILLed with subtasks on it; each is retried once on the other node and every
    task completes."""
    coord, nodes = fleet
    ids = [send(coord, scenario_task(3, steps=3, latency_s=0.4)) for _ in range(4)]
    deadline = time.monotonic() + 60
    while True:
        cap = httpx.get(coord.url + "/capacity", timeout=10).json()
        if all(n["in_flight"] > 0 for n in cap["nodes"]):
            break
        assert time.monotonic() < deadline, cap
        time.sleep(0.05)
    assert cap["queue_len"] > 0, "the coordinator should be queueing, not pushing"
    victim = nodes[0]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(timeout=10)
    states = {}
    for task_id in ids:
        task = coord.wait_terminal(task_id, timeout=240)
        states[task_id] = task["status"]["state"]
    assert set(states.values()) <= TERMINAL
    assert set(states.values()) == {"TASK_STATE_COMPLETED"}, states
    cap = httpx.get(coord.url + "/capacity", timeout=10).json()
    assert cap["retried_total"] >= 1
    row = next(n for n in cap["nodes"] if n["url"] == victim.url)
    assert row["up"] is False and row["error"]
    seen = [s for t in ids for s in statuses(coord, t)]
    assert any(f"node {victim.url} failed" in s and "retrying once" in s for s in seen), seen
    assert any(f"retrying on node {nodes[1].url}" in s for s in seen)


def test_a_node_starts_from_the_snapshot_another_wrote(tmp_path: Path, cache: Path,
                                                       project: Path) -> None:
    """``--prefix-cache DIR`` shared: the second node (its own data dir) restores the
    first node's prefix snapshot instead of decoding it; another context shape does not."""
    shared = tmp_path / "shared-prefix-cache"
    with running(tmp_path / "a" / "data", project, cache, "--prefix-cache", str(shared)) as a:
        a_log = a.stderr()
    assert "decoded in" in a_log and "warm-started" not in a_log
    assert list(shared.glob("prefix-*.kv")), "the first node wrote no snapshot"
    with running(tmp_path / "b" / "data", project, cache, "--prefix-cache", str(shared)) as b:
        assert "warm-started from cache" in b.stderr(), b.stderr()[-2000:]
        msg = message("context")
        msg["parts"].append({"data": {"subtasks": [{"instructions": "list the files"}]}})
        task = b.wait_terminal(send(b, msg), timeout=120)
        assert task["status"]["state"] == "TASK_STATE_COMPLETED", task["status"]
    assert not (tmp_path / "b" / "data" / "prefix-cache").exists()
    with running(tmp_path / "c" / "data", project, cache, "--prefix-cache", str(shared),
                 "--max-sessions", "4") as c:
        assert "warm-started" not in c.stderr()  # another KV shape: its own snapshot
