"""A worker's events become the task's status messages: the decode gate's figures ride in
their metadata (a client reads a held turn's place without parsing the text)."""

from __future__ import annotations

from typing import Any

import pytest
from a2a.types import a2a_pb2 as pb

from mesh.a2a.executor import _Run
from mesh.worker.types import EventKind, WorkerEvent


class _Updater:
    """What ``_Run`` asks of the SDK's TaskUpdater: messages built, statuses recorded."""

    def __init__(self) -> None:
        self.statuses: list[tuple[int, pb.Message]] = []

    def new_agent_message(self, parts: list[pb.Part],
                          metadata: dict[str, Any] | None = None) -> pb.Message:
        message = pb.Message(role=pb.Role.ROLE_AGENT, parts=parts)
        if metadata:
            message.metadata.update(metadata)
        return message

    async def update_status(self, state: int, message: pb.Message | None = None,
                            **_: Any) -> None:
        assert message is not None
        self.statuses.append((state, message))


class _Sink:
    def __init__(self) -> None:
        self.flushed = 0

    async def add(self, text: str) -> None:
        raise AssertionError("a status event is not artifact text")

    async def flush(self, now: float | None = None, *, last: bool = False) -> None:
        self.flushed += 1


@pytest.mark.anyio
async def test_a_held_turns_place_reaches_the_status_metadata() -> None:
    updater = _Updater()
    run = _Run(updater)  # type: ignore[arg-type]
    event = WorkerEvent(EventKind.STATUS, "waiting for a decode turn (#3 in line)", turn=2,
                        data={"turn_place": 3, "wait_s": 0.5, "other": "dropped"})
    sink = _Sink()
    await run.worker_event(sink, "p1", event)
    assert sink.flushed == 1  # text streamed so far goes out before the status
    [(state, message)] = updater.statuses
    assert state == pb.TaskState.TASK_STATE_WORKING
    assert message.parts[0].text == "[p1] waiting for a decode turn (#3 in line)"
    meta = dict(message.metadata)
    assert meta["turn_place"] == 3 and meta["wait_s"] == 0.5
    assert (meta["subtask"], meta["event"], meta["turn"]) == ("p1", "status", 2)
    assert "other" not in meta


@pytest.mark.anyio
async def test_a_status_without_gate_figures_carries_none() -> None:
    updater = _Updater()
    await _Run(updater).worker_event(  # type: ignore[arg-type]
        _Sink(), "p2", WorkerEvent(EventKind.STATUS, "reading files"))
    meta = dict(updater.statuses[0][1].metadata)
    assert not {"turn_place", "wait_s", "paused_s"} & meta.keys()
