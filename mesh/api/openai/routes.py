"""An OpenAI-compatible API on the pool, so agent frameworks share its prefix unchanged.

    POST /v1/chat/completions   messages rendered in the model's chat format
    POST /v1/completions        a raw prompt
    GET  /v1/prefix             the pool's system text (and prefix), for clients that send it
    GET  /v1/models             the one model, by its GGUF ``general.name`` (and a ``:strict``
                                twin)

Every request is served on top of the pool's prefix, the chat format's rendering of
:attr:`OpenAIAPI.system_text` (:mod:`mesh.api.openai.render`): a client's own messages,
system message included, follow the pool's system text; under the strict rule (a model
name ending ``:strict``, or ``strict_prefix=True``) a request must start with the prefix
exactly, else a 400 that names the first differing token. The text after the prefix lands on
the caller's idle cached conversation whose text is its longest prefix
(:mod:`mesh.api.conversations`; one caller never continues, or learns of, another's), so a
multi-turn agent prefills only its new messages; ``usage.prompt_tokens_details.
cached_tokens`` says how many prompt tokens were already in the pool (prefix included).
Without a match a new session is attached (the prefix is shared, never prefilled again).

Parsing the body, checking and compiling ``tools``, rendering and tokenizing grow with the
request, so they run in a worker thread (:meth:`OpenAIAPI._prepare_chat`), after the tools'
shape limits (:mod:`mesh.api.openai.limits`); the event loop only reads the body and runs
the turn.

Every request is its caller's (:func:`~mesh.api.admit.caller_of`: the bearer token's
caller, the anonymous one with auth off) and passes the gate's queue check for one of that
caller's places, at the door and again once prepared: 429 + Retry-After when the queue is
full or the caller already holds its share of it (``max_queue_per_caller``), while other
callers still queue. A request that starts a new conversation is a new worker: it waits for
the gate's ``admit`` in its caller's place (429 past ``max_wait_s``) and holds the ticket for
its turn. A request that continues a cached
conversation resumes a worker the gate already counts (its session is in the pool's load,
like a worker back from a tool call), so it is not admitted again. While a new conversation
waits, and whenever the pool has no session slot or cells left, idle conversations are
evicted least-recently-used, and any idle past ``idle_ttl_s`` (120 s) is detached.

``tools`` / ``tool_choice``: see :mod:`mesh.api.openai.tools` (the tools are described
before the first user message, the reply is sampled under a grammar of their calls,
:mod:`mesh.api.openai.grammar`, and parsed into ``tool_calls``; a call repeated word for
word is kept once unless ``repeat_tool_calls`` is true); ``tool`` messages are rendered as
user messages that carry the result. Not supported: ``n > 1``, ``logprobs``, non-text parts.

This module holds the routes and the request checks; rendering is
:mod:`mesh.api.openai.render`, a turn's admission, attach, append and end
:mod:`mesh.api.openai.turns`, its reply bodies and stream :mod:`mesh.api.openai.replies`,
the gate helpers shared with the session API :mod:`mesh.api.admit`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from mesh.api.admit import Periodic, caller_of, queue_refusal, release
from mesh.api.conversations import ConversationCache
from mesh.api.openai.grammar import cached_grammar
from mesh.api.openai.limits import ToolsError
from mesh.api.openai.models import model_names
from mesh.api.openai.render import STRICT_SUFFIX, Prompter, is_strict, template_messages
from mesh.api.openai.replies import reply_body, reply_stream
from mesh.api.openai.schema import ChatRequest, CompletionRequest, SamplingFields, oa_error
from mesh.api.openai.tools import ToolSpec, parse_tool_choice, parse_tools
from mesh.api.openai.turns import Bad, OpenAITurns, engine_error
from mesh.api.session_wire import DEFAULT_MAX_TOKENS, MAX_STOP_LEN, TurnStream
from mesh.engine.config import SamplingParams
from mesh.engine.interface import Engine, EngineError
from mesh.gate.queue import Admission, Ticket
from mesh.template.chat import ChatFormat, ChatFormatError

__all__ = ["OpenAIAPI"]

Tokenize = Callable[[str], list[int]]
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
        self.prefix = self.prompter.prefix
        self.tokenize = tokenize
        self.strict_prefix = strict_prefix
        self.model_id, self.model_file = model_names(engine.info)
        self.max_wait_s = max_wait_s
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
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completion, methods=["POST"]),
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
            "prefix_text": self.prefix,
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

    async def _chat(self, request: Request) -> Response:
        return await self._serve(request, self._prepare_chat, chat=True)

    async def _completion(self, request: Request) -> Response:
        return await self._serve(request, self._prepare_completion, chat=False)

    async def _serve(self, request: Request, prepare: Callable[[bytes], _Prepared], *,
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
            return TurnStream(events, lambda: self.turns.end(turn))
        try:
            async for _ in turn.iterator:
                pass
        except EngineError as exc:
            turn.failed = True
            return engine_error(exc)
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
        errors = exc.errors(include_url=False)
        if any(e["type"] == "json_invalid" for e in errors):
            raise Bad(400, "the body is not valid JSON", "bad_json") from None
        parts = [f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors[:5]]
        param = ".".join(map(str, errors[0]["loc"])) if errors else None
        raise Bad(400, "; ".join(parts), "invalid_value", param) from None
