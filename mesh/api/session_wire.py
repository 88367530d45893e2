"""The session API's wire format: request models, JSON errors, SSE framing.

Request models forbid unknown fields and use strict types (``"5"`` is not a number). A body
that is not JSON is a 400 ``bad_json``; one that is JSON but not a valid request is a 422
``invalid_request``. Every error body is ``{"error": {"code": ..., "message": ...}}``.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from mesh.engine.config import SamplingParams
from mesh.engine.interface import TurnResult

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "MAX_STOP_LEN",
    "AttachRequest",
    "BadRequest",
    "TurnRequest",
    "TurnStream",
    "error_response",
    "parse_body",
    "sse_event",
    "too_busy",
    "turn_json",
]

MAX_STOP_LEN = 256
DEFAULT_MAX_TOKENS = 128
M = TypeVar("M", bound=BaseModel)


class AttachRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    key: str = Field(default="session-api", min_length=1, max_length=200)  # queue label
    max_wait_s: float | None = Field(default=None, ge=0, le=3600)  # None: wait in the queue


class TurnRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str
    max_tokens: int | None = Field(default=None, ge=1)  # None: 128, within the budget
    stream: bool = False
    temperature: float = Field(default=0.0, ge=0, le=100)
    top_k: int = Field(default=0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: list[str] = Field(default_factory=list, max_length=16)
    stop_at_eos: bool = True

    def sampling_params(self, budget: int, n_vocab: int) -> SamplingParams:
        """The turn's sampling parameters within the session ``budget`` and the vocabulary
        (0: unknown); raises BadRequest (422) naming the field."""
        max_tokens = min(DEFAULT_MAX_TOKENS, budget) if self.max_tokens is None else self.max_tokens
        if max_tokens > budget:
            raise BadRequest(
                422,
                "invalid_request",
                f"max_tokens {max_tokens} exceeds the session budget of {budget} tokens",
            )
        if n_vocab and self.top_k > n_vocab:
            raise BadRequest(422, "invalid_request", f"top_k exceeds the vocabulary ({n_vocab})")
        if any(not s or len(s) > MAX_STOP_LEN for s in self.stop):
            raise BadRequest(
                422, "invalid_request", f"stop strings must be 1..{MAX_STOP_LEN} characters"
            )
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(self.stop),
            stop_at_eos=self.stop_at_eos,
        )
        try:
            params.validate()
        except ValueError as exc:
            raise BadRequest(422, "invalid_request", str(exc)) from None
        return params


class BadRequest(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status, headers)


def too_busy(code: str, message: str, retry_after_s: float) -> JSONResponse:
    retry = str(max(1, math.ceil(retry_after_s)))
    return error_response(429, code, message, {"Retry-After": retry})


async def parse_body(request: Request, model: type[M], *, allow_empty: bool = False) -> M:
    body = await request.body()
    if allow_empty and not body.strip():
        body = b"{}"
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if any(e["type"] == "json_invalid" for e in errors):
            raise BadRequest(400, "bad_json", "the body is not valid JSON") from None
        parts = [f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors[:5]]
        raise BadRequest(422, "invalid_request", "; ".join(parts)) from None


def turn_json(session_id: str, result: TurnResult, context_len: int) -> dict[str, Any]:
    return {
        "id": session_id,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "stop": result.stop,
        "num_prompt_tokens": result.num_prompt_tokens,
        "num_generated": result.num_generated,
        "decode_s": result.decode_s,
        "context_len": context_len,
    }


def sse_event(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class TurnStream(StreamingResponse):
    """A StreamingResponse that always runs ``cleanup`` (even if never iterated)."""

    def __init__(self, events: AsyncIterator[str], cleanup: Callable[[], Awaitable[None]]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self._cleanup()
