"""An OpenAI-compatible API on the pool, so agent frameworks share its prefix unchanged.

    POST /v1/chat/completions   messages rendered in the model's chat format
    POST /v1/completions        a raw prompt
    GET  /v1/prefix             the exact system text (and prefix) every request must start with
    GET  /v1/models             the one model

A request's text (the rendered messages, or the prompt) must start with the pool's prefix:
the chat format's rendering of :attr:`OpenAIAPI.system_text`, i.e. a first ``system``
message whose content is ``GET /v1/prefix``'s ``system``. Otherwise the answer is a 400 that
names the first differing token. The rest of the text lands on the idle cached conversation
whose text is its longest prefix (:mod:`mesh.api.conversations`), so a multi-turn agent
prefills only its new messages; ``usage.prompt_tokens_details.cached_tokens`` says how many
prompt tokens were already in the pool (prefix included). Without a match a new session
is attached (the prefix is shared, never prefilled again).

Every request passes the gate's queue check (429 + Retry-After when it refuses). A request
that starts a new conversation is a new worker: it waits for the gate's ``admit`` (429 past
``max_wait_s``) and holds the ticket for its turn. A request that continues a cached
conversation resumes a worker the gate already counts (its session is in the pool's load,
like a worker back from a tool call), so it is not admitted again. While a new conversation
waits, and whenever the pool has no session slot or cells left, idle conversations are
evicted least-recently-used, and any idle past ``idle_ttl_s`` (120 s) is detached.

``tools`` / ``tool_choice``: see :mod:`mesh.api.openai_tools` (the tools are described
before the first user message, the reply is sampled under a grammar of their calls and
parsed into ``tool_calls``); ``tool`` messages are rendered as user messages that carry the
result. Not supported: ``n > 1``, ``logprobs``, non-text parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from mesh.api.conversations import Conversation, ConversationCache, discard
from mesh.api.openai_tools import (
    ToolChoice,
    ToolsError,
    ToolSpec,
    parse_tool_choice,
    parse_tools,
    render_calls,
    split_calls,
    tools_grammar,
    tools_prompt,
)
from mesh.api.openai_wire import (
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    chunk_line,
    created,
    finish_reason,
    oa_error,
    too_busy,
    usage_json,
)
from mesh.api.wire import DEFAULT_MAX_TOKENS, MAX_STOP_LEN, TurnStream
from mesh.engine.types import (
    ContextOverflow,
    Engine,
    EngineError,
    Generation,
    PoolFull,
    SamplingParams,
    SessionFailed,
    TurnResult,
)
from mesh.gate.types import Admission, QueueFull, Ticket
from mesh.template.chat import ChatFormat, ChatFormatError

__all__ = ["OpenAIAPI"]

Tokenize = Callable[[str], list[int]]
_EVICT_AFTER_S = 0.5  # how long a new conversation waits before an idle one gives way


class _Bad(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        if self.retry_after_s is not None:
            return too_busy(self.message, self.code, self.retry_after_s)
        return oa_error(self.status, self.message, self.code, param=self.param)


class _Turn:
    """One request's hold on a conversation: its ticket, session and generation."""

    def __init__(self, conv: Conversation, ticket: Ticket | None, cached: int,
                 generation: Generation) -> None:
        self.conv, self.ticket, self.generation = conv, ticket, generation
        self.cached_tokens = cached  # prefix + the conversation's decoded cells
        self.iterator = generation.__aiter__()
        self.failed = False
        self.tools: tuple[ToolSpec, ...] = ()  # a chat turn with tools: parse its calls


class OpenAIAPI:
    """The routes above over one engine, one gate and the pool's chat format."""

    def __init__(
        self,
        engine: Engine,
        admission: Admission,
        chat: ChatFormat,
        system_text: str,
        *,
        tokenize: Tokenize,
        max_wait_s: float = 30.0,
        max_idle: int | None = None,
        idle_ttl_s: float = 120.0,
    ) -> None:
        self.engine, self.admission, self.chat = engine, admission, chat
        self.system_text = system_text
        self.prefix = chat.prefix_text(system_text)
        self.tokenize = tokenize
        self.max_wait_s = max_wait_s
        self.cache = ConversationCache(max_idle or engine.info.max_sessions)
        self.idle_ttl_s = idle_ttl_s
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completion, methods=["POST"]),
            Route("/v1/prefix", self._prefix, methods=["GET"]),
            Route("/v1/models", self._models, methods=["GET"]),
        ]

    async def aclose(self) -> None:
        """Stop the idle sweeper and detach every idle conversation (app shutdown)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        await self.cache.aclose()

    def _ensure_sweeper(self) -> None:
        """Start (once, in the serving loop) the task that detaches conversations idle past
        ``idle_ttl_s``: an idle session holds a pool slot that A2A workers may need too."""
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        period = max(0.05, min(5.0, self.idle_ttl_s / 4))
        while True:
            await asyncio.sleep(period)
            await self.cache.evict_idle(self.idle_ttl_s)

    # ------------------------------------------------------------------ handlers

    async def _prefix(self, request: Request) -> Response:
        info = self.engine.info
        return JSONResponse({
            "system": self.system_text,
            "prefix_text": self.prefix,
            "prefix_tokens": info.prefix_tokens,
            "prefix_hash": info.prefix_hash,
            "chat_format": self.chat.name,
            "messages": [{"role": "system", "content": self.system_text}],
        })

    async def _models(self, request: Request) -> Response:
        name = self.engine.info.model_name
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "mesh"}]})

    async def _chat(self, request: Request) -> Response:
        try:
            req = await _parse(request, ChatRequest)
            specs = parse_tools(req.tools or [])
            choice = parse_tool_choice(req.tool_choice, specs)
            rendered = self._strip_bos(self.chat.render(self._messages(req, specs, choice)))
            rest = self._rest(rendered, "messages")
            grammar = tools_grammar(specs, choice, parallel=req.parallel_tool_calls)
        except _Bad as exc:
            return exc.response()
        except ToolsError as exc:
            return oa_error(400, str(exc), "invalid_tools", param=exc.param)
        except ChatFormatError as exc:
            return oa_error(400, str(exc), "invalid_messages", param="messages")
        return await self._run(req, rest, chat=True, grammar=grammar,
                               tools=specs if grammar else ())

    async def _completion(self, request: Request) -> Response:
        try:
            req = await _parse(request, CompletionRequest)
            if req.echo or req.suffix:
                raise _Bad(400, "echo and suffix are not supported", "unsupported")
            rest = self._rest(self._strip_bos(req.prompt), "prompt")
        except _Bad as exc:
            return exc.response()
        return await self._run(req, rest, chat=False)

    # ------------------------------------------------------------------ rendering

    def _messages(self, req: ChatRequest, specs: tuple[ToolSpec, ...] = (),
                  choice: ToolChoice | None = None) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        described = not specs or choice is None or choice.mode == "none"
        for i, m in enumerate(req.messages):
            if m.has_non_text():
                raise _Bad(400, f"messages[{i}] has a non-text part; only text is supported",
                           "unsupported", "messages")
            role, text = m.role, m.text()
            if role == "developer":
                role = "system"
            elif role == "tool":
                role, text = "user", f"Tool result ({m.name or m.tool_call_id or 'tool'}):\n{text}"
            elif role == "assistant" and m.tool_calls:
                text = "\n".join(t for t in (text, render_calls(m.tool_calls)) if t)
            if role == "user" and not described and choice is not None:
                text, described = f"{tools_prompt(specs, choice)}\n\n{text}", True
            out.append({"role": role, "content": text})
        return out

    def _strip_bos(self, text: str) -> str:
        bos = self.chat.bos_token
        if self.chat.add_bos and bos and text.startswith(bos):
            return text[len(bos):]
        return text

    def _rest(self, text: str, param: str) -> str:
        """The text after the prefix, or a 400 naming the first differing token."""
        if text.startswith(self.prefix):
            return text[len(self.prefix):]
        want = self.tokenize(self.prefix)
        got = self.tokenize(text[: len(self.prefix) + 64])
        tok = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
                   min(len(want), len(got)))
        ch = next((i for i, (a, b) in enumerate(zip(self.prefix, text, strict=False)) if a != b),
                  min(len(self.prefix), len(text)))
        raise _Bad(400, (
            f"the request does not start with the pool's prefix: they differ at token {tok} "
            f"(character {ch}: the prefix has {self.prefix[ch:ch + 24]!r}, the request "
            f"{text[ch:ch + 24]!r}); send a first system message whose content is the "
            "'system' text of GET /v1/prefix, exactly"), "prefix_mismatch", param)

    # ------------------------------------------------------------------ turns

    def _params(self, req: SamplingFields, grammar: str | None = None) -> SamplingParams:
        if req.logprobs:
            raise _Bad(400, "logprobs are not supported", "unsupported", "logprobs")
        budget = self.engine.info.session_budget
        asked = req.max_completion_tokens or req.max_tokens
        max_tokens = min(DEFAULT_MAX_TOKENS, budget) if asked is None else asked
        if max_tokens > budget:
            raise _Bad(400, f"max_tokens {max_tokens} exceeds the session budget of {budget} "
                       "tokens", "context_length_exceeded", "max_tokens")
        stop = req.stop_list()
        if len(stop) > 16 or any(not s or len(s) > MAX_STOP_LEN for s in stop):
            raise _Bad(400, f"stop: at most 16 strings of 1..{MAX_STOP_LEN} characters",
                       "invalid_value", "stop")
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature,
                              top_p=req.top_p, seed=req.seed, stop=stop, grammar=grammar)

    async def _run(self, req: SamplingFields, rest: str, *, chat: bool,
                   grammar: str | None = None, tools: tuple[ToolSpec, ...] = ()) -> Response:
        self._ensure_sweeper()
        try:
            params = self._params(req, grammar)
        except _Bad as exc:
            return exc.response()
        check = self.admission.check_queue()
        if not check.ok:
            return too_busy(check.reason or "the queue is full", "queue_full",
                            check.retry_after_s)
        conv = self.cache.take(rest)
        if conv is None and not rest:
            return oa_error(400, "the request adds nothing after the pool's prefix; send "
                            "text after it (a user message, or more prompt)", "empty_input")
        ticket: Ticket | None = None
        if conv is None:  # a new conversation is a new worker: the gate admits it
            try:
                ticket = await self._admit()
            except _Bad as exc:
                return exc.response()
        try:
            turn = await self._start(conv, rest, params, ticket)
        except _Bad as exc:
            await _release(ticket)
            return exc.response()
        except BaseException:
            await _release(ticket)
            raise
        turn.tools = tools
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if req.stream:
            events = self._stream(turn, rid, chat, req.include_usage())
            return TurnStream(events, lambda: self._end(turn))
        try:
            async for _ in turn.iterator:
                pass
        except EngineError as exc:
            turn.failed = True
            return _engine_error(exc)
        except ValueError as exc:  # nothing new to read: the same conversation sent again
            turn.failed = True
            return oa_error(400, f"{exc}; the request adds nothing to the conversation",
                            "empty_input")
        finally:
            await self._end(turn)
        result = turn.generation.result
        if result is None:
            return oa_error(503, "the turn ended without a result", "engine_error")
        return JSONResponse(self._body(turn, result, rid, chat))

    async def _admit(self) -> Ticket:
        """A ticket for a new conversation. While it waits, idle conversations give way
        (least recently used first, one per ``_EVICT_AFTER_S``); 429 past ``max_wait_s``."""
        deadline = anyio.current_time() + self.max_wait_s
        while True:
            while not self.engine.check_attach().ok and await self.cache.evict_lru():
                pass
            left = deadline - anyio.current_time()
            slice_s = min(left, _EVICT_AFTER_S) if len(self.cache) else left
            try:
                with anyio.fail_after(max(0.0, slice_s)):
                    return await self.admission.admit("openai")
            except QueueFull as exc:
                raise _Bad(429, str(exc), "queue_full", retry_after_s=exc.retry_after_s) from None
            except TimeoutError:
                if await self.cache.evict_lru() or anyio.current_time() < deadline:
                    continue
                raise _Bad(429, f"not admitted within {self.max_wait_s:g} s", "not_admitted",
                           retry_after_s=self.admission.check_queue().retry_after_s) from None

    async def _start(self, conv: Conversation | None, rest: str, params: SamplingParams,
                     ticket: Ticket | None) -> _Turn:
        """Attach a conversation if none matched, append the new text, start generating."""
        if conv is None:
            conv = Conversation(await self._attach())
        try:
            cached = conv.session.context_len
            new_text = rest[len(conv.text):]
            await self._append(conv, new_text)
            conv.text = rest
            generation = conv.session.generate(params)
        except BaseException:
            await discard(conv)
            raise
        return _Turn(conv, ticket, cached, generation)

    async def _attach(self) -> Any:
        while True:
            try:
                return await self.engine.attach()
            except PoolFull as exc:
                if not await self.cache.evict_lru():
                    retry = self.admission.check_queue().retry_after_s
                    raise _Bad(429, str(exc), "pool_full", retry_after_s=retry) from None

    async def _append(self, conv: Conversation, text: str) -> None:
        while True:
            try:
                conv.session.append(text)
                return
            except ContextOverflow as exc:
                if "KV buffer" in str(exc) and await self.cache.evict_lru():
                    continue
                raise _Bad(400, str(exc), "context_length_exceeded", "messages") from None
            except EngineError as exc:
                raise _Bad(503, str(exc), "engine_error") from None

    async def _end(self, turn: _Turn) -> None:
        """Stop an unfinished generation; cache the conversation if its text is exact."""
        with anyio.CancelScope(shield=True):
            gen = turn.generation
            try:
                if gen.result is None:
                    try:
                        await gen.aclose()
                    except EngineError:
                        turn.failed = True
                aclose = getattr(turn.iterator, "aclose", None)
                if aclose is not None:
                    try:
                        await aclose()
                    except EngineError:
                        turn.failed = True
                result = gen.result
                # After a stop string the session holds tokens its text does not show.
                if turn.failed or result is None or result.finish_reason == "stop":
                    await discard(turn.conv)
                else:
                    turn.conv.text += result.text
                    await self.cache.put(turn.conv)
            finally:
                await _release(turn.ticket)

    # ------------------------------------------------------------------ bodies

    def _body(self, turn: _Turn, result: TurnResult, rid: str, chat: bool) -> dict[str, Any]:
        reason = finish_reason(result.finish_reason)
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": result.text}
            if turn.tools:
                content, calls = split_calls(result.text, turn.tools)
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
            "model": self.engine.info.model_name,
            "choices": [choice],
            "usage": _usage(turn, result),
        }

    async def _stream(self, turn: _Turn, rid: str, chat: bool, usage: bool
                      ) -> AsyncIterator[str]:
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created(), "model": self.engine.info.model_name}

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
            code = _code(exc) if isinstance(exc, EngineError) else "empty_input"
            kind = "server_error" if isinstance(exc, EngineError) else "invalid_request_error"
            yield chunk_line({"error": {"message": str(exc), "type": kind, "code": code}})
            yield chunk_line("[DONE]")
            return
        result = turn.generation.result
        if result is not None:
            reason = finish_reason(result.finish_reason)
            if turn.tools:
                content, calls = split_calls(result.text, turn.tools)
                delta: dict[str, Any] = {"content": content}
                if calls:
                    delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                    reason = "tool_calls"
                yield chunk_line({**head, "choices": [{"index": 0, "delta": delta,
                                  "finish_reason": None, "logprobs": None}]})
            yield chunk_line(choice(None, reason))
            if usage:
                yield chunk_line({**head, "choices": [], "usage": _usage(turn, result)})
        yield chunk_line("[DONE]")


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    body = await request.body()
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if any(e["type"] == "json_invalid" for e in errors):
            raise _Bad(400, "the body is not valid JSON", "bad_json") from None
        parts = [f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors[:5]]
        param = ".".join(map(str, errors[0]["loc"])) if errors else None
        raise _Bad(400, "; ".join(parts), "invalid_value", param) from None


def _usage(turn: _Turn, result: TurnResult) -> dict[str, Any]:
    """Usage: the prompt is what was cached plus what this turn prefilled."""
    prompt = turn.cached_tokens + result.num_prompt_tokens
    return usage_json(prompt, result.num_generated, turn.cached_tokens)


async def _release(ticket: Ticket | None) -> None:
    if ticket is None:
        return
    with anyio.CancelScope(shield=True):
        await ticket.release()


def _code(exc: EngineError) -> str:
    if isinstance(exc, ContextOverflow):
        return "context_length_exceeded"
    if isinstance(exc, SessionFailed):
        return "session_failed"
    return "engine_error"


def _engine_error(exc: EngineError) -> JSONResponse:
    status = 400 if isinstance(exc, ContextOverflow) else 503
    return oa_error(status, str(exc), _code(exc))

