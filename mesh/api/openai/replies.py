"""The OpenAI API's replies to a finished or streaming turn: the completion body, the SSE
chunks, and usage (what was cached plus what the turn prefilled).

With tools, the reply's text is parsed into ``tool_calls`` (:func:`~mesh.api.openai.tools.
split_calls`); a streamed turn with tools sends its content and calls in one chunk at the
end, since a call is known only once the whole reply is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from mesh.api.openai.schema import chunk_line, created, finish_reason, usage_json
from mesh.api.openai.tools import split_calls
from mesh.api.openai.turns import ChatTurn, error_code
from mesh.engine.interface import EngineError, TurnResult

__all__ = ["reply_body", "reply_stream", "usage"]


def usage(turn: ChatTurn, result: TurnResult) -> dict[str, Any]:
    """Usage: the prompt is what was cached plus what this turn prefilled."""
    prompt = turn.cached_tokens + result.num_prompt_tokens
    return usage_json(prompt, result.num_generated, turn.cached_tokens)


def reply_body(turn: ChatTurn, result: TurnResult, rid: str, chat: bool,
               model: str) -> dict[str, Any]:
    """The JSON body of a non-streamed completion (chat or text)."""
    reason = finish_reason(result.finish_reason)
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        if turn.tools:
            content, calls = split_calls(result.text, turn.tools, repeats=turn.repeat_calls)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                reason = "tool_calls"
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None,
                                  "message": message}
    else:
        choice = {"index": 0, "finish_reason": reason, "logprobs": None,
                  "text": result.text}
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created(),
        "model": model,
        "choices": [choice],
        "usage": usage(turn, result),
    }


async def reply_stream(turn: ChatTurn, rid: str, chat: bool, with_usage: bool,
                       model: str) -> AsyncIterator[str]:
    """The SSE lines of a streamed completion, ``[DONE]`` last (an error ends it early)."""
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created(), "model": model}

    def choice(text: str | None, reason: str | None) -> dict[str, Any]:
        if not chat:
            return {**head, "choices": [{"index": 0, "text": text or "",
                                         "finish_reason": reason, "logprobs": None}]}
        delta: dict[str, Any] = {} if text is None else {"content": text}
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": reason,
                                     "logprobs": None}]}

    if chat:
        yield chunk_line({**head, "choices": [{"index": 0, "finish_reason": None,
                          "delta": {"role": "assistant", "content": ""}}]})
    try:
        async for piece in turn.iterator:
            if piece.text and not turn.tools:  # with tools: one piece at the end
                yield chunk_line(choice(piece.text, None))
    except (EngineError, ValueError) as exc:  # ValueError: nothing new to read
        turn.failed = True
        code = error_code(exc) if isinstance(exc, EngineError) else "empty_input"
        kind = "server_error" if isinstance(exc, EngineError) else "invalid_request_error"
        yield chunk_line({"error": {"message": str(exc), "type": kind, "code": code}})
        yield chunk_line("[DONE]")
        return
    result = turn.generation.result
    if result is not None:
        reason = finish_reason(result.finish_reason)
        if turn.tools:
            content, calls = split_calls(result.text, turn.tools, repeats=turn.repeat_calls)
            delta: dict[str, Any] = {"content": content}
            if calls:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                reason = "tool_calls"
            yield chunk_line({**head, "choices": [{"index": 0, "delta": delta,
                              "finish_reason": None, "logprobs": None}]})
        yield chunk_line(choice(None, reason))
        if with_usage:
            yield chunk_line({**head, "choices": [], "usage": usage(turn, result)})
    yield chunk_line("[DONE]")
