"""Request models and response bodies of the OpenAI-compatible API (see mesh.api.openai).

Models ignore fields mesh does not use (clients send many: ``user``, ``logit_bias``,
``frequency_penalty``...), and reject the ones whose meaning mesh cannot honour (``n > 1``,
``logprobs``). Errors follow OpenAI's shape: ``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "SamplingFields",
    "chunk_line",
    "finish_reason",
    "oa_error",
    "usage_json",
]


class SamplingFields(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str = ""
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=1)  # one choice per request
    logprobs: bool | int | None = None

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined; other parts refused upstream)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")

    def has_non_text(self) -> bool:
        return isinstance(self.content, list) and any(
            p.get("type") != "text" for p in self.content
        )


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    # mesh's own: keep a call repeated word for word in one reply (dropped by default).
    repeat_tool_calls: bool = False


class CompletionRequest(SamplingFields):
    prompt: str
    echo: bool = False
    suffix: str | None = None


def oa_error(
    status: int, message: str, code: str, *, param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    kind = {400: "invalid_request_error", 404: "not_found_error", 422: "invalid_request_error",
            429: "rate_limit_exceeded", 503: "server_error"}.get(status, "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status, headers)


def too_busy(message: str, code: str, retry_after_s: float) -> JSONResponse:
    retry = str(max(1, math.ceil(retry_after_s)))
    return oa_error(429, message, code, headers={"Retry-After": retry})


def finish_reason(engine_reason: str) -> str:
    """The engine's finish reason in OpenAI's words."""
    return {"length": "length", "context_full": "length"}.get(engine_reason, "stop")


def usage_json(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chunk_line(body: dict[str, Any] | str) -> str:
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n"


def created() -> int:
    return int(time.time())
