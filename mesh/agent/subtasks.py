"""The shape of an explicit subtask list, and subtask ids.

A message carries either plain text (planned, or one subtask) or a data part listing
subtasks::

    {"subtasks": [{"instructions": "...", "params": {...}, "id": "optional"}, ...]}

Text parts next to a subtask list are shared context: each subtask gets it as
``params["context"]`` (:func:`mesh.agent.plans.explicit_plan`). :func:`check_subtask_list`
runs once, on the raw JSON at the door (:mod:`mesh.a2a.validation`), so a client's mistake
is reported as invalid params, never discovered half-way through a task; what it returns
travels with the request to the task.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mesh.worker.types import Subtask

__all__ = ["SubtaskSpec", "check_subtask_list", "local_id"]

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


def local_id(subtask: Subtask) -> str:
    """The id a client used for the subtask (the part after the task id)."""
    return subtask.id.rsplit("/", 1)[-1]
