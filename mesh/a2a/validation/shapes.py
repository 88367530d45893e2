"""The shapes of A2A 1.0 request params (JSON-RPC params and HTTP+JSON bodies alike).

:class:`Shapes` checks a message (role, parts, media types, sizes, delegation hops,
subtask lists and their scenario params) and every other method's params, raising
:class:`~mesh.a2a.validation.fields.Invalid` that names the field. A2A 0.3 method
names get a lighter check (the SDK's compatibility adapter serves them).
"""

from __future__ import annotations

from typing import Any

from mesh.a2a.config import CoordinatorConfig
from mesh.a2a.validation.checked import CheckedMessage
from mesh.a2a.validation.fields import (
    Invalid,
    boolean,
    field,
    integer,
    obj,
    str_list,
    string,
    type_name,
)
from mesh.agent.subtasks import SubtaskSpec, check_subtask_list
from mesh.fleet.hops import HOPS_KEY, hops_of
from mesh.worker.simulated import check_scenario_bounds
from mesh.worker.types import Hops

__all__ = ["ACCEPTED_MEDIA_TYPES", "JSONRPC_METHODS", "SEND_METHODS", "Shapes",
           "accepted_media"]

# 1.0 names -> params check; 0.3 names are accepted with a lighter check.
SEND_METHODS = ("SendMessage", "SendStreamingMessage", "message/send", "message/stream")
JSONRPC_METHODS: frozenset[str] = frozenset(
    {
        "SendMessage",
        "SendStreamingMessage",
        "GetTask",
        "ListTasks",
        "CancelTask",
        "SubscribeToTask",
        "CreateTaskPushNotificationConfig",
        "GetTaskPushNotificationConfig",
        "ListTaskPushNotificationConfigs",
        "DeleteTaskPushNotificationConfig",
        "GetExtendedAgentCard",
        # A2A 0.3 names (served by the SDK's compatibility adapter).
        "message/send",
        "message/stream",
        "tasks/get",
        "tasks/list",
        "tasks/cancel",
        "tasks/resubscribe",
        "tasks/pushNotificationConfig/set",
        "tasks/pushNotificationConfig/get",
        "tasks/pushNotificationConfig/list",
        "tasks/pushNotificationConfig/delete",
        "agent/getAuthenticatedExtendedCard",
    }
)
_ROLES = frozenset({"ROLE_USER", "ROLE_AGENT"})
_TASK_STATES = frozenset(
    {
        "TASK_STATE_SUBMITTED",
        "TASK_STATE_WORKING",
        "TASK_STATE_INPUT_REQUIRED",
        "TASK_STATE_COMPLETED",
        "TASK_STATE_CANCELED",
        "TASK_STATE_FAILED",
        "TASK_STATE_REJECTED",
        "TASK_STATE_AUTH_REQUIRED",
    }
)
_PART_KINDS = ("text", "raw", "url", "data")
#: The media types a message part may declare (the card's default input modes).
ACCEPTED_MEDIA_TYPES = ("text/plain", "application/json")


def accepted_media(kind: str, media: str) -> bool:
    base = media.split(";", 1)[0].strip().lower()
    return base in ACCEPTED_MEDIA_TYPES or (kind == "text" and base.startswith("text/"))


class Shapes:
    """Checks of A2A 1.0 request params (JSON-RPC params == HTTP+JSON bodies)."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config

    def hops(self, meta: dict[str, Any] | None, at: str) -> Hops:
        """The hops ``meta`` (a message's metadata) says, refused past ``--max-hops``."""
        hops = hops_of(meta)
        if hops.count > self.config.max_hops:
            path = " -> ".join([*hops.chain, self.config.name]) or "unknown"
            raise Invalid(
                "params",
                f"{at}.metadata.{HOPS_KEY} is {hops.count}, past this agent's limit of "
                f"{self.config.max_hops} delegation hops (--max-hops); chain: {path}",
            )
        return hops

    def subtask_list(self, value: Any, at: str) -> list[SubtaskSpec]:
        """A ``subtasks`` list, checked (its scenario params too)."""
        try:
            specs = check_subtask_list(value, self.config.max_subtasks, at)
        except ValueError as e:
            raise Invalid("params", str(e)) from None
        self._scenarios(specs, at)
        return specs

    def message(self, msg: dict[str, Any], at: str) -> CheckedMessage:
        """Check a message; returns what the task needs of it (its subtask list, text,
        hops and queue places)."""
        string(msg, "messageId", at, required=True)
        role = field(msg, "role")
        if not isinstance(role, str) or role not in _ROLES:
            raise Invalid("params", f"{at}.role must be \"ROLE_USER\" (or \"ROLE_AGENT\")")
        for key in ("contextId", "taskId"):
            string(msg, key, at)
        hops = self.hops(obj(msg, "metadata", at), at)
        str_list(msg, "extensions", at)
        str_list(msg, "referenceTaskIds", at)
        parts = field(msg, "parts")
        if not isinstance(parts, list) or not parts:
            raise Invalid("params", f"{at}.parts must be a non-empty list of part objects")
        if len(parts) > self.config.max_parts:
            raise Invalid(
                "params", f"{at}.parts has {len(parts)} parts; at most {self.config.max_parts}"
            )
        num_chars = 0
        has_content = False
        specs: list[SubtaskSpec] | None = None
        pieces: list[tuple[str, Any]] = []  # text and other data parts, in part order
        for i, part in enumerate(parts):
            pat = f"{at}.parts[{i}]"
            if not isinstance(part, dict):
                raise Invalid("params", f"{pat} must be an object like {{\"text\": \"...\"}}")
            kinds = [k for k in _PART_KINDS if k in part]
            if len(kinds) != 1:
                raise Invalid("params", f"{pat} must have exactly one of text, raw, url, data")
            kind = kinds[0]
            value = part[kind]
            if kind == "data":
                if isinstance(value, dict) and "subtasks" in value:
                    if specs is not None:
                        raise Invalid("params", f"{pat}: only one data part may list subtasks")
                    specs = self.subtask_list(value["subtasks"], f"{pat}.data.subtasks")
                    num_chars += sum(len(s.instructions) for s in specs)
                    has_content = True
                elif value is None:
                    raise Invalid("params", f"{pat}.data must not be null")
                else:
                    pieces.append(("data", value))
            elif not isinstance(value, str):
                raise Invalid("params", f"{pat}.{kind} must be a string, got {type_name(value)}")
            elif kind == "text":
                num_chars += len(value)
                has_content = has_content or bool(value.strip())
                pieces.append(("text", value))
            for key in ("filename", "mediaType"):
                string(part, key, pat)
            media = field(part, "mediaType")
            if media and not accepted_media(kind, media):
                raise Invalid(
                    "content_type",
                    f"{pat}.mediaType {media!r} is not accepted; this agent takes "
                    f"{', '.join(ACCEPTED_MEDIA_TYPES)} (and text/* in text parts)",
                )
            obj(part, "metadata", pat)
        if num_chars > self.config.max_message_chars:
            raise Invalid(
                "params",
                f"{at} carries {num_chars} characters; at most {self.config.max_message_chars}",
            )
        if not has_content:
            raise Invalid("params", f"{at} has no text and no subtasks; send a text part")
        return CheckedMessage.of_parts(pieces, specs, hops)

    def _scenarios(self, specs: list[SubtaskSpec], at: str) -> None:
        """Scenario params: refused unless simulation is on, and bounded when it is."""
        for i, spec in enumerate(specs):
            if not spec.params.get("scenario"):
                continue
            if not self.config.simulation:
                raise Invalid(
                    "params",
                    f"{at}[{i}].params.scenario: scenario params are off on this server; "
                    "start it with `mesh serve --simulation` (or use `mesh simulate`)",
                )
            try:
                check_scenario_bounds(spec.params)
            except ValueError as e:
                raise Invalid("params", f"{at}[{i}].params: {e}") from None

    def send(self, params: dict[str, Any], at: str = "params") -> CheckedMessage:
        """Check SendMessage params; returns the message as checked."""
        msg = obj(params, "message", at, required=True)
        assert msg is not None
        checked = self.message(msg, f"{at}.message")
        obj(params, "metadata", at)
        string(params, "tenant", at)
        conf = obj(params, "configuration", at)
        if conf is not None:
            cat = f"{at}.configuration"
            str_list(conf, "acceptedOutputModes", cat)
            integer(conf, "historyLength", cat, 0)
            boolean(conf, "returnImmediately", cat)
            push = obj(conf, "taskPushNotificationConfig", cat)
            if push is not None:
                self.push_config(push, f"{cat}.taskPushNotificationConfig", need_task=False)
        return checked

    def push_config(self, cfg: dict[str, Any], at: str, *, need_task: bool) -> None:
        string(cfg, "url", at, required=True)
        string(cfg, "taskId", at, required=need_task)
        for key in ("id", "token", "tenant"):
            string(cfg, key, at)
        auth = obj(cfg, "authentication", at)
        if auth is not None:
            string(auth, "scheme", f"{at}.authentication", required=True)
            string(auth, "credentials", f"{at}.authentication")

    def list_tasks(self, params: dict[str, Any], at: str) -> None:
        string(params, "contextId", at)
        string(params, "pageToken", at)
        string(params, "tenant", at)
        string(params, "statusTimestampAfter", at)
        integer(params, "pageSize", at, 1, 100)
        integer(params, "historyLength", at, 0)
        boolean(params, "includeArtifacts", at)
        status = field(params, "status")
        if status is not None and status not in _TASK_STATES:
            raise Invalid("params", f"{at}.status must be one of {sorted(_TASK_STATES)}")

    def jsonrpc_params(self, method: str, params: dict[str, Any]) -> CheckedMessage | None:
        """Check a method's params; returns the message a send sends (else None)."""
        at = "params"
        if method in ("SendMessage", "SendStreamingMessage"):
            return self.send(params)
        elif method in ("GetTask", "CancelTask", "SubscribeToTask"):
            string(params, "id", at, required=True)
            integer(params, "historyLength", at, 0)
        elif method == "ListTasks":
            self.list_tasks(params, at)
        elif method == "CreateTaskPushNotificationConfig":
            self.push_config(params, at, need_task=True)
        elif method in ("GetTaskPushNotificationConfig", "DeleteTaskPushNotificationConfig"):
            string(params, "taskId", at, required=True)
            string(params, "id", at, required=True)
        elif method == "ListTaskPushNotificationConfigs":
            string(params, "taskId", at, required=True)
            integer(params, "pageSize", at, 1, 100)
        elif method in ("message/send", "message/stream"):
            msg = obj(params, "message", at, required=True)
            assert msg is not None
            parts = msg.get("parts")
            if not isinstance(parts, list) or not parts or not all(
                isinstance(p, dict) for p in parts
            ):
                raise Invalid("params", "params.message.parts must be a non-empty list of objects")
            if len(parts) > self.config.max_parts:
                raise Invalid("params", f"params.message.parts: at most {self.config.max_parts}")
            return self.legacy_message(msg, "params.message")
        elif method in ("tasks/get", "tasks/cancel", "tasks/resubscribe"):
            string(params, "id", at, required=True)
        return None

    def legacy_message(self, msg: Any, at: str, *, rest: bool = False) -> CheckedMessage:
        """An A2A 0.3 message, checked lightly (the SDK's adapter parses the rest): its
        subtask list, text and hops. JSON-RPC parts are ``{"kind": "text", "text": ...}``
        / ``{"kind": "data", "data": {...}}``; HTTP+JSON (``rest``) puts them in
        ``content`` as ``{"text": ...}`` / ``{"data": {"data": {...}}}``."""
        msg = msg if isinstance(msg, dict) else {}
        parts = msg.get("content" if rest else "parts")
        meta = msg.get("metadata")
        hops = self.hops(meta if isinstance(meta, dict) else None, at)
        specs: list[SubtaskSpec] | None = None
        pieces: list[tuple[str, Any]] = []
        for i, part in enumerate(parts if isinstance(parts, list) else ()):
            if not isinstance(part, dict):
                continue
            kind = part.get("kind") or ("text" if "text" in part else "data" if "data" in part
                                        else "")
            value = part.get(kind) if kind in ("text", "data") else None
            if rest and kind == "data" and isinstance(value, dict):
                value = value.get("data")
            if kind == "text" and isinstance(value, str):
                pieces.append(("text", value))
            elif isinstance(value, dict) and "subtasks" in value:
                if specs is not None:
                    raise Invalid("params", f"{at}: only one data part may list subtasks")
                specs = self.subtask_list(value["subtasks"], f"{at}.parts[{i}].data.subtasks")
            elif kind == "data" and value is not None:
                pieces.append(("data", value))
        checked = CheckedMessage.of_parts(pieces, specs, hops)
        if specs is None and not checked.text:
            raise Invalid("params", f"{at} has no text and no subtasks; send a text part")
        return checked
