"""A process killed with SIGKILL keeps every task that reached a terminal state."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from a2a.types import a2a_pb2 as pb

from mesh.a2a.store import INTERRUPTED_REASON, open_stores, owner_context

pytestmark = pytest.mark.anyio

S = pb.TaskState
NUM_TASKS = 40

# The child saves NUM_TASKS tasks concurrently (submitted, three working states with an
# artifact each, completed), starts one more that stays working (its working state is
# still pending in memory), says "ready" and waits to be killed.
_CHILD = """
import asyncio, sys
from a2a.types import a2a_pb2 as pb
from mesh.a2a.store import open_stores, owner_context

S = pb.TaskState

async def life(stores, task_id, final):
    ctx = owner_context("alice")
    status = pb.TaskStatus(state=S.TASK_STATE_SUBMITTED)
    task = pb.Task(id=task_id, context_id="c", status=status)
    await stores.tasks.save(task, ctx)
    for j in range(3):
        task.status.state = S.TASK_STATE_WORKING
        part = pb.Part(text=f"{task_id}/{j}")
        task.artifacts.append(pb.Artifact(artifact_id=f"a{j}", parts=[part]))
        await stores.tasks.save(task, ctx)
        await asyncio.sleep(0)
    if final:
        task.status.state = S.TASK_STATE_COMPLETED
        await stores.tasks.save(task, ctx)

async def main(data, num_tasks):
    stores = open_stores(data, coalesce_s=3600)
    await stores.initialize()
    await asyncio.gather(*(life(stores, f"done-{i}", True) for i in range(num_tasks)))
    await life(stores, "running", False)
    print("ready", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


async def test_terminal_tasks_survive_sigkill_and_running_ones_are_failed(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(data), str(NUM_TASKS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # EOF (b"") if the child died first
    finally:
        child.kill()  # SIGKILL: no shutdown code runs
        _, stderr = child.communicate()
    assert line == b"ready\n", stderr.decode()

    stores = open_stores(data)
    try:
        alice = owner_context("alice")
        done = [await stores.tasks.get(f"done-{i}", alice) for i in range(NUM_TASKS)]
        assert await stores.mark_interrupted() == ["running"]
        running = await stores.tasks.get("running", alice)
    finally:
        await stores.aclose()
    for i, task in enumerate(done):
        assert task is not None
        assert task.status.state == S.TASK_STATE_COMPLETED
        assert [a.parts[0].text for a in task.artifacts] == [f"done-{i}/{j}" for j in range(3)]
    # Its first state was committed before the child could report it; its later working
    # states were still pending, so the sweep fails the task as first written.
    assert running is not None and running.status.state == S.TASK_STATE_FAILED
    assert running.status.message.parts[0].text == INTERRUPTED_REASON
