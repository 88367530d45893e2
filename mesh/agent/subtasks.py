"""How a message becomes subtasks.

A message carries either plain text (one subtask) or a data part listing subtasks::

    {"subtasks": [{"instructions": "...", "params": {...}, "id": "optional"}, ...]}

Text parts next to a subtask list are shared context: each subtask gets it as
``params["context"]``. The same shape check runs on raw JSON (before the SDK parses the
body, :mod:`mesh.a2a.validation`) and on the parsed message (the executor), so a
client's mistake is reported as invalid params, never discovered half-way through a task.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from a2a.types import a2a_pb2 as pb
from google.protobuf.json_format import MessageToDict

from mesh.worker.types import Subtask

__all__ = ["SubtaskSpec", "check_subtask_list", "message_text", "subtasks_from_message"]

_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class SubtaskSpec:
    """One entry of a ``subtasks`` list, checked."""

    id: str
    instructions: str
    params: Mapping[str, Any]


def check_subtask_list(value: Any, max_subtasks: int, where: str = "subtasks") -> list[SubtaskSpec]:
    """Check a ``subtasks`` value; raise ``ValueError`` naming the bad entry and the fix."""
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list of objects, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{where} is empty; list at least one {{'instructions': ...}}")
    if len(value) > max_subtasks:
        raise ValueError(f"{where} has {len(value)} entries; at most {max_subtasks} are allowed")
    specs: list[SubtaskSpec] = []
    seen: set[str] = set()
    for i, entry in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{at} must be an object, got {type(entry).__name__}")
        instructions = entry.get("instructions")
        if not isinstance(instructions, str) or not instructions.strip():
            raise ValueError(f"{at}.instructions must be a non-empty string")
        params = entry.get("params", {})
        if not isinstance(params, dict):
            raise ValueError(f"{at}.params must be an object, got {type(params).__name__}")
        sid = entry.get("id", f"s{i + 1}")
        if not isinstance(sid, str) or not _ID.match(sid):
            raise ValueError(f"{at}.id must match [A-Za-z0-9_.-]{{1,64}}")
        if sid in seen:
            raise ValueError(f"{at}.id {sid!r} is used twice; subtask ids must be unique")
        seen.add(sid)
        unknown = sorted(set(entry) - {"instructions", "params", "id"})
        if unknown:
            raise ValueError(f"{at} has unknown keys {unknown}; allowed: id, instructions, params")
        specs.append(SubtaskSpec(id=sid, instructions=instructions, params=params))
    return specs


def _part_data(part: pb.Part) -> Any:
    return MessageToDict(part.data) if part.HasField("data") else None


def subtasks_from_message(message: pb.Message, task_id: str, max_subtasks: int) -> list[Subtask]:
    """The subtasks a message asks for. Raises ``ValueError`` if it asks for none."""
    texts: list[str] = []
    specs: list[SubtaskSpec] | None = None
    extra: list[Any] = []
    for i, part in enumerate(message.parts):
        if part.HasField("text"):
            if part.text.strip():
                texts.append(part.text)
        elif part.HasField("data"):
            data = _part_data(part)
            if isinstance(data, dict) and "subtasks" in data:
                if specs is not None:
                    raise ValueError("only one data part may list subtasks")
                specs = check_subtask_list(data["subtasks"], max_subtasks, f"parts[{i}].subtasks")
            else:
                extra.append(data)
    text = "\n".join(texts)
    if specs is None:
        if extra:
            text = "\n".join([text, *(json.dumps(d, sort_keys=True) for d in extra)]).strip()
        if not text:
            raise ValueError("the message has no text and no subtasks; send a text part")
        return [Subtask(id=f"{task_id}/s1", instructions=text)]
    subtasks: list[Subtask] = []
    for spec in specs:
        params = dict(spec.params)
        if text:
            params.setdefault("context", text)
        subtasks.append(
            Subtask(id=f"{task_id}/{spec.id}", instructions=spec.instructions, params=params)
        )
    return subtasks


def message_text(message: pb.Message) -> str | None:
    """The text a planner reads for ``message`` (text parts, then other data parts as
    JSON); None when the message lists explicit subtasks or carries nothing."""
    texts: list[str] = []
    for part in message.parts:
        if part.HasField("text"):
            if part.text.strip():
                texts.append(part.text)
        elif part.HasField("data"):
            data = _part_data(part)
            if isinstance(data, dict) and "subtasks" in data:
                return None
            texts.append(json.dumps(data, sort_keys=True))
    text = "\n".join(texts).strip()
    return text or None


def local_id(subtask: Subtask) -> str:
    """The id a client used for the subtask (the part after the task id)."""
    return subtask.id.rsplit("/", 1)[-1]


def join_answers(answers: Sequence[tuple[str, str]]) -> str:
    """One text for several subtask answers, each under its id."""
    if len(answers) == 1:
        return answers[0][1]
    return "\n\n".join(f"[{sid}]\n{answer}" for sid, answer in answers)
