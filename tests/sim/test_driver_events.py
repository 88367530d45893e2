"""How the driver reads a streamed status event's metadata (no server)."""

from __future__ import annotations

from a2a.types import a2a_pb2 as pb
from google.protobuf.struct_pb2 import Struct

from mesh.sim.run import _status_event


def _update(meta: dict[str, object]) -> pb.TaskStatusUpdateEvent:
    update = pb.TaskStatusUpdateEvent(task_id="t")
    update.status.state = pb.TaskState.TASK_STATE_WORKING
    struct = Struct()
    struct.update(meta)
    update.metadata.CopyFrom(struct)
    return update


def test_a_turn_event_carrying_the_gate_wait_is_read() -> None:
    ev = _status_event(1.5, _update({"event": "tool_call", "turn": 2, "subtask": "p0",
                                     "wait_s": 0.25}))
    assert (ev.kind, ev.turn, ev.subtask, ev.wait_s) == ("tool_call", 2, "p0", 0.25)


def test_without_it_the_wait_is_unknown() -> None:
    ev = _status_event(1.5, _update({"event": "turn_started", "turn": 1}))
    assert (ev.kind, ev.wait_s) == ("turn_started", None)
