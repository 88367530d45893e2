"""The write-behind task store: what is durable when, coalescing, owner scoping, SDK rows."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
from a2a.server.tasks import DatabaseTaskStore
from a2a.types import a2a_pb2 as pb

from mesh.a2a.store import (
    RowWrite,
    Stores,
    TaskStoreWriteError,
    TaskTable,
    WriteBehindTaskStore,
    open_stores,
    owner_context,
    owner_of,
)
from tests.support.coord_helpers import await_for

pytestmark = pytest.mark.anyio

S = pb.TaskState
ALICE = owner_context("alice")
BOB = owner_context("bob")
# Long enough that an intermediate state is never written by the clock during a test:
# only an urgent save, a flush or close writes it.
NEVER_S = 3600.0


@pytest.fixture
async def stores(tmp_path: Path) -> AsyncIterator[Stores]:
    opened = open_stores(tmp_path / "data", coalesce_s=NEVER_S)
    await opened.initialize()
    try:
        yield opened
    finally:
        await opened.aclose()


def make_task(task_id: str, state: pb.TaskState, *texts: str) -> pb.Task:
    task = pb.Task(id=task_id, context_id="ctx", status=pb.TaskStatus(state=state))
    task.status.timestamp.GetCurrentTime()
    for i, text in enumerate(texts):
        task.artifacts.append(pb.Artifact(artifact_id=f"a{i}", parts=[pb.Part(text=text)]))
    return task


def on_disk(db_path: Path, task_id: str) -> tuple[str, int] | None:
    """(state, number of artifacts) of the committed row, read behind the store's back."""
    with sqlite3.connect(db_path) as conn:
        row = conn.execute(
            "SELECT json_extract(status, '$.state'), json_array_length(artifacts) "
            "FROM tasks WHERE id = ?",
            (task_id,),
        ).fetchone()
    return None if row is None else (row[0], row[1])


async def test_first_and_terminal_states_are_committed_before_save_returns(
    stores: Stores,
) -> None:
    await stores.tasks.save(make_task("t1", S.TASK_STATE_SUBMITTED), ALICE)
    assert on_disk(stores.db_path, "t1") == ("TASK_STATE_SUBMITTED", 0)

    await stores.tasks.save(make_task("t1", S.TASK_STATE_WORKING, "x"), ALICE)
    assert on_disk(stores.db_path, "t1") == ("TASK_STATE_SUBMITTED", 0)  # coalescing

    await stores.tasks.save(make_task("t1", S.TASK_STATE_COMPLETED, "x", "answer"), ALICE)
    assert on_disk(stores.db_path, "t1") == ("TASK_STATE_COMPLETED", 2)


@pytest.mark.parametrize(
    "state", [S.TASK_STATE_FAILED, S.TASK_STATE_CANCELED, S.TASK_STATE_REJECTED,
              S.TASK_STATE_INPUT_REQUIRED, S.TASK_STATE_AUTH_REQUIRED],
    ids=pb.TaskState.Name,
)
async def test_every_settled_state_is_committed_before_save_returns(
    stores: Stores, state: pb.TaskState
) -> None:
    await stores.tasks.save(make_task("t1", S.TASK_STATE_WORKING), ALICE)
    await stores.tasks.save(make_task("t1", state, "partial"), ALICE)
    assert on_disk(stores.db_path, "t1") == (pb.TaskState.Name(state), 1)


async def test_reads_see_the_last_save_while_it_is_pending(stores: Stores) -> None:
    await stores.tasks.save(make_task("t1", S.TASK_STATE_SUBMITTED), ALICE)
    for n in range(1, 6):
        await stores.tasks.save(make_task("t1", S.TASK_STATE_WORKING, *["x"] * n), ALICE)
    got = await stores.tasks.get("t1", ALICE)
    assert got is not None and len(got.artifacts) == 5
    got.artifacts.clear()  # the caller's copy: the stored state is not changed
    again = await stores.tasks.get("t1", ALICE)
    assert again is not None and len(again.artifacts) == 5
    listed = await stores.tasks.list(pb.ListTasksRequest(include_artifacts=True), ALICE)
    assert [len(t.artifacts) for t in listed.tasks] == [5]
    assert on_disk(stores.db_path, "t1") == ("TASK_STATE_WORKING", 5)  # list flushed


async def test_close_commits_the_last_coalesced_state(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = open_stores(data, coalesce_s=NEVER_S)
    await first.initialize()
    for n in range(20):
        task = make_task(f"t{n % 3}", S.TASK_STATE_WORKING, *[f"piece {n}"] * (n + 1))
        await first.tasks.save(task, ALICE)
    await first.aclose()

    second = open_stores(data)
    try:
        last = {task_id: await second.tasks.get(task_id, ALICE) for task_id in ("t0", "t1", "t2")}
    finally:
        await second.aclose()
    assert {k: len(t.artifacts) for k, t in last.items() if t is not None} == {
        "t0": 19, "t1": 20, "t2": 18
    }
    assert last["t1"] is not None and last["t1"].artifacts[0].parts[0].text == "piece 19"


async def test_an_intermediate_state_is_written_once_it_is_due(tmp_path: Path) -> None:
    opened = open_stores(tmp_path / "data", coalesce_s=0.0)
    await opened.initialize()
    try:
        await opened.tasks.save(make_task("t1", S.TASK_STATE_SUBMITTED), ALICE)
        await opened.tasks.save(make_task("t1", S.TASK_STATE_WORKING, "x"), ALICE)
        # No flush, no urgent save: the flusher writes it on its own once it is due.
        await await_for(
            lambda: on_disk(opened.db_path, "t1") == ("TASK_STATE_WORKING", 1),
            what="the working state to be committed",
        )
    finally:
        await opened.aclose()


async def test_callers_never_see_each_others_tasks(stores: Stores) -> None:
    await stores.tasks.save(make_task("a1", S.TASK_STATE_WORKING, "mine"), ALICE)
    await stores.tasks.save(make_task("a2", S.TASK_STATE_COMPLETED), ALICE)
    await stores.tasks.save(make_task("b1", S.TASK_STATE_WORKING), BOB)
    await stores.tasks.save(make_task("b1", S.TASK_STATE_WORKING, "pending"), BOB)

    assert await stores.tasks.get("b1", ALICE) is None
    assert await stores.tasks.get("a1", BOB) is None
    alice = await stores.tasks.list(pb.ListTasksRequest(), ALICE)
    bob = await stores.tasks.list(pb.ListTasksRequest(include_artifacts=True), BOB)
    anonymous = await stores.tasks.list(pb.ListTasksRequest(), owner_context(""))
    assert sorted(t.id for t in alice.tasks) == ["a1", "a2"] and alice.total_size == 2
    assert [t.id for t in bob.tasks] == ["b1"] and len(bob.tasks[0].artifacts) == 1
    assert list(anonymous.tasks) == []

    await stores.tasks.delete("a1", BOB)  # not Bob's: nothing happens
    assert await stores.tasks.get("a1", ALICE) is not None
    await stores.tasks.delete("a1", ALICE)
    assert await stores.tasks.get("a1", ALICE) is None
    assert on_disk(stores.db_path, "a1") is None


async def test_cold_reads_come_from_the_file_and_keep_owners_apart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = open_stores(data)
    await first.initialize()
    await first.tasks.save(make_task("t1", S.TASK_STATE_COMPLETED, "kept"), ALICE)
    await first.aclose()

    second = open_stores(data)
    try:
        assert await second.tasks.get("t1", BOB) is None
        got = await second.tasks.get("t1", ALICE)
        assert await second.tasks.get("missing", ALICE) is None
    finally:
        await second.aclose()
    assert got is not None and got.status.state == S.TASK_STATE_COMPLETED
    assert got.artifacts[0].parts[0].text == "kept"


async def test_rows_are_the_sdk_stores_rows_both_ways(stores: Stores) -> None:
    sdk = DatabaseTaskStore(stores.engine, owner_resolver=owner_of)
    ours = make_task("ours", S.TASK_STATE_COMPLETED, "é", "two")
    ours.metadata.update({"k": "v"})
    ours.history.append(pb.Message(message_id="m1", role=pb.Role.ROLE_USER,
                                   parts=[pb.Part(text="hi")]))
    await stores.tasks.save(ours, ALICE)
    theirs = make_task("theirs", S.TASK_STATE_FAILED, "legacy writer")
    await sdk.save(theirs, ALICE)

    assert await sdk.get("ours", ALICE) == ours
    reopened = open_stores(stores.db_path.parent)
    try:
        assert await reopened.tasks.get("theirs", ALICE) == theirs
        listed = await reopened.tasks.list(pb.ListTasksRequest(), ALICE)
    finally:
        await reopened.aclose()
    # Newest status first, across rows written by either store.
    assert [t.id for t in listed.tasks] == ["theirs", "ours"]


class _FailingOnce(TaskTable):
    """Fails its first commit, like a full disk that then recovers."""

    num_failures_left = 1

    async def write(self, writes: Sequence[RowWrite]) -> None:
        if self.num_failures_left:
            self.num_failures_left -= 1
            raise sqlite3.OperationalError("disk I/O error")
        await super().write(writes)


async def test_a_failed_commit_fails_the_waiting_save_and_is_retried(
    stores: Stores, caplog: pytest.LogCaptureFixture
) -> None:
    store = WriteBehindTaskStore(
        stores.engine, _FailingOnce(stores.db_path), owner_resolver=owner_of
    )
    try:
        with pytest.raises(TaskStoreWriteError):
            await store.save(make_task("t1", S.TASK_STATE_COMPLETED, "answer"), ALICE)
        assert on_disk(stores.db_path, "t1") is None
        await store.flush()
        assert on_disk(stores.db_path, "t1") == ("TASK_STATE_COMPLETED", 1)
    finally:
        await store.aclose()
    assert "committing 1 task write(s) failed" in caplog.text


async def test_push_dispatch_finds_configs_set_before_and_after_a_restart(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    config = pb.TaskPushNotificationConfig(id="c1", url="https://example.test/hook")
    first = open_stores(data)
    await first.initialize()
    await first.push_configs.set_info("old", config, ALICE)
    await first.aclose()

    second = open_stores(data)
    await second.initialize()
    try:
        assert [c.url for c in await second.push_configs.get_info_for_dispatch("old")] == [
            "https://example.test/hook"
        ]
        assert await second.push_configs.get_info_for_dispatch("new") == []
        await second.push_configs.set_info("new", config, BOB)
        assert len(await second.push_configs.get_info_for_dispatch("new")) == 1
        await second.push_configs.delete_info("new", BOB)
        assert await second.push_configs.get_info_for_dispatch("new") == []
    finally:
        await second.aclose()
