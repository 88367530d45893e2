"""The OpenAI-compatible API (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/v1/prefix``), read top to bottom: the model's name, cached conversations, turns,
rendering, replies and the routes. docs/openai-api.md says what a client sees (the drop-in
rule, callers, the queue share, tools and their limits).

A request whose text after the pool's prefix extends one of its caller's idle
conversations (:attr:`Conversation.owner`) continues that live session, so only its new
messages are prefilled; a conversation in a turn is out of the cache, and idle ones are
evicted least-recently-used when the pool needs room. A new conversation is a new worker
the gate admits (:meth:`OpenAITurns.admit`); a continued one resumes a worker the gate
already counts. Every request passes the gate's queue check for one of its caller's places,
at the door and again once prepared (parsing, tools, rendering and tokenizing grow with the
request, so they run in a worker thread). Not supported: ``n > 1``, ``logprobs``,
non-text parts.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import anyio
import anyio.to_thread
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from mesh.api.admit import Periodic, Refusal, admit, caller_of, queue_refusal, release
from mesh.api.openai_tools import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    ToolChoice,
    ToolsError,
    ToolSpec,
    cached_grammar,
    parse_tool_choice,
    parse_tools,
    render_calls,
    split_calls,
    tools_prompt,
)
from mesh.api.sessions import DEFAULT_MAX_TOKENS, MAX_STOP_LEN, EventStream, body_error, stop_turn
from mesh.engine.config import SamplingParams
from mesh.engine.interface import (
    ContextOverflow,
    Engine,
    EngineError,
    Generation,
    PoolFull,
    PoolInfo,
    Session,
    SessionFailed,
    TurnResult,
)
from mesh.gate.queue import Admission, Hold, Ticket
from mesh.template.chat import ChatFormat, ChatFormatError, Tokenize

__all__ = [
    "STRICT_SUFFIX", "Bad", "ChatTurn", "Conversation", "ConversationCache", "OpenAIAPI",
    "OpenAITurns", "Prompter", "chunk_line", "error_code", "gguf_name",
    "is_strict", "model_names", "oa_error", "reply_body", "reply_stream", "template_messages",
    "usage",
]


# -------------------- models --------------------------------------------------

_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_KEYS = 64
_MAX_STRING = 1 << 20


def model_names(info: PoolInfo) -> tuple[str, str]:
    """(id, file name) of the pool's model: the GGUF's ``general.name`` (else the file's
    stem) and the file's name; an engine without a local file keeps its own name."""
    path = Path(info.model_path)
    if not path.is_file():
        return info.model_name, info.model_path
    name = gguf_name(path)
    return (name or path.stem), path.name


def gguf_name(path: Path) -> str | None:
    """``general.name`` of a GGUF file, None when it is not among the first keys or the
    file is not a readable GGUF."""
    try:
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                return None
            _u(f, "<I")  # version
            _u(f, "<Q")  # tensors
            for _ in range(min(_u(f, "<Q"), _MAX_KEYS)):
                key = _string(f)
                kind = _u(f, "<I")
                if kind == _STRING:
                    value = _string(f)
                    if key == "general.name":
                        return value.strip() or None
                elif kind == _ARRAY:
                    inner, n = _u(f, "<I"), _u(f, "<Q")
                    if inner not in _SIZES:
                        return None  # an array of strings: the vocabulary; no name before it
                    f.seek(_SIZES[inner] * n, 1)
                elif kind in _SIZES:
                    f.seek(_SIZES[kind], 1)
                else:
                    return None
    except (OSError, struct.error, UnicodeDecodeError, ValueError):
        return None
    return None


def _u(f: BinaryIO, fmt: str) -> int:
    return int(struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0])


def _string(f: BinaryIO) -> str:
    n = _u(f, "<Q")
    if n > _MAX_STRING:
        raise ValueError("a GGUF string longer than 1 MiB")
    return f.read(n).decode("utf-8")

# -------------------- conversations -------------------------------------------

@dataclass
class Conversation:
    session: Session
    text: str = ""  # what the session holds after the prefix, exactly
    owner: str = ""  # the caller whose requests may continue it ("" without auth)
    last_used: float = field(default_factory=time.monotonic)


class ConversationCache:
    """The idle conversations; bounded by ``max_idle`` (older ones are detached)."""

    def __init__(self, max_idle: int) -> None:
        self.max_idle = max(1, max_idle)
        self._idle: dict[str, Conversation] = {}
        self.hits = self.evictions = 0

    def __len__(self) -> int:
        return len(self._idle)

    def take(self, owner: str, rest: str) -> Conversation | None:
        """Remove and return ``owner``'s idle conversation whose text is the longest prefix
        of ``rest`` with at least one character left to append; None if there is none."""
        best: Conversation | None = None
        for conv in self._idle.values():
            fits = (conv.owner == owner and len(conv.text) < len(rest)
                    and rest.startswith(conv.text))
            if fits and (best is None or len(conv.text) > len(best.text)):
                best = conv
        if best is None:
            return None
        self.hits += 1
        del self._idle[best.session.id]
        return best

    async def put(self, conv: Conversation) -> None:
        """Keep ``conv`` for the next turn (the least recently used go past ``max_idle``)."""
        conv.last_used = time.monotonic()
        self._idle[conv.session.id] = conv
        while len(self._idle) > self.max_idle:
            await self.evict_lru()

    async def evict_lru(self) -> bool:
        """Detach the least recently used idle conversation; False when none is idle."""
        if not self._idle:
            return False
        await self._evict(min(self._idle, key=lambda k: self._idle[k].last_used))
        return True

    async def evict_idle(self, older_than_s: float) -> int:
        """Detach every conversation idle longer than ``older_than_s``; how many."""
        cutoff = time.monotonic() - older_than_s
        old = [sid for sid, c in self._idle.items() if c.last_used < cutoff]
        for sid in old:
            await self._evict(sid)
        return len(old)

    async def _evict(self, sid: str) -> None:
        self.evictions += 1
        await discard(self._idle.pop(sid))

    async def aclose(self) -> None:
        while await self.evict_lru():
            pass


async def discard(conv: Conversation) -> None:
    """Detach a conversation's session (shielded: it always completes)."""
    with anyio.CancelScope(shield=True), contextlib.suppress(EngineError):
        await conv.session.detach()

# -------------------- turns ---------------------------------------------------

_EVICT_AFTER_S = 0.5  # how long a new conversation waits before an idle one gives way
# Longer appends are tokenized in a worker thread (``Session.append`` tokenizes on the
# caller's thread; a message may be ~1 MB).
_INLINE_APPEND_CHARS = 2048


class Bad(Exception):
    """A refused request: an OpenAI error (a 429 with Retry-After when ``retry_after_s``)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.retry_after_s = retry_after_s

    @classmethod
    def refused(cls, refusal: Refusal) -> Bad:
        return cls(429, refusal.message, refusal.code, retry_after_s=refusal.retry_after_s)

    def response(self) -> JSONResponse:
        headers = None if self.retry_after_s is None else {
            "Retry-After": str(max(1, math.ceil(self.retry_after_s)))}
        return oa_error(self.status, self.message, self.code, param=self.param, headers=headers)


def oa_error(status: int, message: str, code: str, *, param: str | None = None,
             headers: dict[str, str] | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 404: "not_found_error", 422: "invalid_request_error",
            429: "rate_limit_exceeded", 503: "server_error"}.get(status, "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status, headers)


class ChatTurn:
    """One request's hold on a conversation: its ticket, session and generation."""

    def __init__(self, conv: Conversation, ticket: Ticket | None, cached: int,
                 generation: Generation) -> None:
        self.conv, self.ticket, self.generation = conv, ticket, generation
        self.cached_tokens = cached  # prefix + the conversation's decoded cells
        self.iterator = generation.__aiter__()
        self.failed = False
        self.tools: tuple[ToolSpec, ...] = ()  # a chat turn with tools: parse its calls
        self.repeat_calls = False  # keep calls repeated word for word in the reply


class OpenAITurns:
    """Starts and ends the turns of one OpenAI API (one engine, gate and cache)."""

    def __init__(self, engine: Engine, admission: Admission, cache: ConversationCache,
                 max_wait_s: float) -> None:
        self.engine, self.admission, self.cache = engine, admission, cache
        self.max_wait_s = max_wait_s

    async def admit(self, caller: str = "") -> Hold:
        """A hold on the gate for a new conversation (one of ``caller``'s queue places),
        released by :meth:`end`; its session is attached by :meth:`start` (a conversation's
        session outlives the turn's ticket). Idle conversations are workers too: while this
        one waits, keeping its place in the queue, they give way, least recently used
        first, one per ``_EVICT_AFTER_S`` (at once while the pool refuses an attach). 429
        past ``max_wait_s``, or at once when the queue (or ``caller``'s share) is full."""
        while not self.engine.check_attach().ok and await self.cache.evict_lru():
            pass
        hold: Hold | None = None
        refusal: Refusal | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._give_way)
                try:
                    hold = await admit(self.admission, "openai", self.max_wait_s, caller,
                                       check=False)
                except Refusal as exc:
                    refusal = exc
                finally:
                    tg.cancel_scope.cancel()
        except BaseException:
            # Cancelled while the group wound down, after the ticket was granted: give it
            # back (shielded), so no ticket leaks.
            if hold is not None:
                await hold.aclose()
            raise
        if hold is not None:
            return hold
        assert refusal is not None
        if refusal.code != "not_admitted":
            raise Bad.refused(refusal)
        raise Bad(429, f"not admitted within {self.max_wait_s:g} s", "not_admitted",
                  retry_after_s=self.admission.check_queue(caller=caller).retry_after_s)

    async def _give_way(self) -> None:
        """While a new conversation waits: detach one idle conversation (the least
        recently used) every ``_EVICT_AFTER_S``; cancelled once the wait ends."""
        while True:
            await anyio.sleep(_EVICT_AFTER_S)
            await self.cache.evict_lru()

    async def start(self, conv: Conversation | None, rest: str, params: SamplingParams,
                    ticket: Ticket | None, *, owner: str = "") -> ChatTurn:
        """Attach a conversation (``owner``'s) if none matched, append the new text, start
        generating."""
        if conv is None:
            conv = Conversation(await self._attach(), owner=owner)
        try:
            cached = conv.session.context_len
            new_text = rest[len(conv.text):]
            await self._append(conv, new_text)
            conv.text = rest
            generation = conv.session.generate(params)
        except BaseException:
            await discard(conv)
            raise
        return ChatTurn(conv, ticket, cached, generation)

    async def _attach(self) -> Session:
        while True:
            try:
                return await self.engine.attach()
            except PoolFull as exc:
                if not await self.cache.evict_lru():
                    retry = self.admission.check_queue().retry_after_s
                    raise Bad(429, str(exc), "pool_full", retry_after_s=retry) from None

    async def _append(self, conv: Conversation, text: str) -> None:
        while True:
            try:
                if len(text) > _INLINE_APPEND_CHARS:
                    await anyio.to_thread.run_sync(conv.session.append, text)
                else:
                    conv.session.append(text)
                return
            except ContextOverflow as exc:
                if "KV buffer" in str(exc) and await self.cache.evict_lru():
                    continue
                raise Bad(400, str(exc), "context_length_exceeded", "messages") from None
            except EngineError as exc:
                raise Bad(503, str(exc), "engine_error") from None

    async def end(self, turn: ChatTurn) -> None:
        """Stop an unfinished generation; cache the conversation if its text is exact."""
        with anyio.CancelScope(shield=True):
            try:
                if not await stop_turn(turn.generation, turn.iterator):
                    turn.failed = True
                result = turn.generation.result
                # After a stop string the session holds tokens its text does not show.
                if turn.failed or result is None or result.finish_reason == "stop":
                    await discard(turn.conv)
                else:
                    turn.conv.text += result.text
                    await self.cache.put(turn.conv)
            finally:
                await release(turn.ticket)


def error_code(exc: EngineError) -> str:
    """The OpenAI error code of an engine error."""
    if isinstance(exc, ContextOverflow):
        return "context_length_exceeded"
    if isinstance(exc, SessionFailed):
        return "session_failed"
    return "engine_error"

# -------------------- rendering -----------------------------------------------

STRICT_SUFFIX = ":strict"

Msg = dict[str, str]


def is_strict(model: str, default: bool) -> bool:
    """Whether a request wants the strict prefix rule (a model name ending ``:strict``)."""
    return default or model.endswith(STRICT_SUFFIX)


def template_messages(messages: Sequence[ChatMessage], specs: tuple[ToolSpec, ...] = (),
                      choice: ToolChoice | None = None) -> list[Msg]:
    """OpenAI messages as the chat template's ``{"role", "content"}`` (``developer`` is
    ``system``, a ``tool`` result a user message, calls in the grammar's markup, the tools'
    description before the first user message's content)."""
    out: list[Msg] = []
    described = not specs or choice is None or choice.mode == "none"
    for i, m in enumerate(messages):
        if m.has_non_text():
            raise Bad(400, f"messages[{i}] has a non-text part; only text is supported",
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


class Prompter:
    """The pool's prefix rule over one chat format and system text: *drop-in* serves any
    messages on top of the prefix, a client's own system text leading the first user
    message; *strict* (:func:`is_strict`) requires the prefix, else a 400
    ``prefix_mismatch`` naming the first differing token."""

    def __init__(self, chat: ChatFormat, system_text: str, tokenize: Tokenize) -> None:
        self.chat, self.system_text, self.tokenize = chat, system_text, tokenize
        self.prefix = chat.prefix_text(system_text)

    def chat_rest(self, messages: list[Msg], *, strict: bool) -> str:
        """The rendered conversation after the prefix (:class:`Bad` 400 under the strict
        rule when it does not start with it; ChatFormatError when the template fails)."""
        first = messages[0] if messages else None
        own = first is not None and first == {"role": "system", "content": self.system_text}
        if strict or own:
            return self._rest(self._render(messages), "messages")
        pool = {"role": "system", "content": self.system_text}
        return self._rest(self._render([pool, *_fold_system(messages)]), "messages")

    def completion_rest(self, prompt: str, *, strict: bool) -> str:
        """A raw prompt's text after the prefix (drop-in: all of it, if it lacks one)."""
        text = self._strip_bos(prompt)
        if strict or text.startswith(self.prefix):
            return self._rest(text, "prompt")
        return text

    def _render(self, messages: list[Msg]) -> str:
        return self._strip_bos(self.chat.render(messages))

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
        raise Bad(400, (
            f"the request does not start with the pool's prefix: they differ at token {tok} "
            f"(character {ch}: the prefix has {self.prefix[ch:ch + 24]!r}, the request "
            f"{text[ch:ch + 24]!r}); send a first system message whose content is the "
            "'system' text of GET /v1/prefix, exactly (or, unless the server is strict, drop "
            "the ':strict' model suffix to have the pool's system text put first)"),
            "prefix_mismatch", param)


def _fold_system(messages: list[Msg]) -> list[Msg]:
    """System messages folded into the head of the next user message (one at the end
    becomes a user message)."""
    out: list[Msg] = []
    pending: list[str] = []
    for m in messages:
        if m["role"] == "system":
            pending.append(m["content"])
            continue
        if pending and m["role"] == "user":
            m = {"role": "user", "content": "\n\n".join([*pending, m["content"]])}
            pending = []
        out.append(m)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out

# -------------------- replies -------------------------------------------------

def usage(turn: ChatTurn, result: TurnResult) -> dict[str, Any]:
    """Usage: the prompt is what was cached plus what this turn prefilled."""
    prompt = turn.cached_tokens + result.num_prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": result.num_generated,
        "total_tokens": prompt + result.num_generated,
        "prompt_tokens_details": {"cached_tokens": turn.cached_tokens},
    }


def chunk_line(body: dict[str, Any] | str) -> str:
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n"


def _choice(reason: str | None, **part: Any) -> dict[str, Any]:
    return {"index": 0, **part, "finish_reason": reason, "logprobs": None}


def _calls(turn: ChatTurn, result: TurnResult) -> tuple[str | None, list[dict[str, Any]], str]:
    """The reply's prose, its tool calls (none without tools) and its finish reason."""
    reason = "length" if result.finish_reason in ("length", "context_full") else "stop"
    if not turn.tools:
        return result.text, [], reason
    content, calls = split_calls(result.text, turn.tools, repeats=turn.repeat_calls)
    return content, calls, "tool_calls" if calls else reason


def reply_body(turn: ChatTurn, result: TurnResult, rid: str, chat: bool,
               model: str) -> dict[str, Any]:
    """The JSON body of a non-streamed completion (chat or text)."""
    content, calls, reason = _calls(turn, result)
    if not chat:
        choice = _choice(reason, text=result.text)
    elif calls:
        choice = _choice(reason, message={"role": "assistant", "content": content,
                                          "tool_calls": calls})
    else:
        choice = _choice(reason, message={"role": "assistant", "content": result.text})
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(turn, result),
    }


async def reply_stream(turn: ChatTurn, rid: str, chat: bool, with_usage: bool,
                       model: str) -> AsyncIterator[str]:
    """The SSE lines of a streamed completion, ``[DONE]`` last (an error ends it early)."""
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model}

    def chunk(reason: str | None, **part: Any) -> str:
        return chunk_line({**head, "choices": [_choice(reason, **part)]})

    def text_chunk(text: str | None, reason: str | None) -> str:
        if not chat:
            return chunk(reason, text=text or "")
        return chunk(reason, delta={} if text is None else {"content": text})

    if chat:
        yield chunk_line({**head, "choices": [{"index": 0, "finish_reason": None,
                          "delta": {"role": "assistant", "content": ""}}]})
    try:
        async for piece in turn.iterator:
            if piece.text and not turn.tools:  # with tools: one piece at the end
                yield text_chunk(piece.text, None)
    except (EngineError, ValueError) as exc:  # ValueError: nothing new to read
        turn.failed = True
        code = error_code(exc) if isinstance(exc, EngineError) else "empty_input"
        kind = "server_error" if isinstance(exc, EngineError) else "invalid_request_error"
        yield chunk_line({"error": {"message": str(exc), "type": kind, "code": code}})
        yield chunk_line("[DONE]")
        return
    result = turn.generation.result
    if result is not None:
        content, calls, reason = _calls(turn, result)
        if turn.tools:
            delta: dict[str, Any] = {"content": content}
            if calls:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
            yield chunk(None, delta=delta)
        yield text_chunk(None, reason)
        if with_usage:
            yield chunk_line({**head, "choices": [], "usage": usage(turn, result)})
    yield chunk_line("[DONE]")

# -------------------- routes --------------------------------------------------

_PREP_THREADS = 2  # requests prepared at once (the rest wait, off the loop; few, so the
# event loop thread is not starved of the GIL by many preparing threads at once)


@dataclass(frozen=True)
class _Prepared:
    """A request ready to run: its text after the prefix and its sampling parameters."""

    req: SamplingFields
    rest: str
    params: SamplingParams
    tools: tuple[ToolSpec, ...] = ()
    repeat_calls: bool = False


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
        strict_prefix: bool = False,
    ) -> None:
        self.engine, self.admission, self.chat = engine, admission, chat
        self.system_text = system_text
        self.prompter = Prompter(chat, system_text, tokenize)
        self.strict_prefix = strict_prefix
        self.model_id, self.model_file = model_names(engine.info)
        self.cache = ConversationCache(max_idle or engine.info.max_sessions)
        self.idle_ttl_s = idle_ttl_s
        self.turns = OpenAITurns(engine, admission, self.cache, max_wait_s)
        self._limiter: anyio.CapacityLimiter | None = None
        # Detaches conversations idle past ``idle_ttl_s``: an idle session holds a pool
        # slot that A2A workers may need too.
        self._sweeper = Periodic(lambda: self.cache.evict_idle(self.idle_ttl_s),
                                 lambda: max(0.05, min(5.0, self.idle_ttl_s / 4)))

    @property
    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/chat/completions", partial(self._serve, self._prepare_chat, chat=True),
                  methods=["POST"]),
            Route("/v1/completions", partial(self._serve, self._prepare_completion, chat=False),
                  methods=["POST"]),
            Route("/v1/prefix", self._prefix, methods=["GET"]),
            Route("/v1/models", self._models, methods=["GET"]),
        ]

    async def aclose(self) -> None:
        """Stop the idle sweeper and detach every idle conversation (app shutdown)."""
        await self._sweeper.aclose()
        await self.cache.aclose()

    # ------------------------------------------------------------------ handlers

    async def _prefix(self, request: Request) -> Response:
        info = self.engine.info
        return JSONResponse({
            "system": self.system_text,
            "prefix_text": self.prompter.prefix,
            "prefix_tokens": info.prefix_tokens,
            "prefix_hash": info.prefix_hash,
            "chat_format": self.chat.name,
            "messages": [{"role": "system", "content": self.system_text}],
        })

    async def _models(self, request: Request) -> Response:
        def entry(model_id: str, strict: bool) -> dict[str, Any]:
            return {"id": model_id, "object": "model", "created": 0, "owned_by": "mesh",
                    "root": self.model_file, "description": self.engine.info.model_name,
                    "strict_prefix": strict}
        return JSONResponse({"object": "list", "data": [
            entry(self.model_id, self.strict_prefix),
            entry(self.model_id + STRICT_SUFFIX, True)]})

    async def _serve(self, prepare: Callable[[bytes], _Prepared], request: Request, *,
                     chat: bool) -> Response:
        caller = caller_of(request)
        # The door, as the A2A guard's: a caller over its share of the gate's queue (or a
        # full queue) is refused before its body is read or prepared; _run asks again.
        refusal = queue_refusal(self.admission, caller)
        if refusal is not None:
            return Bad.refused(refusal).response()
        body = await request.body()
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(_PREP_THREADS)
        try:
            prep = await anyio.to_thread.run_sync(prepare, body, limiter=self._limiter)
        except Bad as exc:
            return exc.response()
        except ToolsError as exc:
            return oa_error(400, str(exc), "invalid_tools", param=exc.param)
        except ChatFormatError as exc:
            return oa_error(400, str(exc), "invalid_messages", param="messages")
        return await self._run(prep, caller, chat=chat)

    # ------------------------------------------------------------------ preparing (a thread)

    def _prepare_chat(self, body: bytes) -> _Prepared:
        """Parse, check tools (shape limits first), render, and build the grammar. Runs in
        a worker thread: every step here grows with the request."""
        req: ChatRequest = _parse(body, ChatRequest)
        max_tokens = self._max_tokens(req)
        specs = parse_tools(req.tools or [])
        choice = parse_tool_choice(req.tool_choice, specs)
        messages = template_messages(req.messages, specs, choice)
        rest = self.prompter.chat_rest(
            messages, strict=is_strict(req.model, self.strict_prefix))
        grammar = None
        if specs:
            key = json.dumps(req.tools, sort_keys=True, separators=(",", ":"))
            grammar = cached_grammar(key, specs, choice, parallel=req.parallel_tool_calls,
                                     max_tokens=max_tokens)
        return _Prepared(req, rest, self._params(req, max_tokens, grammar),
                         specs if grammar else (), req.repeat_tool_calls)

    def _prepare_completion(self, body: bytes) -> _Prepared:
        req: CompletionRequest = _parse(body, CompletionRequest)
        if req.echo or req.suffix:
            raise Bad(400, "echo and suffix are not supported", "unsupported")
        max_tokens = self._max_tokens(req)
        rest = self.prompter.completion_rest(
            req.prompt, strict=is_strict(req.model, self.strict_prefix))
        return _Prepared(req, rest, self._params(req, max_tokens))

    def _max_tokens(self, req: SamplingFields) -> int:
        budget = self.engine.info.session_budget
        asked = req.max_completion_tokens or req.max_tokens
        max_tokens = min(DEFAULT_MAX_TOKENS, budget) if asked is None else asked
        if max_tokens > budget:
            raise Bad(400, f"max_tokens {max_tokens} exceeds the session budget of {budget} "
                       "tokens", "context_length_exceeded", "max_tokens")
        return max_tokens

    def _params(self, req: SamplingFields, max_tokens: int,
                grammar: str | None = None) -> SamplingParams:
        if req.logprobs:
            raise Bad(400, "logprobs are not supported", "unsupported", "logprobs")
        stop = req.stop_list()
        if len(stop) > 16 or any(not s or len(s) > MAX_STOP_LEN for s in stop):
            raise Bad(400, f"stop: at most 16 strings of 1..{MAX_STOP_LEN} characters",
                       "invalid_value", "stop")
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature,
                              top_p=req.top_p, seed=req.seed, stop=stop, grammar=grammar)

    # ------------------------------------------------------------------ turns

    async def _run(self, prep: _Prepared, caller: str, *, chat: bool) -> Response:
        self._sweeper.ensure_started()
        req, rest = prep.req, prep.rest
        refusal = queue_refusal(self.admission, caller)
        if refusal is not None:
            return Bad.refused(refusal).response()
        conv = self.cache.take(caller, rest)
        if conv is None and not rest:
            return oa_error(400, "the request adds nothing after the pool's prefix; send "
                            "text after it (a user message, or more prompt)", "empty_input")
        ticket: Ticket | None = None
        if conv is None:  # a new conversation is a new worker: the gate admits it
            try:
                ticket = await self.turns.admit(caller)
            except Bad as exc:
                return exc.response()
        try:
            turn = await self.turns.start(conv, rest, prep.params, ticket, owner=caller)
        except Bad as exc:
            await release(ticket)
            return exc.response()
        except BaseException:
            await release(ticket)
            raise
        turn.tools, turn.repeat_calls = prep.tools, prep.repeat_calls
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if req.stream:
            events = reply_stream(turn, rid, chat, req.include_usage(), self.model_id)
            return EventStream(events, lambda: self.turns.end(turn))
        try:
            async for _ in turn.iterator:
                pass
        except EngineError as exc:
            turn.failed = True
            status = 400 if isinstance(exc, ContextOverflow) else 503
            return oa_error(status, str(exc), error_code(exc))
        except ValueError as exc:  # nothing new to read: the same conversation sent again
            turn.failed = True
            return oa_error(400, f"{exc}; the request adds nothing to the conversation",
                            "empty_input")
        finally:
            await self.turns.end(turn)
        result = turn.generation.result
        if result is None:
            return oa_error(503, "the turn ended without a result", "engine_error")
        return JSONResponse(reply_body(turn, result, rid, chat, self.model_id))


def _parse(body: bytes, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        message, param = body_error(exc)
        if message is None:
            raise Bad(400, "the body is not valid JSON", "bad_json") from None
        raise Bad(400, message, "invalid_value", param) from None

# -------------------- the package ---------------------------------------------
